"""The routed experts of Qwen3-Next and Qwen3.5 MoE as a GGUF file stacks them (ffn_{gate,up,down}_exps), regrouped
into the checkpoints' tensors: kept in their quantized blocks expert by expert (as Qwen3-MoE's are), each expert's
weight what the gguf package's dequantizer gives of the file's blocks; float experts (F32 in the file, or
keep_quantized off) as the stacked float tensors. (tests/loader/test_gguf_moe.py runs whole models that llama.cpp's
tools wrote.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from kvforge.loader.gguf_file import GGUFFile
from kvforge.loader.gguf_hybrid_qwen import QWEN3_5_REGROUPING, QWEN3_NEXT_REGROUPING

EXPERTS, INTER, HIDDEN = 3, 64, 96  # K of 96 and 64: three and two blocks of 32 a row
# layer 0: quantized experts (gate and up Q4_0, down Q8_0); layer 1: float ones
_TYPES = {0: {"ffn_gate_exps": Q.Q4_0, "ffn_up_exps": Q.Q4_0, "ffn_down_exps": Q.Q8_0},
          1: {"ffn_gate_exps": Q.F32, "ffn_up_exps": Q.F32, "ffn_down_exps": Q.F32}}  # fmt: skip
_SHAPES = {"ffn_gate_exps": (EXPERTS, INTER, HIDDEN), "ffn_up_exps": (EXPERTS, INTER, HIDDEN),
           "ffn_down_exps": (EXPERTS, HIDDEN, INTER)}  # fmt: skip
_PROJ = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# the linear-attention shapes the regrouping reads (these layers have no linear attention)
_CONFIG = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16}  # fmt: skip


@pytest.fixture(scope="module", params=[("qwen3next", QWEN3_NEXT_REGROUPING), ("qwen35moe", QWEN3_5_REGROUPING)],
                ids=["qwen3_next", "qwen3_5_moe"])  # fmt: skip
def experts_file(request, tmp_path_factory):
    """A file of two layers' stacked experts; returns it, its layers' tensors, the regrouping, and the gguf package's
    float values of each tensor ([experts, rows, K])."""
    arch, regrouping = request.param
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp(arch) / "experts.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    values: dict[str, np.ndarray] = {}
    for layer, types in _TYPES.items():
        for kind, qtype in types.items():
            weight = rng.standard_normal(_SHAPES[kind]).astype(np.float32)
            data = weight if qtype == Q.F32 else quantize(weight, qtype)
            writer.add_tensor(f"blk.{layer}.{kind}.weight", data, raw_dtype=None if qtype == Q.F32 else qtype)
            values[f"blk.{layer}.{kind}"] = dequantize(data, qtype).reshape(_SHAPES[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(str(path))
    layers: dict[int, dict] = {0: {}, 1: {}}
    for tensor in file.tensors:
        _, layer, name = tensor.name.split(".", 2)
        layers[int(layer)][name] = tensor
    return file, layers, regrouping, values


def _dense(file: GGUFFile, tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(dequantize(file.read(tensor), tensor.tensor_type))).float()


def _check_float_experts(readers, layer: int, values: dict[str, np.ndarray]) -> None:
    prefix = f"model.layers.{layer}.mlp.experts"
    gate_up = readers[f"{prefix}.gate_up_proj"]()  # [experts, 2 * inter, hidden]: gate's rows, then up's
    np.testing.assert_array_equal(gate_up[:, :INTER].numpy(), values[f"blk.{layer}.ffn_gate_exps"])
    np.testing.assert_array_equal(gate_up[:, INTER:].numpy(), values[f"blk.{layer}.ffn_up_exps"])
    np.testing.assert_array_equal(readers[f"{prefix}.down_proj"]().numpy(), values[f"blk.{layer}.ffn_down_exps"])


def test_quantized_experts_stay_in_their_blocks(experts_file):
    file, layers, regrouping, values = experts_file
    regrouped = regrouping.regroup(file, layers, _CONFIG, True, lambda t: _dense(file, t))
    names = {f"model.layers.0.mlp.experts.{j}.{proj}.weight" for j in range(EXPERTS) for proj in _PROJ.values()}
    assert set(regrouped.quantized) == names == set(regrouped.layouts)
    assert not any(".layers.0." in name for name in regrouped.readers)
    for kind, proj in _PROJ.items():
        for expert in range(EXPERTS):
            weight = regrouped.quantized[f"model.layers.0.mlp.experts.{expert}.{proj}.weight"]()
            assert weight.codes.dtype == torch.uint8 and weight.codes.shape == _SHAPES[kind][1:]
            torch.testing.assert_close(weight.dequantize(), torch.from_numpy(values[f"blk.0.{kind}"][expert]),
                                       rtol=1e-6, atol=1e-6)  # fmt: skip
    # the F32 layer's experts are float tensors, the only weights read as floats
    _check_float_experts(regrouped.readers, 1, values)
    assert regrouped.dense_numel == 3 * EXPERTS * INTER * HIDDEN
    file_bytes = sum(file.read(t).nbytes for t in layers[0].values())
    assert file_bytes <= regrouped.kept_bytes <= 1.2 * file_bytes


def test_experts_dequantized_without_keeping(experts_file):
    """quantization="none": every layer's experts float, the gguf package's values."""
    file, layers, regrouping, values = experts_file
    regrouped = regrouping.regroup(file, layers, _CONFIG, False, lambda t: _dense(file, t))
    assert not regrouped.quantized and regrouped.kept_bytes == 0
    for layer in layers:
        _check_float_experts(regrouped.readers, layer, values)
    assert regrouped.dense_numel == 2 * 3 * EXPERTS * INTER * HIDDEN
