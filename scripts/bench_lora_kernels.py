"""Batched LoRA on a GPU: the per-row (BGMV) and segmented (SGMV) Triton forms of shrink + expand by row count, and
the fused MoE with and without its experts' LoRA. Sets tuning.lora_segmented's row count; run on a quiet machine:

    python scripts/bench_lora_kernels.py            # bf16, 4 adapters of rank 16 (one per row, round robin)
"""

from __future__ import annotations

import torch
import triton.testing

from kvforge.kernels.fused_moe import fused_moe_triton
from kvforge.kernels.lora import lora_expand_triton, lora_shrink_triton
from kvforge.kernels.moe_lora import ExpertLoRA

HIDDEN, NUM_OUT, RANK, NUM_SLOTS = 4096, 4096, 16, 4
EXPERTS, INTER, TOP_K = 128, 768, 8  # a Qwen3-30B-A3B MoE layer
DTYPE, DEVICE = torch.bfloat16, torch.device("cuda")


def _lora_ms(num_rows: int, segmented: bool) -> float:
    x = torch.randn(num_rows, HIDDEN, dtype=DTYPE, device=DEVICE)
    a = torch.randn(NUM_SLOTS, RANK, HIDDEN, dtype=DTYPE, device=DEVICE)
    b = torch.randn(NUM_SLOTS, NUM_OUT, RANK, dtype=DTYPE, device=DEVICE)
    y = torch.randn(num_rows, NUM_OUT, dtype=DTYPE, device=DEVICE)
    slots = torch.arange(num_rows, device=DEVICE) % NUM_SLOTS
    return triton.testing.do_bench(
        lambda: lora_expand_triton(lora_shrink_triton(x, a, slots, segmented), b, slots, y, segmented))


def _moe_ms(num_tokens: int, with_lora: bool) -> float:
    hidden = torch.randn(num_tokens, HIDDEN // 2, dtype=DTYPE, device=DEVICE)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN // 2, dtype=DTYPE, device=DEVICE) * 0.02
    w2 = torch.randn(EXPERTS, HIDDEN // 2, INTER, dtype=DTYPE, device=DEVICE) * 0.02
    ids = torch.stack([torch.randperm(EXPERTS, device=DEVICE)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, TOP_K, device=DEVICE)
    lora = None
    if with_lora:
        shapes = [(2 * RANK, HIDDEN // 2), (2 * INTER, 2 * RANK), (RANK, INTER), (HIDDEN // 2, RANK)]
        lora = ExpertLoRA(*(torch.randn(NUM_SLOTS, EXPERTS, *s, dtype=DTYPE, device=DEVICE) * 0.02 for s in shapes),
                          torch.arange(num_tokens, device=DEVICE) % NUM_SLOTS)
    return triton.testing.do_bench(lambda: fused_moe_triton(hidden, w13, w2, weights, ids, lora))


def main() -> None:
    print(f"{torch.cuda.get_device_name()}  LoRA shrink+expand {HIDDEN}->{RANK}->{NUM_OUT}, {NUM_SLOTS} adapters")
    print(f"{'rows':>6} {'per-row ms':>11} {'segmented ms':>13}")
    for rows in (1, 16, 64, 256, 1024, 4096):
        print(f"{rows:>6} {_lora_ms(rows, False):>11.3f} {_lora_ms(rows, True):>13.3f}")
    print(f"fused MoE {EXPERTS} experts top-{TOP_K}, inter {INTER}: without / with expert LoRA")
    for tokens in (1, 16, 256, 2048):
        print(f"{tokens:>6} {_moe_ms(tokens, False):>11.3f} {_moe_ms(tokens, True):>13.3f}")


if __name__ == "__main__":
    main()
