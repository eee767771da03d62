"""Quantization on the CPU: perplexity, weight memory and decode speed of the default model per format.

python -m kvforge.benchmarks.quantization_cpu --checkpoints DIR   (writes DIR/gptq and DIR/awq first)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvforge.cli import main as kvforge_main
from kvforge.eval.perplexity import default_evaluation_texts, perplexity
from kvforge.kernels.cpu.extension import cpu_kernels
from kvforge.llm import LLM
from kvforge.sampling_params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who retires to a small town."


def weight_mib(llm: LLM) -> float:
    model = llm.engine.local_model
    tensors = [*model.parameters(), *(b for b in model.buffers() if b is not None)]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


def decode_tokens_per_s(llm: LLM, batch: int, max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    llm.generate([PROMPT] * batch, params)  # warm-up, also fills the prefix cache
    start = time.perf_counter()
    outputs = llm.generate([f"{i}. {PROMPT}" for i in range(batch)], params)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def _write_checkpoints(root: Path) -> None:
    """4-bit GPTQ (act-order) and AWQ checkpoints of the default model, unless already there."""
    for method in ("gptq", "awq"):
        if not (root / method / "config.json").is_file():
            extra = ["--act-order"] if method == "gptq" else []
            kvforge_main(["quantize", "--method", method, "--bits", "4", "--group-size", "64",
                          "--out", str(root / method), *extra])


def _runs(root: Path) -> list[tuple[str, dict]]:
    return [
        ("float32", {}),
        ("bfloat16", {"dtype": "bfloat16"}),
        ("W8A16 (RTN)", {"quantization": "w8a16"}),
        ("W4A16 RTN g64", {"quantization": "w4a16"}),
        ("W4A16 GPTQ g64 act-order", {"model": str(root / "gptq")}),
        ("W4A16 AWQ g64", {"model": str(root / "awq")}),
        ("W8A8 (dynamic per-token)", {"quantization": "w8a8"}),
        ("GGUF Q4_1 kept quantized", {"quantization": "gguf"}),
        ("FP8 e4m3 per channel", {"quantization": "fp8"}),
        ("float32, int8 KV cache", {"kv_cache_dtype": "int8"}),
        ("float32, fp8 KV cache", {"kv_cache_dtype": "fp8"}),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", required=True)
    root = Path(parser.parse_args().checkpoints)
    _write_checkpoints(root)
    cpu_kernels()  # NOTE: compile or load the C++ kernels first, so the first row does not pay for it
    token_ids = None
    print(
        "| format | perplexity | weight memory (MiB) | ppl tokens/s "
        "| decode tok/s, 1 stream | decode tok/s, 16 streams |"
    )
    print("|---|---|---|---|---|---|")
    for name, kwargs in _runs(root):
        llm = LLM(kv_cache_memory="256MiB", **kwargs)
        token_ids = token_ids or llm.get_tokenizer().encode(default_evaluation_texts()["prose"])
        result = perplexity(llm.engine, token_ids, max_length=512, stride=256)
        single = decode_tokens_per_s(llm, 1, 64)
        batched = decode_tokens_per_s(llm, 16, 32)
        print(
            f"| {name} | {result.perplexity:.3f} | {weight_mib(llm):.0f} | {result.tokens_per_second:.0f} | "
            f"{single:.1f} | {batched:.1f} |",
            flush=True,
        )
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
