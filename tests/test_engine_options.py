"""Engine options are declared once: LLM(...)'s keyword arguments, the CLI flags and --help agree."""

from __future__ import annotations

import argparse
import importlib
import inspect

import pytest

from kvforge import cli
from kvforge.engine_args import build_engine_config
from kvforge.llm import LLM

# Each engine flag with its destination, default and choices, as `--help` listed them before the
# options were declared once (captured from kvforge generate, serve and bench throughput).
FLAGS_BEFORE = [
    ("--model", "model", None, None),
    ("--dtype", "dtype", "auto", ("auto", "float32", "bfloat16", "float16")),
    ("--max-model-len", "max_model_len", None, None),
    ("--quantization", "quantization", None, ("w8a16", "w4a16", "w8a8", "fp8", "gguf", "none")),
    ("--block-size", "block_size", 16, None),
    ("--kv-cache-memory", "kv_cache_memory", None, None),
    ("--gpu-memory-utilization", "gpu_memory_utilization", 0.9, None),
    ("--no-prefix-caching", "enable_prefix_caching", True, None),
    ("--kv-cache-dtype", "kv_cache_dtype", "auto", ("auto", "float32", "float16", "bfloat16", "int8", "fp8")),
    ("--max-num-batched-tokens", "max_num_batched_tokens", 2048, None),
    ("--max-num-seqs", "max_num_seqs", 256, None),
    ("--long-prefill-token-threshold", "long_prefill_token_threshold", 0, None),
    ("--tensor-parallel-size", "tensor_parallel_size", 1, None),
    ("--pipeline-parallel-size", "pipeline_parallel_size", 1, None),
    ("--device", "device", "auto", None),
    ("--attention-backend", "attention_backend", "auto", ("auto", "torch", "triton")),
]
COMMANDS = [["generate"], ["serve"], ["bench", "throughput"]]


def _parser(words: list[str]) -> argparse.ArgumentParser:
    """The parser of one subcommand, with the flags of the module that owns it."""
    parser, module_parsers = cli.build_parser()
    found = cli._module_of(words)
    if found is None:
        return parser._subparsers._group_actions[0].choices[words[0]]
    importlib.import_module(found[1]).add_arguments(module_parsers[found[0]])
    return module_parsers[found[0]]


def _engine_flags(parser: argparse.ArgumentParser) -> list[tuple]:
    group = next(g for g in parser._action_groups if g.title == "engine")
    return [(a.option_strings[0], a.dest, a.default, tuple(a.choices) if a.choices else None)
            for a in group._group_actions]


@pytest.mark.parametrize("words", COMMANDS, ids=" ".join)
def test_cli_flags_are_llm_keyword_arguments_with_the_same_defaults(words):
    flags = _engine_flags(_parser(words))
    signature = inspect.signature(LLM).parameters
    cli_defaults = {dest: default for _, dest, default, _ in flags}
    llm_defaults = {name: p.default for name, p in signature.items() if name in cli_defaults}
    assert cli_defaults == llm_defaults
    assert set(signature) - set(cli_defaults) == {"seed"}  # the one option of LLM(...) only


@pytest.mark.parametrize("words", COMMANDS, ids=" ".join)
def test_help_lists_the_same_engine_options_and_defaults_as_before(words):
    parser = _parser(words)
    names_before = {flag for flag, *_ in FLAGS_BEFORE}
    assert [f for f in _engine_flags(parser) if f[0] in names_before] == FLAGS_BEFORE  # options added since may follow
    text = " ".join(parser.format_help().split())
    for flag, _, _, choices in FLAGS_BEFORE:
        shown = flag if choices is None or flag == "--no-prefix-caching" else f"{flag} {{{','.join(choices)}}}"
        assert shown in text
    assert ("KV cache size, e.g. 2GiB (default: what --max-num-seqs sequences of --max-model-len tokens need, at most "
            "2GiB and the memory free on the CPU, the free share of GPU memory on GPUs)") in text


def test_parsed_flags_build_the_config_the_same_keywords_build():
    parser = _parser(["generate"])
    args = parser.parse_args(["--kv-cache-memory", "8MiB", "--no-prefix-caching", "--max-num-seqs", "3",
                              "--dtype", "float32", "hi"])
    from_cli = build_engine_config(**cli.engine_kwargs_from_args(args))
    from_keywords = build_engine_config(kv_cache_memory=8 * 2**20, enable_prefix_caching=False, max_num_seqs=3,
                                        dtype="float32")
    assert from_cli == from_keywords
    assert from_cli.cache.kv_cache_memory == 8 * 2**20 and not from_cli.cache.enable_prefix_caching


def test_declared_bounds_name_the_option_and_unknown_options_are_refused():
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        build_engine_config(max_num_seqs=0)
    with pytest.raises(ValueError, match=r"dtype must be one of \('auto', 'float32'"):
        build_engine_config(dtype="int3")
    with pytest.raises(TypeError, match="unknown engine option.*max_num_seq'"):
        LLM(max_num_seq=4)
