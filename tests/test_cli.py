"""The kvforge command as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def _kvforge(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvforge.cli", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def test_generate_on_a_checkpoint_folder(tiny_llama_dir):
    folder = str(tiny_llama_dir[0])
    result = _kvforge("generate", "--model", folder, "--kv-cache-memory", "8MiB", "--max-tokens", "5",
                      "--ignore-eos", "The quick brown", "Paris is")
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("--- ") == 2


def test_generate_with_an_int8_kv_cache(tiny_llama_dir):
    result = _kvforge("generate", "--model", str(tiny_llama_dir[0]), "--kv-cache-memory", "8MiB",
                      "--kv-cache-dtype", "int8", "--max-tokens", "8", "--ignore-eos", "The quick brown")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "KV cache (int8, 160 bytes/token)" in result.stderr  # vs 512 bytes a token in float32
    bad = _kvforge("generate", "--model", str(tiny_llama_dir[0]), "--kv-cache-dtype", "int4", "hi")
    assert bad.returncode == 2 and "--kv-cache-dtype: invalid choice: 'int4'" in bad.stderr


def test_chat_with_messages(tiny_llama_dir):
    result = _kvforge("chat", "--model", str(tiny_llama_dir[0]), "--kv-cache-memory", "8MiB", "--max-tokens",
                      "4", "--message", "hello", "--message", "again")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.strip().splitlines()) >= 2


def test_bad_values_give_one_line_and_exit_code_2(tiny_llama_dir, tmp_path):
    folder = str(tiny_llama_dir[0])
    for args, message in [
        (("generate", "--model", folder, "--top-p", "1.5", "hi"), "top_p"),
        (("generate", "--model", str(tmp_path / "nope"), "hi"), "not found"),
        (("generate", "--model", folder, "--kv-cache-memory", "0", "hi"), "memory"),
    ]:
        result = _kvforge(*args)
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvforge: error:") and message in lines[0]


@pytest.mark.slow  # two compiles in fresh processes: ~35 s
def test_compile_fills_the_caches_a_later_start_compiles_from(tiny_llama_dir, tmp_path):
    """`kvforge compile` compiles each batch size (here one) into Inductor's on-disk caches: the second time, from
    them."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    args = ("compile", str(tiny_llama_dir[0]), "--kv-cache-memory", "8MiB", "--compile-buckets", "2")
    seconds = []
    for _ in range(2):
        result = _kvforge(*args, env=env)
        assert result.returncode == 0, result.stderr
        assert f"compiled into {tmp_path / 'inductor'}" in result.stdout
        times = re.findall(r"^batch \d+: ([\d.]+) s \(Python wrapper\)$", result.stdout, re.M)
        seconds.append([float(t) for t in times])
    assert len(seconds[0]) == 1 and seconds[1][0] < seconds[0][0] / 2, seconds
