"""Which quantization a model runs with: from a checkpoint's `quantization_config`, or an engine option
that quantizes a float checkpoint on the fly (round-to-nearest, or fp8)."""

from __future__ import annotations

from dataclasses import dataclass, field

# Engine option -> (method, bits, group_size, sym) for on-the-fly round-to-nearest quantization.
# NOTE: groups of 64: the default model's widths (576, 1536) are multiples of 64, not 128. W8A16 per row and
# symmetric put the default model 1.15% above float32 on the held-out licence text (a row spends its 255
# steps on its largest weight); asymmetric groups of 64 keep every held-out text within 0.3% for 1/8 more
# bytes (benchmarks/RESULTS.md, quantization quality).
ONLINE_METHODS = {
    "w8a16": ("rtn", 8, 64, False),
    "w4a16": ("rtn", 4, 64, False),
    "w8a8": ("w8a8", 8, -1, True),
    "fp8": ("fp8", 8, -1, True),
}
CHECKPOINT_METHODS = ("gptq", "awq", "w8a8", "fp8", "mxfp4")
# Every method (a key of quantization/registry.py's LINEAR_FORMATS) -> the code widths it takes
METHOD_BITS = {"gptq": (4, 8), "awq": (4,), "w8a8": (8,), "fp8": (8,), "mxfp4": (4,), "rtn": (4, 8)}
FP8_ACTIVATION_SCHEMES = ("dynamic", "static")
GPTQ_FORMATS = ("gptq", "gptq_v2")  # v1 stores zero points minus one; v2 stores them as they are


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """method: "gptq" / "awq" (checkpoint formats), "rtn" (float checkpoint, quantized at load time),
    "w8a8" (int8 weights and per-token int8 activations), "fp8" (e4m3 weights, per-channel scales) or "mxfp4"
    (GPT-OSS: MoE experts in MXFP4, read by the model from their tensor names; every linear layer stays float).
    group_size -1 means one group per row."""

    method: str
    bits: int
    group_size: int = -1
    sym: bool = True
    desc_act: bool = False
    checkpoint_format: str = "gptq"
    smoothquant: bool = False
    modules_to_not_convert: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.method not in METHOD_BITS:
            raise ValueError(f"quantization method must be one of {tuple(METHOD_BITS)}, got {self.method!r}")
        allowed_bits = METHOD_BITS[self.method]
        if self.bits not in allowed_bits:
            raise ValueError(f"{self.method} supports bits in {allowed_bits}, got {self.bits}")
        if self.group_size != -1 and (self.group_size < 16 or self.group_size & (self.group_size - 1)):
            raise ValueError(f"group_size must be -1 or a power of two >= 16, got {self.group_size}")
        if self.checkpoint_format not in GPTQ_FORMATS:
            raise ValueError(
                f"checkpoint_format must be one of {GPTQ_FORMATS}, got {self.checkpoint_format!r}"
            )

    @classmethod
    def from_hf(cls, config: dict) -> QuantConfig:
        """Parse a config.json `quantization_config` (GPTQ, AWQ, fp8 or kvforge's W8A8)."""
        method = str(config.get("quant_method", "")).lower()
        if method not in CHECKPOINT_METHODS:
            raise ValueError(
                f"unsupported quantization_config quant_method {method!r}; supported: {CHECKPOINT_METHODS}"
            )
        if method == "fp8":
            return cls._fp8_from_hf(config)
        if method == "mxfp4":
            return cls("mxfp4", 4, 32, modules_to_not_convert=tuple(config.get("modules_to_not_convert") or ()))
        if method == "awq":
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"only the GEMM layout of AWQ is supported, got version {version!r}")
            return cls(
                "awq",
                int(config.get("bits", config.get("w_bit", 4))),
                int(config.get("group_size", config.get("q_group_size", 128))),
                sym=not config.get("zero_point", True),
                modules_to_not_convert=tuple(config.get("modules_to_not_convert") or ()),
            )
        return cls(
            method,
            int(config.get("bits", 8)),
            int(config.get("group_size", -1)),
            sym=bool(config.get("sym", True)),
            desc_act=bool(config.get("desc_act", False)),
            checkpoint_format=str(config.get("checkpoint_format", "gptq")),
            smoothquant=bool(config.get("smoothquant", False)),
            modules_to_not_convert=tuple(config.get("modules_to_not_convert") or ()),
        )

    @classmethod
    def _fp8_from_hf(cls, config: dict) -> QuantConfig:
        """AutoFP8 / llm-compressor / vLLM fp8: per-tensor or per-channel weight scales."""
        if config.get("weight_block_size"):
            raise ValueError(
                f"fp8 checkpoints with block-wise scales (weight_block_size={config['weight_block_size']}) "
                "are not supported; per-tensor and per-channel weight_scale are"
            )
        scheme = str(config.get("activation_scheme", "dynamic"))
        if scheme not in FP8_ACTIVATION_SCHEMES:
            raise ValueError(f"fp8 activation_scheme must be one of {FP8_ACTIVATION_SCHEMES}, got {scheme!r}")
        skipped = config.get("ignored_layers") or config.get("modules_to_not_convert") or ()
        return cls("fp8", 8, modules_to_not_convert=tuple(skipped))

    @classmethod
    def online(cls, name: str) -> QuantConfig:
        """The config of an engine option `quantization=name` applied to a float checkpoint."""
        if name not in ONLINE_METHODS:
            raise ValueError(f"quantization must be one of {sorted(ONLINE_METHODS)}, got {name!r}")
        method, bits, group_size, sym = ONLINE_METHODS[name]
        return cls(method, bits, group_size, sym)

    def to_hf(self) -> dict:
        """The `quantization_config` that config.json records for a checkpoint in this format."""
        if self.method == "awq":
            return {
                "quant_method": "awq",
                "bits": self.bits,
                "group_size": self.group_size,
                "zero_point": not self.sym,
                "version": "gemm",
                "modules_to_not_convert": list(self.modules_to_not_convert) or None,
            }
        if self.method == "fp8":
            return {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if self.method == "mxfp4":
            return {"quant_method": "mxfp4"}
        if self.method == "w8a8":
            return {
                "quant_method": "w8a8",
                "bits": 8,
                "group_size": -1,
                "sym": True,
                "smoothquant": self.smoothquant,
            }
        return {
            "quant_method": "gptq",
            "bits": self.bits,
            "group_size": self.group_size,
            "sym": self.sym,
            "desc_act": self.desc_act,
            "checkpoint_format": self.checkpoint_format,
        }


def resolve_quant_config(hf_config: dict, option: str | None) -> QuantConfig | None:
    """The checkpoint's quantization, or the engine option's; both at once is an error."""
    stored = hf_config.get("quantization_config")
    if stored is not None and option is not None:
        raise ValueError(
            f"the checkpoint is already quantized ({stored.get('quant_method')!r}); "
            f"drop quantization={option!r}"
        )
    if stored is not None:
        return QuantConfig.from_hf(stored)
    return None if option is None else QuantConfig.online(option)
