"""Kept GGUF weights at prompt and decode sizes on the CPU: the int8 panel kernel against the weight unpacked to
bfloat16 and torch's bfloat16 GEMM (kernels/cpu/panel_bf16.py), on one layer of a real file.

    python -m kvforge.benchmarks.panel_bf16_cpu FILE.gguf [--layer 0] [--rows 1,16,32,64,512] [--rounds 9]
        [--threads 2]

Each of the layer's matrices (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down: a Llama-3.2-1B file's
are 2048x2048, 512x2048, 512x2048, 2048x2048, 8192x2048, 8192x2048, 2048x8192) is decoded from the file and packed
as the loader packs it (one PanelArena, whose buffer the unpacked weights share), then for each row count the two
paths take turns (A B A B ...) over the whole layer, `rounds` times; the table gives each path's median time for
the layer, the median of the rounds' ratios (int8 / bfloat16: above 1 the bfloat16 GEMM is faster), and the
unpacking alone. A ratio is what to read on a shared machine: both paths meet the same load in each round.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGUFReader

from kvforge.kernels.cpu.panel_bf16 import panel_linear_bf16, unpack_available, unpack_bf16
from kvforge.kernels.cpu.quant_panels import panel_linear, panels_available
from kvforge.kernels.ops import TORCH_OPS
from kvforge.quantization.gguf_blocks import decode_blocks
from kvforge.quantization.weight_only_kernels import PanelArena, PanelKernel, select_kernel

KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def layer_kernels(path: str, layer: int) -> list[tuple[str, PanelKernel]]:
    """The layer's matrices as kept panel weights, in one arena (named with their GGUF type)."""
    reader = GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    arena = PanelArena(torch.get_num_threads(), 256 << 20, huge_pages=False)
    kernels = []
    for kind in KINDS:
        tensor = tensors[f"blk.{layer}.{kind}.weight"]
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists the columns first
        weight = decode_blocks(np.asarray(tensor.data).reshape(shape[0], -1), tensor.tensor_type, shape)
        kernel = select_kernel(weight, torch.device("cpu"), torch.float32, TORCH_OPS, arena=arena)
        if not isinstance(kernel, PanelKernel):
            raise ValueError(f"{tensor.name} ({tensor.tensor_type.name}) does not take the panel kernel here")
        kernels.append((f"{kind} {tensor.tensor_type.name} {shape[0]}x{shape[1]}", kernel))
    return kernels


def _timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--rows", default="1,16,32,64,512")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not (panels_available() and unpack_available()):
        raise SystemExit("needs the C++ kernels with AVX-512 VNNI and a CPU that multiplies bfloat16")
    torch.set_num_threads(args.threads)
    kernels = layer_kernels(args.file, args.layer)
    for name, _ in kernels:
        print(name)
    print(f"{'rows':>5} {'int8 ms':>9} {'bf16 ms':>9} {'int8/bf16':>9} {'unpack ms':>9}")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = [torch.randn(rows, k.in_features) for _, k in kernels]

        def int8() -> None:
            for (_, k), x in zip(kernels, inputs):
                panel_linear(x, k.weight, k.factor, k.bits, k.out_features)

        def bf16() -> None:
            for (_, k), x in zip(kernels, inputs):
                panel_linear_bf16(x, k.weight, k.factor, k.bits, k.out_features, k.unpack_buffer)

        def unpack() -> None:
            for _, k in kernels:
                unpack_bf16(k.weight, k.factor, k.bits, k.out_features, k.unpack_buffer.take(k.in_features,
                                                                                            k.out_features))

        times: dict[str, list[float]] = {"int8": [], "bf16": [], "unpack": []}
        for call in (int8, bf16, unpack):  # warm
            call()
        for _ in range(args.rounds):
            for label, call in (("int8", int8), ("bf16", bf16), ("unpack", unpack)):
                times[label].append(_timed(call))
        ratio = statistics.median(a / b for a, b in zip(times["int8"], times["bf16"]))
        med = {label: statistics.median(t) * 1e3 for label, t in times.items()}
        print(f"{rows:>5} {med['int8']:>9.2f} {med['bf16']:>9.2f} {ratio:>9.2f} {med['unpack']:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
