"""Load a GGUF file as a Hugging Face-style checkpoint: config.json keys, HF-named tensors, tokenizer.

Every tensor is dequantized on the host with the `gguf` package's numpy code (F32, F16, BF16 and
every block format it implements: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, the IQ formats, ...)
and cast to the requested dtype, so the model sees plain dense weights. With keep_quantized (a GGUF file's default),
the weights of linear layers and the vocabulary tensors of every type in BLOCK_LAYOUTS are decoded into
QuantizedWeights instead (kvforge.quantization.gguf_quants), F16 and BF16 ones are read as they are stored, in 16 bits
(kernels/cpu/half_gemv.py multiplies them); those of other types (the IQ2/IQ3 formats) are dequantized with a warning
naming their type and what they cost.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from kvforge.loader.gguf_architectures import ARCHITECTURES, GGUFArchitecture
from kvforge.loader.gguf_file import GGUFFile, GGUFTensor
from kvforge.loader.gguf_regroup import LayerTensors
from kvforge.quantization.gguf_blocks import BLOCK_LAYOUTS, BlockLayout, decode_blocks
from kvforge.quantization.quantized_weight import QuantizedWeight
from kvforge.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# The tensors outside the layers, and their HF names (the layers' per architecture: gguf_architectures.py).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)(?:\.(weight|bias))?")  # a few have no suffix (Qwen3-Next's ssm_a)
# The vocabulary tensors (embedding, LM head): kept quantized with keep_quantized, like the weights of linear layers.
_VOCAB_TENSORS = {"token_embd.weight", "output.weight"}
# The types of such tensors kept in their own 16 bits with keep_quantized, and their torch dtypes.
_HALF_TYPES = {GGMLQuantizationType.F16: torch.float16, GGMLQuantizationType.BF16: torch.bfloat16}
# The weights of linear layers of one output row (Qwen2-MoE's shared-expert gate), which llama-quantize writes as
# vectors [n] (the converter as [1, n])
_ONE_ROW_KINDS = frozenset({"ffn_gate_inp_shexp"})
# rope_freqs holds llama 3.x's per-frequency rope-scaling divisors. HF derives them from
# config["rope_scaling"], which such files do not record; transformers drops them too.
_ROPE_FREQS = "rope_freqs.weight"


@dataclass(slots=True)
class GGUFCheckpoint:
    """What a GGUF file holds, in Hugging Face terms."""

    config: dict[str, Any]  # config.json vocabulary: architectures, hidden_size, ...
    tensors: Mapping[str, torch.Tensor]  # HF parameter name -> dense tensor (read on access)
    tokenizer: Tokenizer
    quantized: Mapping[str, QuantizedWeight] = field(default_factory=dict)  # HF weight name -> kept blocks (decoded
    # on access)
    quantized_layouts: dict[str, BlockLayout] = field(default_factory=dict)  # HF weight name -> its block layout
    half_dtypes: dict[str, torch.dtype] = field(default_factory=dict)  # HF weight name -> the 16-bit dtype its tensor
    # in `tensors` keeps (a file's F16 and BF16 weight matrices, with keep_quantized)
    kept_bytes: int = 0  # of the kept tensors in the kernels' layout, at most (codes, a half scale and offset per
    # group), and of the 16-bit ones
    dense_numel: int = 0  # weights of the tensors that are dequantized

    def weight_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of the model's weights as loaded, the dequantized ones in dtype."""
        return self.kept_bytes + self.dense_numel * dtype.itemsize


