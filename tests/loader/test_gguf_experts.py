"""GPT-OSS's MXFP4 experts as a GGUF file stores them (gate and up apart, GGML's block layout), regrouped into the
checkpoints' tensors: transformers' MXFP4 dequantizer of the regrouped blocks gives what the gguf package's
dequantizer gives of the file's, gate and up interleaved as in the checkpoints. (tests/loader/test_gguf_families.py
runs whole models that llama.cpp's converter wrote.)"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvforge.loader.gguf_experts import GPT_OSS_EXPERTS
from kvforge.loader.gguf_file import GGUFFile

EXPERTS, INTER, HIDDEN = 3, 64, 96  # K of 64 and 96: two and three blocks a row


def _mxfp4_blocks(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Random MXFP4 blocks in the GGUF layout, [EXPERTS, rows, K / 32 * 17]: a scale byte near 2^0, 16 code bytes."""
    blocks = rng.integers(0, 256, (EXPERTS, rows, k // 32, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(120, 131, blocks.shape[:-1])
    return blocks.reshape(EXPERTS, rows, -1)


@pytest.fixture(scope="module")
def experts_file(tmp_path_factory):
    rng = np.random.default_rng(0)
    raw = {"ffn_gate_exps": _mxfp4_blocks(rng, INTER, HIDDEN), "ffn_up_exps": _mxfp4_blocks(rng, INTER, HIDDEN),
           "ffn_down_exps": _mxfp4_blocks(rng, HIDDEN, INTER)}  # fmt: skip
    path = tmp_path_factory.mktemp("experts") / "experts.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    for kind, data in raw.items():
        writer.add_tensor(f"blk.0.{kind}.weight", data, raw_dtype=Q.MXFP4)
    for kind, rows in (("ffn_gate_exps", INTER), ("ffn_up_exps", INTER), ("ffn_down_exps", HIDDEN)):
        writer.add_tensor(f"blk.0.{kind}.bias", rng.standard_normal((EXPERTS, rows)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    file = GGUFFile(str(path))
    layers = {0: {t.name.removeprefix("blk.0."): t for t in file.tensors}}
    return file, layers, {kind: dequantize(data, Q.MXFP4) for kind, data in raw.items()}


def _dense(file: GGUFFile, tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(dequantize(file.read(tensor), tensor.tensor_type))).float()


def test_mxfp4_experts_regroup_into_the_checkpoint_layout(experts_file):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    file, layers, values = experts_file
    regrouped = GPT_OSS_EXPERTS.regroup(file, layers, {}, True, lambda t: _dense(file, t))
    assert regrouped.config == {"quantization_config": {"quant_method": "mxfp4"}}
    tensors = {name.removeprefix("model.layers.0.mlp.experts."): read() for name, read in regrouped.readers.items()}
    assert tensors["gate_up_proj_blocks"].shape == (EXPERTS, 2 * INTER, HIDDEN // 32, 16)
    gate_up = convert_moe_packed_tensors(tensors["gate_up_proj_blocks"], tensors["gate_up_proj_scales"],
                                         dtype=torch.float32)  # [experts, hidden, 2 * inter]  # fmt: skip
    down = convert_moe_packed_tensors(tensors["down_proj_blocks"], tensors["down_proj_scales"], dtype=torch.float32)
    np.testing.assert_array_equal(gate_up[:, :, 0::2].transpose(1, 2).numpy(), values["ffn_gate_exps"])
    np.testing.assert_array_equal(gate_up[:, :, 1::2].transpose(1, 2).numpy(), values["ffn_up_exps"])
    np.testing.assert_array_equal(down.transpose(1, 2).numpy(), values["ffn_down_exps"])
    biases = {kind: _dense(file, layers[0][f"{kind}.bias"]) for kind in ("ffn_gate_exps", "ffn_up_exps")}
    assert torch.equal(tensors["gate_up_proj_bias"][:, 0::2], biases["ffn_gate_exps"])
    assert torch.equal(tensors["gate_up_proj_bias"][:, 1::2], biases["ffn_up_exps"])


def test_mxfp4_experts_dequantized_without_keeping(experts_file):
    """quantization="none": float experts in the checkpoints' float layout, the gguf package's values."""
    file, layers, values = experts_file
    regrouped = GPT_OSS_EXPERTS.regroup(file, layers, {}, False, lambda t: _dense(file, t))
    assert regrouped.config == {} and regrouped.kept_bytes == 0
    gate_up = regrouped.readers["model.layers.0.mlp.experts.gate_up_proj"]()  # [experts, hidden, 2 * inter]
    np.testing.assert_array_equal(gate_up[:, :, 0::2].transpose(1, 2).numpy(), values["ffn_gate_exps"])
    np.testing.assert_array_equal(gate_up[:, :, 1::2].transpose(1, 2).numpy(), values["ffn_up_exps"])
    down = regrouped.readers["model.layers.0.mlp.experts.down_proj"]()  # [experts, inter, hidden]
    np.testing.assert_array_equal(down.transpose(1, 2).numpy(), values["ffn_down_exps"])
