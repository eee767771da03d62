"""llama.cpp's `llama-embedding` timed on the same batches of sentences as `kvforge bench embed`.

`llama-embedding` reads its prompts from a file and packs them greedily into one decode while their tokens fit its
batch (`-b`). Every batch of one run is given the same number of tokens, so each decode is exactly one of our
batches, and the log's timestamp of each decode gives its time, after the model has loaded and warmed up:

    run for batches of S tokens:  [warm-up] [warm-up] [batch 1] ... [batch k] [end marker]
    log:                          t0        t1        t2            tk+1      tk+2
    time of batch i = t(i+2) - t(i+1)   (the decode, pooling and normalisation of its sentences)

Batches of other token counts go to other runs (one run per count).

NOTE: llama.cpp's graph asserts (`ggml_can_mul_mat`) for a batch of tokens not a multiple of 4 here, so a run's
batch is S rounded up to one: it packs the same sentences, as each has at least 4 tokens ([CLS], a word, ".",
[SEP]).
"""

from __future__ import annotations

import json
import re
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

_DECODE_LINE = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I batch_decode: n_tokens = (\d+), n_seq = (\d+)", re.M)
_NUM_WARMUP = 2


def _decode_times(log: str) -> list[tuple[float, int]]:
    """(seconds since start, sentences) of each decode in a llama-embedding log."""
    times = []
    for minutes, seconds, millis, micros, _, num_seqs in _DECODE_LINE.findall(log):
        times.append((int(minutes) * 60 + int(seconds) + int(millis) / 1e3 + int(micros) / 1e6, int(num_seqs)))
    return times


def _run(binary: Path, gguf: Path, batches: list[list[str]], num_tokens: int, threads: int) -> tuple[float, list]:
    """(seconds of the given batches' decodes, their embeddings) from one llama-embedding run."""
    runs = [batches[0]] * _NUM_WARMUP + batches + [batches[0]]
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as prompts:
        prompts.write("\n".join(text for batch in runs for text in batch))
        prompts.flush()
        budget = -(-num_tokens // 4) * 4
        command = [str(binary), "-m", str(gguf), "-f", prompts.name, "-t", str(threads), "-b", str(budget),
                   "-c", str(budget), "-np", str(max(len(batches[0]), 2)), "--embd-output-format", "array",
                   "--log-prefix", "--log-timestamps", "--log-colors", "off"]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
    decodes = _decode_times(done.stderr)
    if [n for _, n in decodes] != [len(batch) for batch in runs]:
        raise RuntimeError(f"llama-embedding packed the sentences otherwise than asked ({[n for _, n in decodes]}; "
                           f"its tokenizer counts tokens otherwise than this one)")
    seconds = decodes[-1][0] - decodes[_NUM_WARMUP][0]
    embeddings = json.loads(done.stdout)
    start = _NUM_WARMUP * len(batches[0])
    return seconds, embeddings[start:start + sum(len(batch) for batch in batches)]


def llama_embedding_binary(bin_dir: str) -> Path:
    """llama.cpp's llama-embedding in its bin folder; ValueError naming the folder when it is not there."""
    binary = Path(bin_dir) / "llama-embedding"
    if not binary.is_file():
        raise ValueError(f"--llama-cpp-bin: {bin_dir!r} has no llama-embedding (build it: cmake --build BUILD_DIR "
                         f"--target llama-embedding, and give BUILD_DIR/bin)")
    return binary


def llama_embedding_timed(binary: Path, gguf: str, batches: list[list[str]], batch_num_tokens: list[int],
                          threads: int) -> tuple[float, torch.Tensor]:
    """(seconds llama.cpp spent embedding every batch, the embeddings [num sentences, dim] in order);
    batch_num_tokens: each batch's tokens, special tokens included, as llama.cpp's tokenizer counts them."""
    by_num_tokens: dict[int, list[int]] = defaultdict(list)
    for index, num_tokens in enumerate(batch_num_tokens):
        by_num_tokens[num_tokens].append(index)
    total_s, rows = 0.0, {}
    for num_tokens, indices in by_num_tokens.items():
        seconds, embeddings = _run(binary, Path(gguf), [batches[i] for i in indices], num_tokens, threads)
        total_s += seconds
        offset = 0
        for i in indices:
            rows[i] = embeddings[offset:offset + len(batches[i])]
            offset += len(batches[i])
    return total_s, torch.tensor([row for i in range(len(batches)) for row in rows[i]])
