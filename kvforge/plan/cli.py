"""`kvforge plan`: memory per device and roofline speed of each tensor x pipeline split, and the one to use; with
--request-rate, how many data-parallel replicas of which split serve that rate within a TTFT bound."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace

from kvforge.config import parse_bytes
from kvforge.plan.devices import DEVICE_TYPES, get_device
from kvforge.plan.estimate import PlanOptions, make_plan
from kvforge.plan.model_shape import known_model_names, load_model_shape
from kvforge.plan.precision import KV_CACHE_DTYPES, WEIGHT_DTYPES, resolve_precision
from kvforge.plan.replicas import Traffic, format_replicas, plan_replicas
from kvforge.plan.report import format_plan, plan_to_dict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="HF checkpoint folder, .gguf file, config.json, or a shipped config: "
                             f"{', '.join(known_model_names())} (default: the default model)")  # fmt: skip
    parser.add_argument("--devices", type=int, default=1, help="devices to split the model over")
    parser.add_argument("--device-type", default="h200", help=f"one of {', '.join(DEVICE_TYPES)} (default h200)")
    parser.add_argument("--device-memory", default=None, help="override the device memory, e.g. 80GiB")
    parser.add_argument("--dtype", default="auto",
                        help=f"linear-layer weights: {', '.join(WEIGHT_DTYPES)} (auto: the checkpoint's format; "
                             "float32 on cpu)")  # fmt: skip
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help=f"{', '.join(KV_CACHE_DTYPES)} (auto: the activation dtype)")
    parser.add_argument("--context", type=int, default=4096, help="tokens per sequence (prompt + output)")
    parser.add_argument("--batch", type=int, default=None,
                        help="sequences decoded together (default: the most that fit, up to --max-num-seqs)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step, as the engine")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="share of device memory to use")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="KV cache bytes per device, e.g. 20GiB (default: as the engine sizes it: what "
                             "--max-num-seqs sequences of the model's length need, within what is left)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    group = parser.add_argument_group("data-parallel replicas (with --request-rate: --devices is the most to use)")
    group.add_argument("--request-rate", type=float, default=None,
                       help="requests/s to serve: plan how many replicas of which TP x PP split serve it")
    group.add_argument("--prompt-tokens", type=int, default=1024, help="prompt tokens per request")
    group.add_argument("--output-tokens", type=int, default=256, help="output tokens per request")
    group.add_argument("--ttft-ms", type=float, default=1000.0, help="bound on the mean time to first token")
    group.add_argument("--prefix-hit-rate", type=float, default=0.0,
                       help="share of prompt tokens found in the prefix cache (shared system prompts kept on one "
                            "replica by the router)")


def run(args: argparse.Namespace) -> int:
    if args.devices < 1:
        raise ValueError(f"--devices must be >= 1, got {args.devices}")
    device = get_device(args.device_type)
    if args.device_memory is not None:
        device = replace(device, memory_gib=parse_bytes(args.device_memory) / 2**30)
    options = PlanOptions(
        num_devices=args.devices, context_len=args.context, batch_size=args.batch,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=None if args.kv_cache_memory is None else parse_bytes(args.kv_cache_memory),
    )  # fmt: skip
    shape = load_model_shape(args.model)
    precision = resolve_precision(args.dtype, args.kv_cache_dtype, shape.checkpoint_format, device)
    if args.request_rate is not None:
        traffic = Traffic(args.request_rate, args.prompt_tokens, args.output_tokens, args.ttft_ms,
                          args.prefix_hit_rate)
        estimates, best = plan_replicas(shape, device, precision, options, traffic)
        if args.json:
            as_dict = lambda e: {**asdict(e), "num_devices": e.num_devices}
            print(json.dumps({"replicas": [as_dict(e) for e in estimates],
                              "recommended": None if best is None else as_dict(best)}, indent=2))
        else:
            print(format_replicas(estimates, best, traffic, args.devices))
        return 0
    plan = make_plan(shape, device, precision, options)
    print(json.dumps(plan_to_dict(plan), indent=2) if args.json else format_plan(plan))
    return 0
