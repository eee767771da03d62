"""A model's rotary tables hold the positions its engine's KV cache can reach, not every position the model knows
(a Llama 3's 131072 rows are 32 MiB of float32), and the logits up to the cache's last position are still
transformers'."""

from __future__ import annotations

import pytest

from kvforge import LLM
from kvforge.layers.rotary import RotaryEmbedding
from tests.tiny_models import assert_logits_match, save_model

MAX_POSITION = 4096


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: two tables, and sliding-window layer groups
def test_rotary_tables_hold_the_cache_positions_and_logits_match_transformers(tmp_path, arch: str) -> None:
    reference = save_model(tmp_path, arch, max_position_embeddings=MAX_POSITION)
    llm = LLM(str(tmp_path), kv_cache_memory="256KiB", kv_cache_dtype="float32", enforce_eager=True)
    engine = llm.engine
    positions = engine.executor.kv_cache_size.num_blocks * engine.config.cache.block_size
    tables = [m.cos_sin_cache for m in engine.local_model.modules() if isinstance(m, RotaryEmbedding)]
    assert tables and positions < MAX_POSITION
    assert all(table.shape[0] == positions for table in tables)
    longest = engine.max_model_len  # a prompt that fills the cache to its last position
    assert_logits_match(llm, reference, [[1, *(5 + i % 300 for i in range(longest - 1))], [1, 300, 7]])
