"""GPT-OSS's experts in a GGUF file, regrouped into the tensors of its Hugging Face checkpoints.

llama.cpp's converter splits each layer's experts into three tensors (and their biases), gate and up apart:

    GGUF  blk.{i}.ffn_gate_exps [experts, inter, hidden], ffn_up_exps the same, ffn_down_exps [experts, hidden, inter]
    HF    mlp.experts.gate_up_proj [experts, hidden, 2 * inter]: gate and up interleaved (gate in the even columns),
          mlp.experts.down_proj [experts, inter, hidden]; in MXFP4, gate_up_proj_blocks [experts, 2 * inter,
          hidden / 32, 16] (gate in the even rows) with gate_up_proj_scales, down_proj_blocks [experts, hidden,
          inter / 32, 16] with down_proj_scales

An MXFP4 block is 17 bytes in a GGUF file: its E8M0 scale (the checkpoints' scale byte, as it is), then 16 bytes of
codes, value j in the low nibble of byte j and value j + 16 in its high nibble; the checkpoints keep values 2k and
2k + 1 in byte k (kernels/mxfp4.py):

    GGUF  [s | 0,16 | 1,17 | ... | 15,31]        HF  [0,1 | 2,3 | ... | 30,31] + scale s

With keep_mxfp4 the experts stay MXFP4 (kvforge's MXFP4 experts take the blocks as they are); otherwise, or when a
file's experts are in another type, they are dequantized to float.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from gguf import GGMLQuantizationType

from kvforge.loader.gguf_file import GGUFFile, GGUFTensor
from kvforge.loader.gguf_regroup import Dense, LayerTensors, Reader, Regrouped, Regrouping, require

_MXFP4_BLOCK_BYTES = 17


def _regroup_experts(file: GGUFFile, layers: LayerTensors, config: dict[str, Any], keep_mxfp4: bool,
                     dense: Dense) -> Regrouped:  # fmt: skip
    """The experts' checkpoint tensors of every layer, MXFP4 ones kept with keep_mxfp4 (then the config says so)."""
    del config
    weights = [t for parts in layers.values() for name, t in parts.items() if name.endswith(".weight")]
    mxfp4 = keep_mxfp4 and all(t.tensor_type == GGMLQuantizationType.MXFP4 for t in weights)
    readers: dict[str, Reader] = {}
    for layer, parts in sorted(layers.items()):
        gate, up, down = require(file, layer, parts, "ffn_gate_exps.weight", "ffn_up_exps.weight",
                                 "ffn_down_exps.weight")  # fmt: skip
        prefix = f"model.layers.{layer}.mlp.experts"
        if mxfp4:
            readers[f"{prefix}.gate_up_proj_blocks"] = functools.partial(_mxfp4_pair, file, gate, up, 1)
            readers[f"{prefix}.gate_up_proj_scales"] = functools.partial(_mxfp4_pair, file, gate, up, 0)
            readers[f"{prefix}.down_proj_blocks"] = functools.partial(_mxfp4_part, file, down, 1)
            readers[f"{prefix}.down_proj_scales"] = functools.partial(_mxfp4_part, file, down, 0)
        else:
            readers[f"{prefix}.gate_up_proj"] = functools.partial(_dense_pair, dense, gate, up, True)
            readers[f"{prefix}.down_proj"] = functools.partial(_transposed, dense, down)
        if "ffn_gate_exps.bias" in parts and "ffn_up_exps.bias" in parts:
            gate_bias, up_bias = parts["ffn_gate_exps.bias"], parts["ffn_up_exps.bias"]
            readers[f"{prefix}.gate_up_proj_bias"] = functools.partial(_dense_pair, dense, gate_bias, up_bias, False)
        if "ffn_down_exps.bias" in parts:
            readers[f"{prefix}.down_proj_bias"] = functools.partial(dense, parts["ffn_down_exps.bias"])
    tensors = [t for parts in layers.values() for t in parts.values()]
    kept = [t for t in tensors if mxfp4 and t.tensor_type == GGMLQuantizationType.MXFP4]
    return Regrouped(readers, {"quantization_config": {"quant_method": "mxfp4"}} if mxfp4 else {},
                     kept_bytes=sum(t.nbytes for t in kept),
                     dense_numel=sum(int(t.n_elements) for t in tensors if t not in kept))  # fmt: skip


GPT_OSS_EXPERTS = Regrouping(frozenset({"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"}), _regroup_experts)


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[experts, inter, ...] twice -> [experts, 2 * inter, ...], gate's rows even, up's odd."""
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def _mxfp4(file: GGUFFile, tensor: GGUFTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An MXFP4 tensor [experts, rows, K] as the checkpoints' (scales [experts, rows, K / 32], blocks [experts, rows,
    K / 32, 16])."""
    raw = torch.from_numpy(file.read(tensor))  # [experts, rows, K / 32 * 17]
    blocks = raw.reshape(*raw.shape[:-1], -1, _MXFP4_BLOCK_BYTES)
    codes = blocks[..., 1:]
    values = torch.cat((codes & 0x0F, codes >> 4), dim=-1)  # [..., 32]: value j of the block at j
    return blocks[..., 0].contiguous(), (values[..., 0::2] | (values[..., 1::2] << 4)).contiguous()


def _dense_pair(dense: Dense, gate: GGUFTensor, up: GGUFTensor, transpose: bool) -> torch.Tensor:
    """Gate's and up's weights (transposed: [experts, hidden, 2 * inter]) or biases, interleaved."""
    pair = _interleave(dense(gate), dense(up))
    return pair.transpose(1, 2) if transpose else pair


def _transposed(dense: Dense, tensor: GGUFTensor) -> torch.Tensor:
    return dense(tensor).transpose(1, 2)


def _mxfp4_part(file: GGUFFile, tensor: GGUFTensor, part: int) -> torch.Tensor:
    """The scales (part 0) or blocks (part 1) of an MXFP4 tensor."""
    return _mxfp4(file, tensor)[part]


def _mxfp4_pair(file: GGUFFile, gate: GGUFTensor, up: GGUFTensor, part: int) -> torch.Tensor:
    """Gate's and up's scales (part 0) or blocks (part 1), their rows interleaved."""
    return _interleave(_mxfp4(file, gate)[part], _mxfp4(file, up)[part])
