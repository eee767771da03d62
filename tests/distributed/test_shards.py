"""Each rank builds and loads only its share of the weights (no process group needed to check it)."""

from __future__ import annotations

import pytest
import torch

from kvforge.config import ModelConfig
from kvforge.distributed.parallel_state import ParallelState, building_with
from kvforge.loader.model_loader import load_model


def _load(folder, rank: int = 0, tp: int = 1, pp: int = 1):
    with building_with(ParallelState(rank, tp, pp)):
        return load_model(ModelConfig(str(folder)), torch.device("cpu")).model


def _numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_each_rank_holds_only_its_shard(parallel_model, tp: int, pp: int) -> None:
    folder = parallel_model[0]
    full = _load(folder)
    hidden = full.config.hidden_size
    replicated = sum(p.numel() for name, p in full.named_parameters() if "norm" in name)
    kv_replication = max(1, tp // full.config.num_kv_heads)  # KV heads fewer than ranks are copied
    kv_params = sum(p.numel() for name, p in full.named_parameters() if "qkv_proj" in name) // 2 * kv_replication
    sizes = [_numel(_load(folder, rank, tp, pp)) for rank in range(tp * pp)]
    for size in sizes:
        assert size <= _numel(full) / (tp * pp) + replicated + kv_params + hidden
        assert size < _numel(full)
    assert sum(sizes) >= _numel(full) - replicated  # together the ranks hold everything


def test_shard_shapes_follow_the_split(parallel_model) -> None:
    folder = parallel_model[0]
    full = _load(folder)
    cfg = full.config
    rank1 = _load(folder, rank=1, tp=2)
    attn = rank1.layers[0].self_attn
    assert tuple(attn.qkv_proj.weight.shape) == ((cfg.num_heads + 2 * cfg.num_kv_heads) // 2 * cfg.head_dim,
                                                 cfg.hidden_size)
    assert tuple(attn.o_proj.weight.shape) == (cfg.hidden_size, cfg.num_heads * cfg.head_dim // 2)
    assert rank1.embed_tokens.weight.shape[0] == -(-cfg.vocab_size // 2)
    # the second query half of layer 0 is rank 1's first rows
    q_rows = cfg.num_heads // 2 * cfg.head_dim
    full_qkv = full.layers[0].self_attn.qkv_proj.weight
    torch.testing.assert_close(attn.qkv_proj.weight[:q_rows], full_qkv[q_rows : 2 * q_rows])
    stage1 = _load(folder, rank=1, pp=2)
    assert stage1.embed_tokens is None and stage1.norm is not None
    assert [type(layer).__name__ for layer in stage1.layers] == ["Identity"] * 2 + ["LlamaDecoderLayer"] * 2
    assert stage1.kv_cache_spec.layer_shapes == full.kv_cache_spec.layer_shapes[2:]
