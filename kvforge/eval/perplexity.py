"""`kvforge eval perplexity`: perplexity of each of several texts (and their mean) with a sliding window
over engine.score.

Each window of at most max_length tokens scores the next `stride` tokens not yet scored, with the
tokens before them (up to max_length in all) as context, so every token after the first is predicted
exactly once:

    tokens   |0 ............................................. L|
    window 1 |0 ....... scored ........|
    window 2           |... context ...|.. scored ..|
                                       ^ scored_until
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine_args import add_engine_arguments, engine_kwargs_from_args


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    perplexity: float
    num_tokens: int  # tokens predicted
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else float("inf")


def default_evaluation_texts() -> dict[str, str]:
    """The shipped held-out texts by name (prose, a licence, code; none is in the calibration set)."""
    folder = resources.files("kvforge.data").joinpath("evaluation")
    return {entry.name.removesuffix(".txt"): entry.read_text(encoding="utf-8")
            for entry in sorted(folder.iterdir(), key=lambda e: e.name) if entry.name.endswith(".txt")}  # fmt: skip


def evaluation_texts(paths: list[str]) -> dict[str, str]:
    """The texts of the given files by file name, or the shipped ones when there are none."""
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"text file {path!r} not found")
    if not paths:
        return default_evaluation_texts()
    return {Path(path).name: Path(path).read_text(encoding="utf-8") for path in paths}


def perplexity(engine: LLMEngine, token_ids: list[int], max_length: int, stride: int) -> PerplexityResult:
    """exp(mean negative log-likelihood) of token_ids[1:], scored window by window."""
    if not 0 < stride <= max_length:
        raise ValueError(f"need 0 < stride <= max_length, got stride={stride}, max_length={max_length}")
    if len(token_ids) < 2:
        raise ValueError("the text has fewer than 2 tokens")
    max_length = min(max_length, engine.max_model_len)
    total_nll, num_scored, scored_until = 0.0, 0, 1  # token 0 is never predicted
    start_time = time.perf_counter()
    while scored_until < len(token_ids):
        # NOTE: at most max_length - 1 new tokens per window, so each has at least one token of context
        end = min(scored_until + min(stride, max_length - 1), len(token_ids))
        begin = max(0, end - max_length)
        window = token_ids[begin:end]
        logits = engine.score(window)  # [len(window), vocab]; row i predicts window[i + 1]
        first = scored_until - begin  # index in window of the first token to score
        log_probs = torch.log_softmax(logits[first - 1 : -1].float(), dim=-1)
        targets = torch.tensor(window[first:], dtype=torch.long)
        total_nll -= log_probs.gather(1, targets[:, None]).sum().item()
        num_scored += len(targets)
        scored_until = end
    seconds = time.perf_counter() - start_time
    return PerplexityResult(math.exp(total_nll / num_scored), num_scored, seconds)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--text", action="append", default=[],
        help="text file to evaluate (repeatable; default: the shipped held-out texts, kvforge/data/evaluation)",
    )  # fmt: skip
    parser.add_argument("--max-length", type=int, default=512, help="tokens per window")
    parser.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from kvforge.llm import LLM

    texts = evaluation_texts(args.text)
    llm = LLM(**engine_kwargs_from_args(args))
    results = {}
    for name, text in texts.items():
        results[name] = perplexity(llm.engine, llm.get_tokenizer().encode(text), args.max_length, args.stride)
        result = results[name]
        print(f"{name}: perplexity {result.perplexity:.4f} over {result.num_tokens} tokens "
              f"({result.tokens_per_second:.1f} tokens/s)")  # fmt: skip
    if len(results) > 1:
        mean = sum(r.perplexity for r in results.values()) / len(results)
        print(f"mean perplexity {mean:.4f} over {len(results)} texts")
    return 0
