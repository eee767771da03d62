"""llama.cpp's `llama-embedding` timed on the same batches of sentences as `kvforge bench embed`.

`llama-embedding` reads its prompts from a file and packs them greedily into one decode while their tokens fit its
batch (`-b`). Every batch of one run is given the same number of tokens, so each decode is exactly one of our
batches, and the log's timestamp of each decode gives its time, after the model has loaded and warmed up:

    run for batches of S tokens:  [warm-up] [warm-up] [batch 1] ... [batch k] [end marker] [end marker]
    log:                          t0        t1        t2            tk+1      tk+2         tk+3
    time of batch i = t(i+2) - t(i+1)   (the decode, pooling and normalisation of its sentences)

Batches of other token counts go to other runs (one run per count). llama.cpp tokenizes every prompt before its first
decode, so its times leave out the tokenizing that kvforge's and sentence-transformers' include.

llama.cpp's graph asserts (`ggml_can_mul_mat`) unless its batch is a multiple of its sequences (`-np`), so a run
asks for `-np` sequences (at least a batch's sentences) whose multiple just above the batch's tokens leaves less room
than the run's shortest sentence: the next batch's first sentence cannot join the one before.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

_DECODE_LINE = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) I batch_decode: n_tokens = (\d+), n_seq = (\d+)", re.M)
_NUM_WARMUP = 2
# Batches after the timed ones: the first one's decode ends the timing; their embeddings, printed last, are what
# llama.cpp's logger may lose at exit (up to its queue: 512 entries, one per number printed).
_NUM_TAIL = 2
_MAX_SEQUENCES = 256  # the most sequences a llama.cpp context holds


def _decode_times(log: str) -> list[tuple[float, int]]:
    """(seconds since start, sentences) of each decode in a llama-embedding log."""
    times = []
    for minutes, seconds, millis, micros, _, num_seqs in _DECODE_LINE.findall(log):
        times.append((int(minutes) * 60 + int(seconds) + int(millis) / 1e3 + int(micros) / 1e6, int(num_seqs)))
    return times


def _shape(num_tokens: int, num_sentences: int, shortest: int) -> tuple[int, int]:
    """(sequences, batch tokens) of a run whose batches have num_tokens tokens and at most num_sentences sentences,
    the shortest of shortest tokens (see the module's docstring)."""
    for num_seqs in range(max(num_sentences, 2), _MAX_SEQUENCES + 1):  # -np 1 would mean 256
        budget = -(-num_tokens // num_seqs) * num_seqs
        if budget - num_tokens < shortest:
            return num_seqs, budget
    raise ValueError(f"llama-embedding cannot take batches of {num_sentences} sentences and {num_tokens} tokens one "
                     f"at a time (its batch must be a multiple of at most {_MAX_SEQUENCES} sequences)")


def _run(binary: Path, gguf: Path, batches: list[list[str]], num_tokens: int, shortest: int,
         threads: int) -> tuple[float, list]:
    """(seconds of the given batches' decodes, their embeddings) from one llama-embedding run."""
    runs = [batches[0]] * _NUM_WARMUP + batches + [batches[0]] * _NUM_TAIL
    num_seqs, budget = _shape(num_tokens, max(len(batch) for batch in batches), shortest)
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as prompts:
        prompts.write("\n".join(text for batch in runs for text in batch))
        prompts.flush()
        command = [str(binary), "-m", str(gguf), "-f", prompts.name, "-t", str(threads), "-b", str(budget),
                   "-c", str(budget), "-np", str(num_seqs), "--embd-output-format", "raw",
                   "--log-prefix", "--log-timestamps", "--log-colors", "off"]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-2000:]}")
    decodes = _decode_times(done.stderr)
    if [n for _, n in decodes] != [len(batch) for batch in runs]:
        raise RuntimeError(f"llama-embedding packed the sentences otherwise than asked ({[n for _, n in decodes]}; "
                           f"its tokenizer counts tokens otherwise than this one)")
    seconds = decodes[_NUM_WARMUP + len(batches)][0] - decodes[_NUM_WARMUP][0]
    start = _NUM_WARMUP * len(batches[0])
    return seconds, _embeddings(done.stdout, start, sum(len(batch) for batch in batches))


def _embeddings(stdout: str, start: int, count: int) -> list[list[float]]:
    """Embeddings start..start+count of llama-embedding's raw output (one a line). Its logger, which prints them,
    may lose its last lines at exit (llama.cpp does not wait for it): the tail's (_NUM_TAIL)."""
    rows = [[float(value) for value in line.split()] for line in stdout.split("\n")[:-1] if line.strip()]
    if len(rows) < start + count:
        raise RuntimeError(f"llama-embedding printed {len(rows)} whole embeddings, fewer than the {start + count} "
                           f"asked for (its output was cut short at exit: run it again)")
    return rows[start:start + count]


def llama_embedding_binary(bin_dir: str) -> Path:
    """llama.cpp's llama-embedding in its bin folder; ValueError naming the folder when it is not there."""
    binary = Path(bin_dir) / "llama-embedding"
    if not binary.is_file():
        raise ValueError(f"--llama-cpp-bin: {bin_dir!r} has no llama-embedding (build it: cmake --build BUILD_DIR "
                         f"--target llama-embedding, and give BUILD_DIR/bin)")
    return binary


def llama_embedding_timed(binary: Path, gguf: str, batches: list[list[str]], num_tokens: list[list[int]],
                          threads: int) -> tuple[float, torch.Tensor]:
    """(seconds llama.cpp spent embedding every batch, the embeddings [num sentences, dim] in order);
    num_tokens: each batch's sentences' tokens, special tokens included, as llama.cpp's tokenizer counts them."""
    by_num_tokens: dict[int, list[int]] = defaultdict(list)
    for index, counts in enumerate(num_tokens):
        by_num_tokens[sum(counts)].append(index)
    total_s, rows = 0.0, {}
    for batch_tokens, indices in by_num_tokens.items():
        shortest = min(min(num_tokens[i]) for i in indices)
        seconds, embeddings = _run(binary, Path(gguf), [batches[i] for i in indices], batch_tokens, shortest, threads)
        total_s += seconds
        offset = 0
        for i in indices:
            rows[i] = embeddings[offset:offset + len(batches[i])]
            offset += len(batches[i])
    return total_s, torch.tensor([row for i in range(len(batches)) for row in rows[i]])
