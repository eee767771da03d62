"""An engine gives its memory back: shutdown(), close(), the end of a `with` block and dropping the last reference
release the model, its KV cache, compiled graphs and the ranks' processes, and a shut-down LLM says so when used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvforge import LLM, SamplingParams

# NOTE: a 512 MiB KV cache, so that an engine left behind shows: each one that stayed would keep 512 MiB resident
KV_CACHE_MEMORY = "512MiB"
KV_CACHE_MIB = 512
TOLERANCE_MIB = 300  # what the first engine may leave behind: imports, the C++ kernels, torch's caches


def rss_rounds(model: Path, ends: list[str], compile_ahead: bool = False, **engine: object) -> dict:
    """Four engines made and ended (ends taken in turn) in a fresh process: its RSS around each (tests/rss_rounds)."""
    args = {"model": str(model), "ends": ends, "rounds": 4, "engine": {"kv_cache_memory": KV_CACHE_MEMORY, **engine},
            "compile_ahead": compile_ahead}
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run([sys.executable, "-m", "tests.rss_rounds", json.dumps(args)], capture_output=True,
                            text=True, env=env, cwd=root, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def assert_memory_comes_back(measured: dict) -> None:
    start = measured["start"]
    for number, round_ in enumerate(measured["rounds"]):
        # the measurement sees an engine: its cache is resident while it lives
        assert round_["alive"] > start + 0.8 * KV_CACHE_MIB, (number, measured)
        assert round_["ended"] < start + TOLERANCE_MIB, (number, measured)


def test_four_dropped_engines_give_their_memory_back(tiny_llama_dir) -> None:
    # every decode step compiled (bucket 2, before the first): the compiled graphs are released too
    measured = rss_rounds(tiny_llama_dir[0], ["drop"], compile_ahead=True, compile_buckets=(2,))
    assert_memory_comes_back(measured)


def test_four_engines_dropped_while_their_decode_steps_compile_give_their_memory_back(tiny_llama_dir) -> None:
    # the compile on its thread, begun at the start, is cancelled and joined: it held the model and its KV cache
    measured = rss_rounds(tiny_llama_dir[0], ["drop", "shutdown"], compile_buckets=(2,), compile_at_start=True)
    assert_memory_comes_back(measured)


def test_four_engines_ended_by_their_with_blocks_give_their_memory_back(tiny_llama_dir) -> None:
    measured = rss_rounds(tiny_llama_dir[0], ["with"])
    assert_memory_comes_back(measured)
    assert all("has been shut down" in round_["error"] for round_ in measured["rounds"])


def test_four_tensor_parallel_engines_end_their_ranks(tiny_llama_dir) -> None:
    measured = rss_rounds(tiny_llama_dir[0], ["drop", "shutdown"], tensor_parallel_size=2)
    assert_memory_comes_back(measured)
    assert all(round_["children"] == [] for round_ in measured["rounds"])


def test_using_an_llm_after_shutdown_is_a_clear_error(tiny_llama_dir) -> None:
    llm = LLM(str(tiny_llama_dir[0]), kv_cache_memory="4MiB")
    assert llm.generate("Hello", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    llm.close()
    for use in (lambda: llm.generate("Hello"), lambda: llm.chat([{"role": "user", "content": "Hi"}]),
                llm.get_tokenizer, llm.reset_caches):
        with pytest.raises(RuntimeError, match="this LLM has been shut down"):
            use()
    llm.shutdown()  # a second time: nothing to do


def test_an_engine_after_shutdown_refuses_work(tiny_llama_dir) -> None:
    engine = LLM(str(tiny_llama_dir[0]), kv_cache_memory="4MiB").engine  # kept: the LLM itself is dropped
    engine.add_request("a", "Hello", SamplingParams(max_tokens=2))
    engine.shutdown()
    assert engine.runner is None  # the model runner, which held the KV cache and the compiled graphs, is gone
    for use in (engine.step, lambda: engine.add_request("b", "Hello", SamplingParams()), lambda: engine.score([1, 2]),
                lambda: engine.local_model):
        with pytest.raises(RuntimeError, match="the engine has been shut down"):
            use()


def test_an_llm_still_referenced_at_exit_ends_quietly(tiny_llama_dir) -> None:
    script = (f"from kvforge import LLM\nllm = LLM({str(tiny_llama_dir[0])!r}, kv_cache_memory='4MiB', "
              "enforce_eager=True)\nprint(llm.generate('Hello')[0].outputs[0].token_ids)")
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=300)
    assert result.returncode == 0 and result.stdout.strip(), result.stderr[-3000:]
    assert "Exception ignored" not in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
