"""A CPU model's weights moved into 2 MiB pages: the same results as transformers, ties kept, every tensor (but the
rotary tables) in one arena at a 2 MiB boundary, and backed by huge pages where Linux offers them; --no-huge-pages
leaves them as torch allocated them."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from kvforge import LLM
from kvforge.layers.rotary import RotaryEmbedding
from kvforge.loader.huge_pages import (
    HUGE_PAGE,
    huge_page_arena,
    huge_page_bytes,
    huge_pages_offered,
    move_to_huge_pages,
)
from tests.tiny_models import assert_logits_match, save_model

pytestmark = pytest.mark.skipif(not huge_pages_offered(), reason="the kernel offers no transparent huge pages")

PROMPTS = [[1, 5, 9, 13, 200], [1, 300, 7]]


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _weights(model: nn.Module) -> list[torch.Tensor]:
    """The tensors that move: all but the rotary tables (cut to the KV cache's positions after the load)."""
    return [t for m in model.modules() if not isinstance(m, RotaryEmbedding)
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]


def test_an_arena_is_aligned_and_in_huge_pages() -> None:
    for mib in (8, 16, 30):  # freed large blocks: malloc then reuses memory it has written (as in a long process)
        torch.ones(mib << 20, dtype=torch.uint8)
    arena = huge_page_arena((4 << 20) + 5)
    assert arena.dtype == torch.uint8 and arena.numel() == (4 << 20) + 5 and arena.data_ptr() % HUGE_PAGE == 0
    arena.fill_(7)  # first written here: backed then
    assert huge_page_bytes(arena.data_ptr(), arena.nbytes) >= HUGE_PAGE  # at least one whole page of the two


def test_tied_parameters_and_buffers_stay_tied() -> None:
    shared = nn.Parameter(torch.randn(64, 32))
    first, second = nn.Linear(32, 64, bias=False), nn.Linear(32, 64, bias=False)
    first.weight = second.weight = shared
    model = nn.Sequential(first, second, nn.LayerNorm(64))
    table = torch.randn(10, 3)
    model[0].register_buffer("table", table)
    model[1].register_buffer("table", table)
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}

    moved = move_to_huge_pages(model)

    assert model[0].weight is shared and model[1].weight is shared  # the Parameter objects stay
    assert model[0].table is model[1].table and model[0].table.data_ptr() != table.data_ptr()
    assert model.state_dict().keys() == expected.keys()
    assert all(torch.equal(model.state_dict()[name], value) for name, value in expected.items())
    unique = {t.data_ptr(): t for t in _tensors(model)}
    assert moved >= sum(t.nbytes for t in unique.values())  # the shared tensors once
    assert min(unique) % HUGE_PAGE == 0 and max(unique) < min(unique) + moved


def test_moved_tensors_are_freed_as_they_move() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    model[0].register_buffer("table", torch.randn(1000))
    old = [weakref.ref(model[0].table), *(weakref.ref(p.untyped_storage()) for p in model.parameters())]
    assert all(ref() is not None for ref in old)
    move_to_huge_pages(model)
    assert all(ref() is None for ref in old)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("huge_pages")
    return folder, save_model(folder, "llama", tie_word_embeddings=True)


def test_engine_weights_in_huge_pages_match_transformers(tiny_llama) -> None:
    folder, reference = tiny_llama
    llm = LLM(str(folder), kv_cache_memory="16MiB", kv_cache_dtype="float32")
    assert_logits_match(llm, reference, PROMPTS)
    tensors = _weights(llm.engine.runner.model)
    start = min(t.data_ptr() for t in tensors)
    end = max(t.data_ptr() + t.nbytes for t in tensors)
    assert start % HUGE_PAGE == 0 and end - start < 2 * sum(t.nbytes for t in tensors)  # one arena
    assert huge_page_bytes(start, end - start) > 0


def _mappings_marked_for_huge_pages(tensors: list[torch.Tensor]) -> list[str]:
    """The /proc/self/smaps entries that hold any of the tensors and were marked MADV_HUGEPAGE ("hg" in VmFlags)."""
    marked, entry, holds = [], [], False
    for line in [*Path("/proc/self/smaps").read_text().splitlines(), "0-0 end"]:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            if holds and any(row.startswith("VmFlags:") and " hg" in row for row in entry):
                marked.append("\n".join(entry))
            start, end = (int(bound, 16) for bound in head.split("-"))
            holds = any(start < t.data_ptr() + t.nbytes and t.data_ptr() < end for t in tensors)
            entry = []
        entry.append(line)
    return marked


def test_no_huge_pages_leaves_the_weights_where_torch_put_them(tiny_llama) -> None:
    # NOTE: not "no huge pages at all": other code in a long process (a library's allocator) may have asked for
    # huge pages for torch's memory; what --no-huge-pages promises is that kvforge does not move the weights
    folder, reference = tiny_llama
    llm = LLM(str(folder), kv_cache_memory="16MiB", huge_pages=False, kv_cache_dtype="float32")
    assert_logits_match(llm, reference, PROMPTS)
    tensors = _tensors(llm.engine.runner.model)
    assert not _mappings_marked_for_huge_pages(tensors), _mappings_marked_for_huge_pages(tensors)
    on = LLM(str(folder), kv_cache_memory="16MiB", kv_cache_dtype="float32")  # the same check sees the arena
    assert _mappings_marked_for_huge_pages(_tensors(on.engine.runner.model))
