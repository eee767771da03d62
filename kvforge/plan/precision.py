"""Bytes per weight and per cached value, and which matrix units a weight format runs on.

Only the linear-layer matrices take the weight format (the embedding, LM head, norms and biases stay in
the activation dtype, as the engine's quantized layers leave them); an 8-bit KV cache keeps one float32
scale per row of head_dim beside its codes, as the engine's quantized cache does.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvforge.plan.devices import DeviceSpec

# NOTE: fp8 carries one float32 scale per 128 x 128 block (DeepSeek-V3's layout); int4 one 16-bit scale
# and a 4-bit zero point per group of 128 inputs (GPTQ's layout); int8 per-channel scales (negligible).
WEIGHT_BYTES: dict[str, float] = {
    "fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0 + 4 / (128 * 128), "int8": 1.0, "int4": 0.5 + 2.5 / 128,
}
KV_CACHE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1}
KV_SCALE_BYTES = 4  # a float32 scale per row of head_dim in an 8-bit cache
WEIGHT_DTYPES = ("auto", *WEIGHT_BYTES)
KV_CACHE_DTYPES = ("auto", *KV_CACHE_BYTES)


@dataclass(frozen=True, slots=True)
class Precision:
    """The weight format of the linear layers and the KV cache dtype, both resolved (no "auto")."""

    weight_dtype: str
    kv_cache_dtype: str

    def __post_init__(self) -> None:
        if self.weight_dtype not in WEIGHT_BYTES:
            raise ValueError(f"weight dtype must be one of {', '.join(WEIGHT_BYTES)}, got {self.weight_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_BYTES:
            raise ValueError(
                f"KV cache dtype must be one of {', '.join(KV_CACHE_BYTES)}, got {self.kv_cache_dtype!r}"
            )

    @property
    def weight_bytes(self) -> float:
        return WEIGHT_BYTES[self.weight_dtype]

    @property
    def activation_bytes(self) -> int:
        """Activations, embeddings and norms: float32 beside float32 weights, else 16-bit."""
        return 4 if self.weight_dtype == "fp32" else 2

    @property
    def kv_value_bytes(self) -> int:
        return KV_CACHE_BYTES[self.kv_cache_dtype]

    @property
    def kv_scale_bytes(self) -> int:
        """Bytes of scale per row of head_dim (0 unless the cache is 8-bit)."""
        return KV_SCALE_BYTES if self.kv_value_bytes == 1 else 0

    def matmul_tflops(self, device: DeviceSpec) -> float:
        """Dense matrix throughput of the units this format runs on (a weight-only format: 16-bit units)."""
        if self.weight_dtype == "fp32":
            return device.peak.fp32_tflops
        if self.weight_dtype == "fp8" and device.fp8_tflops is not None:
            return device.fp8_tflops
        if self.weight_dtype == "int8" and device.int8_tops is not None:
            return device.int8_tops
        return device.peak.bf16_tflops


def resolve_precision(weight_dtype: str, kv_cache_dtype: str, checkpoint_format: str, device: DeviceSpec
                      ) -> Precision:  # fmt: skip
    """Replace "auto": the engine runs float32 on a CPU and the checkpoint's format (bf16 for float
    checkpoints) on an accelerator; the cache is float16 on a CPU and follows the activations elsewhere."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {weight_dtype!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    if weight_dtype == "auto":
        weight_dtype = "fp32" if device.host else checkpoint_format
    if kv_cache_dtype == "auto":
        kv_cache_dtype = "fp16" if device.host else "fp32" if weight_dtype == "fp32" else "bf16"
    return Precision(weight_dtype, kv_cache_dtype)
