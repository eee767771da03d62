from __future__ import annotations

import os

import torch

# Two cores: keep torch from oversubscribing them when pytest runs beside other processes.
torch.set_num_threads(min(2, os.cpu_count() or 1))


import pytest  # noqa: E402


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the GPU cross-compilation now, at low priority, when a collected test reads its results."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return
    if any(item.path.name == "test_cross_compile.py" and "results" in getattr(item, "fixturenames", ())
           for item in session.items):  # fmt: skip
        from tests.tools.cross_compile_run import CROSS_COMPILE_RUN, CrossCompileRun

        session.config.stash[CROSS_COMPILE_RUN] = CrossCompileRun()


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.tools.cross_compile_run import CROSS_COMPILE_RUN

    run = session.config.stash.get(CROSS_COMPILE_RUN, None)
    if run is not None:
        run.stop()


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


@pytest.fixture(scope="session")
def hf_default_tokenizer():
    """transformers' tokenizer of the default model, read from its GGUF file (loaded once: ~10 s)."""
    from pathlib import Path

    import transformers

    from kvforge.loader.default_model import default_model_path

    path = Path(default_model_path())
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_default_model():
    """transformers' float32 model of the default GGUF file, in eval mode (loaded once: ~30 s)."""
    from pathlib import Path

    import transformers

    from kvforge.loader.default_model import default_model_path

    path = Path(default_model_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()