def read_gguf_header(path: str) -> tuple[GGUFFile, str, dict, Tokenizer]:
    """(file, architecture, config.json view, tokenizer) of a GGUF file, from its metadata alone."""
    try:
        reader = GGUFFile(path)
    except (ValueError, OSError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    meta = reader.metadata
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {sorted(ARCHITECTURES)}")
    try:
        tokenizer = Tokenizer.from_gguf(reader.metadata)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    shapes = {t.name: t.shape for t in reader.tensors}
    return reader, arch, _hf_config(path, arch, meta, shapes, tokenizer), tokenizer


def load_gguf(path: str, dtype: torch.dtype, keep_quantized: bool = False) -> GGUFCheckpoint:
    """Read a GGUF file: config, dequantized tensors in `dtype` under HF names, and its tokenizer.
    keep_quantized: linear-layer weights of a type in BLOCK_LAYOUTS go to `quantized` instead, F16 or BF16 ones
    stay in `tensors` in their 16 bits (named in `half_dtypes`), and MXFP4 experts stay MXFP4 (gguf_experts.py).
    The tensors the architecture regroups (gguf_regroup.py) are read by its regrouping."""
    reader, arch, config, tokenizer = read_gguf_header(path)
    spec = ARCHITECTURES[arch]
    readers: dict[str, Callable[[], torch.Tensor]] = {}
    quantized: dict[str, Callable[[], QuantizedWeight]] = {}
    quantized_layouts: dict[str, BlockLayout] = {}
    half_dtypes: dict[str, torch.dtype] = {}
    kept_bytes = dense_numel = 0
    widened: dict[str, list[GGUFTensor]] = {}  # type name -> the weights of that type dequantized for want of a kernel
    regrouped: LayerTensors = {}  # the layer tensors of spec.regrouping's kinds
    for tensor in sorted(reader.tensors, key=functools.partial(_model_order, spec)):
        if tensor.name == _ROPE_FREQS:
            logger.warning("%s: ignoring %s (llama3-style rope scaling is not applied)", path, _ROPE_FREQS)
            continue
        match = _LAYER_TENSOR.fullmatch(tensor.name)
        if spec.regrouping is not None and match is not None and match.group(2) in spec.regrouping.kinds:
            kind, suffix = match.group(2, 3)
            regrouped.setdefault(int(match.group(1)), {})[kind if suffix is None else f"{kind}.{suffix}"] = tensor
            continue
        if match is not None and match.group(2) in _ONE_ROW_KINDS and len(tensor.shape) == 1:
            tensor = dataclasses.replace(tensor, shape=(1, *tensor.shape))
        hf_name = _hf_name(path, spec, tensor.name)
        heads = None
        if spec.rope_permuted and hf_name.split(".")[-2] in ("q_proj", "k_proj"):
            heads = config["num_attention_heads" if "q_proj" in hf_name else "num_key_value_heads"]
        offset = spec.norm_offset if hf_name.endswith("norm.weight") and not hf_name.endswith(spec.plain_norms) else 0.0
        if keep_quantized and _is_kept(spec, tensor):
            quantized[hf_name] = functools.partial(_decode_kept, reader, tensor, heads)
            layout = quantized_layouts[hf_name] = BLOCK_LAYOUTS[tensor.tensor_type]
            kept_bytes += int(tensor.n_elements) * (layout.bits * layout.group_size + 32) // (8 * layout.group_size)
            continue
        if keep_quantized and _is_weight_matrix(spec, tensor) and tensor.tensor_type in _HALF_TYPES:
            half = half_dtypes[hf_name] = _HALF_TYPES[tensor.tensor_type]
            readers[hf_name] = functools.partial(_dense_tensor, reader, tensor, heads, half)
            kept_bytes += int(tensor.n_elements) * half.itemsize
            continue
        if keep_quantized and _is_weight_matrix(spec, tensor):
            widened.setdefault(tensor.tensor_type.name, []).append(tensor)
        readers[hf_name] = functools.partial(_dense_tensor, reader, tensor, heads, dtype, offset)
        dense_numel += int(tensor.n_elements)
    if regrouped:
        assert spec.regrouping is not None
        dense = functools.partial(_read_dense, reader, dtype)
        extra = spec.regrouping.regroup(reader, regrouped, config, keep_quantized, dense)
        readers.update(extra.readers)
        quantized.update(extra.quantized)
        quantized_layouts.update(extra.layouts)
        config.update(extra.config)
        kept_bytes, dense_numel = kept_bytes + extra.kept_bytes, dense_numel + extra.dense_numel
    for type_name, tensors in widened.items():
        numel = sum(int(t.n_elements) for t in tensors)
        logger.warning("%s: %d weights of type %s (%.1f MB in the file) have no kept kernel: dequantized to %s, "
                       "%.1f MB", path, len(tensors), type_name, sum(t.nbytes for t in tensors) / 1e6,
                       str(dtype).removeprefix("torch."), numel * dtype.itemsize / 1e6)
    return GGUFCheckpoint(config, LazyTensors(readers), tokenizer, LazyTensors(quantized), quantized_layouts,
                          half_dtypes, kept_bytes, dense_numel)


Value = TypeVar("Value")


class LazyTensors(Mapping[str, Value], Generic[Value]):
    """HF name -> tensor (dense, or kept blocks), read from the file each time it is read, so a loader (one rank of
    a parallel engine, say) holds one tensor of the checkpoint at a time."""

    def __init__(self, readers: dict[str, Callable[[], Value]]) -> None:
        self._readers = readers

    def __getitem__(self, name: str) -> Value:
        return self._readers[name]()

    def __contains__(self, name: object) -> bool:  # NOTE: Mapping's would read the tensor
        return name in self._readers

    def __iter__(self) -> Iterator[str]:
        return iter(self._readers)

    def __len__(self) -> int:
        return len(self._readers)


def _dense_tensor(file: GGUFFile, tensor: GGUFTensor, heads: int | None, dtype: torch.dtype,
                  offset: float = 0.0) -> torch.Tensor:
    """The tensor in dtype: an F16 or BF16 one read in dtype its own type is, as stored (no float32 copy of it); less
    offset (what the converter added to it)."""
    if _HALF_TYPES.get(tensor.tensor_type) == dtype:
        weight = torch.from_numpy(file.read(tensor)).view(dtype).reshape(tensor.shape)
    else:
        weight = _dequantize(file, tensor)
    if heads is not None:
        weight = _undo_rope_permutation(file.path, tensor.name, weight, heads)
    if offset:
        weight = weight.float() - offset
    return weight.to(dtype)


def _read_dense(file: GGUFFile, dtype: torch.dtype, tensor: GGUFTensor) -> torch.Tensor:
    return _dense_tensor(file, tensor, None, dtype)


def _hf_config(
    path: str, arch: str, meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], tokenizer: Tokenizer
) -> dict[str, Any]:
    def value(key: str, default: Any = None) -> Any:
        found = meta.get(f"{arch}.{key}", default)
        if found is None:
            raise ValueError(f"{path}: GGUF metadata has no {arch}.{key}")
        return found

    if "token_embd.weight" not in shapes:
        raise ValueError(f"{path}: GGUF file has no token_embd.weight tensor")
    spec = ARCHITECTURES[arch]
    hidden_size = value("embedding_length")
    num_heads = value("attention.head_count")
    config: dict[str, Any] = {
        **copy.deepcopy(dict(spec.config)),
        "architectures": [spec.hf_architecture],
        "model_type": spec.model_type,
        "hidden_size": hidden_size,
        "intermediate_size": value("feed_forward_length"),
        "num_hidden_layers": value("block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": value("attention.head_count_kv", num_heads),
        "head_dim": value("attention.key_length", hidden_size // num_heads),
        "rms_norm_eps": value("attention.layer_norm_rms_epsilon"),
        "rope_theta": value("rope.freq_base", 10000.0),
        "max_position_embeddings": value("context_length"),
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }
    rope_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_type != "none":
        scaling = {**config.get("rope_scaling", {}), "rope_type": rope_type, "factor": value("rope.scaling.factor")}
        if f"{arch}.rope.scaling.original_context_length" in meta:
            scaling["original_max_position_embeddings"] = value("rope.scaling.original_context_length")
        config["rope_scaling"] = scaling
    else:
        config.pop("rope_scaling", None)
    for key, hf_key in spec.metadata.items():
        outer, _, inner = hf_key.partition(".")
        if f"{arch}.{key}" not in meta:
            continue
        if not inner:
            config[outer] = meta[f"{arch}.{key}"]
        elif outer in config:  # an entry of a section the file has (rope_scaling of its scaling type)
            config[outer][inner] = meta[f"{arch}.{key}"]
    pattern = config.get("sliding_window_pattern")
    if isinstance(pattern, list):  # a flag a layer: whether it is local
        config["layer_types"] = ["sliding_attention" if local else "full_attention" for local in pattern]
        del config["sliding_window_pattern"]
    if spec.derive is not None:
        config.update(spec.derive(config, {k.removeprefix(f"{arch}."): v for k, v in meta.items()}, shapes))
    return config


def _hf_name(path: str, spec: GGUFArchitecture, name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    layer, kind, suffix = match.groups() if match is not None else (None, None, None)
    if f"{kind}.{suffix}" in spec.layer_names:  # a parameter of its own (GPT-OSS's sinks), not a module's weight
        return f"model.layers.{layer}.{spec.layer_names[f'{kind}.{suffix}']}"
    if kind not in spec.layer_names or suffix is None:
        raise ValueError(f"{path}: unexpected tensor {name!r} in GGUF file")
    return f"model.layers.{layer}.{spec.layer_names[kind]}.{suffix}"


def _dequantize(file: GGUFFile, tensor: GGUFTensor) -> torch.Tensor:
    """Dense float32 copy of a GGUF tensor, in PyTorch (row-major, [out, in]) order."""
    try:
        values = dequantize(file.read(tensor), tensor.tensor_type)
    except NotImplementedError as e:
        raise ValueError(
            f"{file.path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which gguf cannot dequantize"
        ) from e
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(tensor.shape))


def _model_order(spec: GGUFArchitecture, tensor: GGUFTensor) -> tuple[int, int]:
    """Where a tensor comes in the order the model runs them: the global ones first, then layer by layer, each
    layer's in the order of spec.layer_names (q, k, v, o, gate, up, down), not the file's (llama.cpp writes them by
    name).
    NOTE: a layer's weight is packed when its last shard is read, into the weight arena in that order
    (quantization/weight_only_kernels.py's PanelArena), which a decode step then reads in one run."""
    match = _LAYER_TENSOR.fullmatch(tensor.name)
    if match is None:
        return -1, 0
    kinds = list(spec.layer_names)
    return int(match.group(1)), kinds.index(match.group(2)) if match.group(2) in kinds else 0


def _is_weight_matrix(spec: GGUFArchitecture, tensor: GGUFTensor) -> bool:
    """A linear layer's weight or a vocabulary tensor: what keep_quantized keeps in the file's type."""
    match = _LAYER_TENSOR.fullmatch(tensor.name)
    linear = match is not None and match.group(2) in spec.linear_kinds and match.group(3) == "weight"
    return linear or tensor.name in _VOCAB_TENSORS


def _is_kept(spec: GGUFArchitecture, tensor: GGUFTensor) -> bool:
    return _is_weight_matrix(spec, tensor) and tensor.tensor_type in BLOCK_LAYOUTS


def _decode_kept(file: GGUFFile, tensor: GGUFTensor, heads: int | None) -> QuantizedWeight:
    """A kept tensor's blocks as a QuantizedWeight, its rows in HF order (the rope permutation only
    reorders output rows, so it moves codes, scales and zero points alike)."""
    try:
        weight = decode_blocks(file.read(tensor), tensor.tensor_type, tensor.shape)
    except ValueError as e:
        raise ValueError(f"{file.path}: tensor {tensor.name}: {e}") from e
    if heads is None:
        return weight
    codes, scales, zeros = (
        _undo_rope_permutation(file.path, tensor.name, t, heads) for t in (weight.codes, weight.scales, weight.zeros)
    )
    return QuantizedWeight(codes, scales, zeros, weight.bits)


def _undo_rope_permutation(path: str, name: str, weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Give back the HF row order of a q/k weight (or bias) that llama.cpp's converter permuted.

    Within each head of `head_dim` rows, HF keeps the two rotated halves apart and llama.cpp
    interleaves them:

        HF        [a0 a1 .. a(d/2-1) | b0 b1 .. b(d/2-1)]
        llama.cpp [a0 b0 a1 b1 .. a(d/2-1) b(d/2-1)]
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{path}: {name} has {rows} rows, not a multiple of 2 * {num_heads} heads")
    interleaved = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return interleaved.transpose(1, 2).reshape(weight.shape).contiguous()
