"""`kvforge bench structured`: time per output token with and without a JSON-schema constraint, side by
side in one run, at each stream count; and how long the grammars of typical schemas take to compile.

Free and constrained runs alternate (free, constrained, free, constrained, ...) so that a machine whose
load drifts slows both alike. Every run decodes exactly --output-len tokens per stream: the free run
ignores EOS, and the constrained one's schema (an array of at least 64 small objects) cannot end sooner.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvforge.engine_args import add_engine_arguments, engine_kwargs_from_args

# Never complete within a benchmark's output: every stream decodes --output-len tokens.
LONG_SCHEMA = {"type": "array", "minItems": 64, "items": {
    "type": "object", "required": ["id", "name"], "additionalProperties": False,
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "name": {"type": "string", "maxLength": 16}}}}
# The kinds of schema applications send (the list): compile time, first and cached.
COMPILE_SCHEMAS = {
    "nested objects": {"type": "object", "required": ["name", "address"], "properties": {
        "name": {"type": "string"}, "address": {"type": "object", "required": ["city", "zip"], "properties": {
            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "array, minItems": {"type": "object", "required": ["tags"], "properties": {
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 3}}},
    "enums": {"type": "object", "required": ["color", "size"], "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]}}},
    "bounded numbers": {"type": "object", "required": ["age", "score"], "properties": {
        "age": {"type": "integer", "minimum": 0, "maximum": 120}, "score": {"type": "number", "minimum": 0,
                                                                          "maximum": 1}}},
    "string pattern": {"type": "object", "required": ["code"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}}},
}
PROMPT = [{"role": "user", "content": "List products as JSON objects with an id and a name."}]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16], help="concurrent requests per run")
    parser.add_argument("--output-len", type=int, default=64, help="tokens decoded per stream")
    parser.add_argument("--repeats", type=int, default=2, help="free/constrained run pairs per stream count")
    add_engine_arguments(parser)


def _decode_seconds_per_token(engine, streams: int, output_len: int, constrained: bool) -> float:
    """Seconds per decode step once every stream has its first token (the prefill is not timed)."""
    from kvforge import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=not constrained,
                            guided_json=LONG_SCHEMA if constrained else None)
    prompt = {"prompt_token_ids": engine.tokenizer.apply_chat_template(PROMPT, tokenize=True)}
    for _ in range(streams):
        engine.add_request(None, prompt, params)
    num_steps = 0
    while engine.scheduler.waiting or any(r.num_output_tokens == 0 for r in engine.scheduler.running):
        engine.step()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    return (time.perf_counter() - start) / num_steps


def _compile_times(engine) -> dict[str, tuple[float, float]]:
    """(first, cached) seconds to compile each schema with a fresh compiler (its vocabulary built first)."""
    from kvforge.structured_output.compiler import GrammarCompiler
    from kvforge.structured_output.params import StructuredOutputParams

    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size)
    start = time.perf_counter()
    compiler.compile(StructuredOutputParams(regex="x")).result()
    times = {"(vocabulary, once)": (time.perf_counter() - start, 0.0)}
    for name, schema in COMPILE_SCHEMAS.items():
        timed = []
        for _ in range(2):
            start = time.perf_counter()
            compiler.compile(StructuredOutputParams(json=schema)).result()
            timed.append(time.perf_counter() - start)
        times[name] = (timed[0], timed[1])
    compiler.shutdown()
    return times


def run(args: argparse.Namespace) -> int:
    from kvforge import LLM

    engine = LLM(**engine_kwargs_from_args(args)).engine
    for streams in args.streams:  # warm-up: compiles the decode step of each stream count
        _decode_seconds_per_token(engine, streams, 24, constrained=False)
        _decode_seconds_per_token(engine, streams, 4, constrained=True)
    print(f"{'streams':>8}  {'free ms/token':>14}  {'json ms/token':>14}  {'json / free':>11}")
    for streams in args.streams:
        free, constrained = [], []
        for _ in range(args.repeats):
            free.append(_decode_seconds_per_token(engine, streams, args.output_len, constrained=False))
            constrained.append(_decode_seconds_per_token(engine, streams, args.output_len, constrained=True))
        free_ms, json_ms = 1e3 * statistics.median(free), 1e3 * statistics.median(constrained)
        print(f"{streams:>8}  {free_ms:>14.2f}  {json_ms:>14.2f}  {json_ms / free_ms:>10.3f}x")
    print(f"\n{'schema':<22}  {'first ms':>9}  {'cached ms':>9}")
    for name, (first, cached) in _compile_times(engine).items():
        print(f"{name:<22}  {1e3 * first:>9.2f}  {1e3 * cached:>9.3f}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
