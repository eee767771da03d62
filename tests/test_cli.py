"""The kvforge command as a user runs it."""

from __future__ import annotations

import subprocess
import sys


def _kvforge(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvforge.cli", *args], capture_output=True, text=True,
                          timeout=300)


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
