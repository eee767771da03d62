"""Hub ids ("org/name") resolve to their copy in the local Hugging Face cache; nothing is downloaded."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvforge.cli import main
from kvforge.llm import LLM
from kvforge.loader.hub_cache import resolve_model_path
from kvforge.sampling_params import SamplingParams


def _cache_copy(hf_home: Path, model_dir: Path, repo_id: str) -> Path:
    """model_dir laid out as huggingface_hub caches repo_id under hf_home."""
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    return snapshot


def test_a_cached_hub_id_loads_like_its_folder(tmp_path: Path, tiny_llama_dir, tiny_llm: LLM,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    snapshot = _cache_copy(tmp_path, tiny_llama_dir[0], "tiny-org/tiny-llama")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    assert resolve_model_path("tiny-org/tiny-llama") == snapshot
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    by_id = LLM("tiny-org/tiny-llama", kv_cache_memory="16MiB", enforce_eager=True)
    assert by_id.generate("Hello", params)[0].outputs[0].token_ids == \
        tiny_llm.generate("Hello", params)[0].outputs[0].token_ids


def test_a_missing_hub_id_names_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=str(tmp_path / "cache")):
        resolve_model_path("someone/missing-model")
    assert main(["serve", "someone/missing-model", "--port", "0"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "Hugging Face cache" in error and str(tmp_path / "cache") in error
