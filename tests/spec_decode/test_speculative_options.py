"""Speculation's options: the same in LLM(...) and on the command line, bad values refused clearly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvforge.engine_args import build_engine_config


def _kvforge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvforge.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_generate_speculates_from_the_command_line(tiny_llama_dir):
    folder = str(tiny_llama_dir[0])
    common = ("generate", "--model", folder, "--kv-cache-memory", "8MiB", "--max-tokens", "12", "--ignore-eos",
              "--temperature", "0", "The quick brown fox jumps over the lazy dog. The quick brown")
    plain, spec = _kvforge(*common), _kvforge(*common, "--speculative-method", "suffix",
                                              "--num-speculative-tokens", "3")
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and spec.stdout.strip()


def test_bad_speculative_values_give_one_line_and_exit_code_2(tiny_llama_dir):
    folder = str(tiny_llama_dir[0])
    for args, message in [
        (("--speculative-method", "lookahead"), "invalid choice: 'lookahead'"),
        (("--speculative-method", "ngram", "--speculative-model", folder), "speculative_model needs"),
    ]:
        result = _kvforge("generate", "--model", folder, *args, "hi")
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and message in lines[-1]


def test_bounds_are_checked_in_llm_keywords():
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1, got 0"):
        build_engine_config(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match=r"prompt_lookup_min \(4\) must be <= prompt_lookup_max \(2\)"):
        build_engine_config(speculative_method="ngram", prompt_lookup_min=4, prompt_lookup_max=2)
    config = build_engine_config(speculative_method="suffix", num_speculative_tokens=6)
    assert config.speculative.speculative_method == "suffix" and config.speculative.num_speculative_tokens == 6
