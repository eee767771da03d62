"""GPTQ and AWQ checkpoints: their tensors, their int32 packings, and how they become a QuantizedWeight.

GPTQ (AutoGPTQ / GPTQModel), for out_features N, in_features K, G groups, pack = 32 / bits:

    qweight [K / pack, N] int32   codes packed along K: feature k in word k // pack, bits (k % pack) * bits
    qzeros  [G, N / pack] int32   zero points packed along N the same way
    scales  [G, N]        float
    g_idx   [K]           int32   group of each input feature (act-order permutes it)
    W[n, k] = (code - zero) * scale, where the v1 format ("gptq") stores zero - 1 (a historical
    off-by-one in AutoGPTQ's packer) and v2 ("gptq_v2") stores zero itself.

AWQ (GEMM layout), 4 bits only:

    qweight [K, N / 8]    int32   codes packed along N, nibble i of word j holding column 8 j + ORDER[i]
    qzeros  [G, N / 8]    int32   same packing;  scales [G, N] float;  W = (code - zero) * scale
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvforge.quantization.linear_method import WeightOnlyMethod, drop_parameters
from kvforge.quantization.quantized_weight import QuantizedWeight

if TYPE_CHECKING:
    from kvforge.layers.linear import Linear
    from kvforge.quantization.config import QuantConfig

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its group of 8


def pack_int32(
    codes: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """Pack integer codes in [0, 2**bits) into int32 words along dim (0 or 1).

    order[i]: which of the 32 / bits consecutive codes goes to slot i (bits i * bits up); default in order."""
    pack = 32 // bits
    moved = codes.to(torch.int64).movedim(dim, -1)
    if moved.shape[-1] % pack:
        raise ValueError(f"cannot pack {moved.shape[-1]} codes into words of {pack}")
    words = moved.reshape(*moved.shape[:-1], -1, pack)
    slots = words[..., list(order)] if order is not None else words
    shifts = torch.arange(pack, dtype=torch.int64) * bits
    packed = (slots << shifts).sum(dim=-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # as signed int32 words
    return packed.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(
    packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
) -> torch.Tensor:
    """The inverse of pack_int32: int32 words -> int64 codes, unpacked along dim."""
    pack = 32 // bits
    moved = packed.to(torch.int64).movedim(dim, -1)
    shifts = torch.arange(pack, dtype=torch.int64) * bits
    slots = (moved[..., None] >> shifts) & (2**bits - 1)  # [..., words, pack]
    if order is not None:
        codes = torch.empty_like(slots)
        codes[..., list(order)] = slots
        slots = codes
    return slots.reshape(*moved.shape[:-1], -1).movedim(-1, dim)


class _PackedMethod(WeightOnlyMethod):
    """Shared loading: every tensor is [.., N] or [.., N / pack] with the output features last."""

    def __init__(self, bits: int, group_size: int) -> None:
        self.bits, self.group_size = bits, group_size
        self.pack = 32 // bits

    def num_groups(self, layer: Linear) -> int:
        if self.group_size == -1:
            return 1
        if layer.in_features % self.group_size:
            raise ValueError(
                f"in_features {layer.in_features} is not a multiple of group_size {self.group_size}"
            )
        return layer.in_features // self.group_size

    def _register(self, layer: Linear, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        tensor = torch.zeros(shape, dtype=dtype, device=layer.param_device)
        layer.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))

    def checkpoint_axes(self, param_name: str) -> tuple[int | None, int | None] | None:
        if param_name == "bias":
            return None
        return (None, 0) if param_name == "g_idx" else (1, 0)

    def load_shard(self, layer: Linear, param_name: str, shard: int, tensor: torch.Tensor) -> bool:
        if param_name == "bias":
            return False
        param = getattr(layer, param_name, None)
        if param is None:
            raise ValueError(f"checkpoint has a {param_name} that a {type(self).__name__} layer does not use")
        start, size = layer.shard_offsets[shard], layer.shard_sizes[shard]
        if param_name == "g_idx":
            _load_shared(param, tensor)
            return True
        divisor = param.shape[-1] * 1.0 / layer.out_features  # 1, or 1 / pack for packed along N
        begin, width = int(start * divisor), int(size * divisor)
        if width * layer.out_features != size * param.shape[-1] or tuple(tensor.shape) != (
            param.shape[0],
            width,
        ):
            raise ValueError(
                f"checkpoint {param_name} of shape {tuple(tensor.shape)} does not fit shard {shard} "
                f"of shape {(param.shape[0], width)}"
            )
        param.data[:, begin : begin + width].copy_(tensor)
        return True


def _load_shared(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """g_idx is one vector for all shards of a merged layer (they share the input, so the Hessian)."""
    tensor = tensor - tensor.min()  # a row-parallel slice starts at a later group
    if tensor.shape != param.shape:
        raise ValueError(f"checkpoint g_idx of shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    if (param >= 0).all() and not torch.equal(param.data, tensor.to(param.dtype)):
        raise ValueError("the shards of a merged layer have different g_idx (act-order permutations)")
    param.data.copy_(tensor)


class GPTQMethod(_PackedMethod):
    def __init__(self, bits: int, group_size: int, checkpoint_format: str = "gptq") -> None:
        super().__init__(bits, group_size)
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0

    @classmethod
    def from_config(cls, config: QuantConfig, from_float: bool) -> GPTQMethod:
        return cls(config.bits, config.group_size, config.checkpoint_format)

    def create_weights(self, layer: Linear) -> None:
        num_groups, out_features, in_features = self.num_groups(layer), layer.out_features, layer.in_features
        drop_parameters(layer, "weight")
        if in_features % self.pack or out_features % self.pack:
            raise ValueError(
                f"GPTQ {self.bits}-bit needs both widths divisible by {self.pack}, "
                f"got {out_features}x{in_features}"
            )
        self._register(layer, "qweight", (in_features // self.pack, out_features), torch.int32)
        self._register(layer, "qzeros", (num_groups, out_features // self.pack), torch.int32)
        self._register(layer, "scales", (num_groups, out_features), layer.param_dtype)
        self._register(layer, "g_idx", (in_features,), torch.int32)
        layer.g_idx.data.fill_(-1)

    def to_quantized_weight(self, layer: Linear) -> QuantizedWeight:
        codes = unpack_int32(layer.qweight.data, self.bits, dim=0)  # [K, N]
        zeros = unpack_int32(layer.qzeros.data, self.bits, dim=1) + self.zero_offset  # [G, N]
        g_idx = layer.g_idx.data.to(torch.int64)
        group_size = layer.in_features // zeros.shape[0]
        in_order = torch.arange(layer.in_features, device=g_idx.device) // group_size
        perm = None
        if not torch.equal(g_idx, in_order):
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], in_order):
                raise ValueError(
                    f"g_idx does not split the {layer.in_features} inputs into groups of {group_size}"
                )
            codes = codes[perm]
        return QuantizedWeight(
            codes.t().to(torch.uint8).contiguous(),
            layer.scales.data.float().t().contiguous(),
            zeros.float().t().contiguous(),
            self.bits,
            perm,
        )


class AWQMethod(_PackedMethod):
    @classmethod
    def from_config(cls, config: QuantConfig, from_float: bool) -> AWQMethod:
        return cls(config.bits, config.group_size)

    def create_weights(self, layer: Linear) -> None:
        num_groups, out_features, in_features = self.num_groups(layer), layer.out_features, layer.in_features
        drop_parameters(layer, "weight")
        if out_features % self.pack:
            raise ValueError(f"AWQ needs out_features divisible by {self.pack}, got {out_features}")
        self._register(layer, "qweight", (in_features, out_features // self.pack), torch.int32)
        self._register(layer, "qzeros", (num_groups, out_features // self.pack), torch.int32)
        self._register(layer, "scales", (num_groups, out_features), layer.param_dtype)

    def to_quantized_weight(self, layer: Linear) -> QuantizedWeight:
        codes = unpack_int32(layer.qweight.data, self.bits, dim=1, order=AWQ_ORDER)  # [K, N]
        zeros = unpack_int32(layer.qzeros.data, self.bits, dim=1, order=AWQ_ORDER)  # [G, N]
        return QuantizedWeight(
            codes.t().to(torch.uint8).contiguous(),
            layer.scales.data.float().t().contiguous(),
            zeros.float().t().contiguous(),
            self.bits,
        )
