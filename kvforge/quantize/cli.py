"""`kvforge quantize`: quantize a float model (or the default GGUF model, from its dequantized weights)
with RTN, GPTQ, AWQ or W8A8 and write a checkpoint folder that `LLM(model=folder)` loads."""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

from kvforge.quantize.calibration import default_calibration_texts, read_calibration_files


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="float HF checkpoint folder or .gguf file (default model)"
    )
    parser.add_argument("--method", required=True, choices=["rtn", "gptq", "awq", "w8a8"])
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8], help="weight bits (w8a8: 8)")
    parser.add_argument("--group-size", type=int, default=64, help="input features per scale (-1: per row)")
    parser.add_argument("--sym", action="store_true", help="symmetric codes (rtn, gptq; default asymmetric)")
    parser.add_argument(
        "--act-order", action="store_true", help="gptq: quantize by decreasing Hessian diagonal"
    )
    parser.add_argument("--out", required=True, help="output checkpoint folder")
    parser.add_argument(
        "--calibration", action="append", default=[],
        help="calibration text file (repeatable; default: the shipped set, kvforge/data/calibration)",
    )  # fmt: skip
    parser.add_argument("--num-sequences", type=int, default=128, help="calibration sequences")
    parser.add_argument("--sequence-length", type=int, default=512, help="tokens per calibration sequence")
    parser.add_argument("--seed", type=int, default=0, help="where the calibration sequences start")
    parser.add_argument(
        "--damp", type=float, default=0.01, help="gptq: dampening, relative to the mean Hessian diagonal"
    )


def run(args: argparse.Namespace) -> int:
    from kvforge.llm import LLM
    from kvforge.quantize.checkpoint import checkpoint_tensors, write_checkpoint
    from kvforge.quantize.quantizer import QuantizeOptions, quantize_engine_model

    bits = 8 if args.method == "w8a8" else args.bits
    options = QuantizeOptions(
        args.method, bits, args.group_size, args.sym, args.act_order, args.num_sequences, args.sequence_length,
        args.damp, args.seed,
    )  # fmt: skip
    config = options.config()
    texts = read_calibration_files(args.calibration) if args.calibration else default_calibration_texts()
    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="float32",
        device="cpu",
        max_model_len=max(args.sequence_length, 16),
        kv_cache_memory="256MiB",
    )
    engine = llm.engine
    results = quantize_engine_model(engine, options, texts)
    model = engine.local_model
    tensors = checkpoint_tensors(model, results, config)
    source = Path(engine.model_name)
    write_checkpoint(
        Path(args.out),
        engine.hf_config,
        tensors,
        config,
        engine.tokenizer,
        source if source.is_dir() else None,
    )
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    print(f"wrote {args.method} {bits}-bit checkpoint to {args.out} in {time.perf_counter() - start:.1f} s, "
          f"peak memory {peak_mib:.0f} MiB")  # fmt: skip
    return 0
