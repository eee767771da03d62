"""Benchmark workloads: seeded random token prompts, or a JSON file of prompts (the w64 format)."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True, slots=True)
class Workload:
    """Token-id prompts, each continued by exactly output_lens[i] tokens (greedy, EOS ignored)."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def random_workload(num_prompts: int, input_len: tuple[int, int], output_len: int, seed: int,
                    vocab_range: tuple[int, int] = (1000, 40000)) -> Workload:
    """Lengths uniform in [input_len[0], input_len[1]], ids uniform in vocab_range (numpy default_rng)."""
    if num_prompts < 1 or input_len[0] < 1 or input_len[1] < input_len[0] or output_len < 1:
        raise ValueError(f"bad workload shape: {num_prompts} prompts, input {input_len}, output {output_len}")
    rng = np.random.default_rng(seed)
    lens = rng.integers(input_len[0], input_len[1] + 1, size=num_prompts)
    prompts = [rng.integers(vocab_range[0], vocab_range[1], size=n).tolist() for n in lens]
    return Workload(prompts, [output_len] * num_prompts)


def load_workload(path: str) -> Workload:
    """A JSON file {"prompts": [[ids...], ...], "n_new": N}."""
    try:
        data = json.loads(Path(path).read_text())
        prompts, n_new = data["prompts"], int(data["n_new"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"cannot read workload {path!r}: {err}") from err
    return Workload([list(map(int, p)) for p in prompts], [n_new] * len(prompts))


def add_workload_arguments(parser: argparse.ArgumentParser, num_prompts: int = 64, output_len: int = 128) -> None:
    """The workload flags of the offline benchmarks: a workload file, or seeded random prompts."""
    parser.add_argument("--workload", default=None, help="JSON workload file (w64 format); else random")
    parser.add_argument("--num-prompts", type=int, default=num_prompts)
    parser.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, default=output_len)
    parser.add_argument("--workload-seed", type=int, default=0)


def workload_from_args(args: argparse.Namespace) -> Workload:
    if args.workload:
        return load_workload(args.workload)
    return random_workload(args.num_prompts, tuple(args.input_len), args.output_len, args.workload_seed)
