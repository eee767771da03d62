from __future__ import annotations

import os

import torch

# Two cores: keep torch from oversubscribing them when pytest runs beside other processes.
torch.set_num_threads(min(2, os.cpu_count() or 1))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama checkpoint folder with a BPE tokenizer and chat template; returns (folder, model)."""
    from tests.tiny_models import save_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    return folder, save_model(folder, "llama")


@pytest.fixture(scope="session")
def tiny_llm(tiny_llama_dir):
    from kvforge import LLM

    return LLM(str(tiny_llama_dir[0]), kv_cache_memory="16MiB")
