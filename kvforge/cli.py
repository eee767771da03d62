"""The `kvforge` command: generate, chat, serve, router, compile and bench."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from kvforge.engine_args import add_engine_arguments, engine_kwargs_from_args
from kvforge.sampling_params import SamplingParams

# Subcommands that live in their own modules, each with add_arguments(parser) and run(args) -> int.
_BENCHMARKS = {
    "throughput": ("kvforge.benchmarks.throughput", "offline throughput against transformers"),
    "latency": ("kvforge.benchmarks.latency", "one request at a time: time to first token, decode tokens/s"),
    "kernels": ("kvforge.benchmarks.kernels", "kernel timings against their baselines and roofline"),
    "serve": ("kvforge.benchmarks.serve", "drive an OpenAI-compatible server with a seeded workload"),
    "moe": ("kvforge.benchmarks.moe", "the MoE layer's CPU path against a per-expert loop"),
    "structured": ("kvforge.benchmarks.structured", "time per output token with and without a JSON-schema "
                                                    "constraint; grammar compile times"),
    "embed": ("kvforge.benchmarks.embed", "sentences/s of an embedding model against sentence-transformers "
                                          "(and llama.cpp)"),
    "speculative": ("kvforge.benchmarks.speculative",
                    "decode tokens/s with speculation off and with each method, acceptance per position"),
    "router": ("kvforge.benchmarks.router", "replicas behind the router against one replica, on system prompts "
                                            "shared by many requests: throughput, TTFT, prefix-cache hit rate"),
    "lora": ("kvforge.benchmarks.lora", "streams over LoRA adapters in one engine against the base model and "
                                        "against each adapter merged into an engine of its own"),
    "startup": ("kvforge.benchmarks.startup", "`kvforge generate` in fresh processes: start-up, time to first "
                                              "token, whole run"),
}
_SERVE_MODULE = "kvforge.server.cli"
_ROUTER_MODULE = "kvforge.router.cli"
_QUANTIZE_MODULE = "kvforge.quantize.cli"
_PLAN_MODULE = "kvforge.plan.cli"
_PROFILE_MODULE = "kvforge.profiler.cli"
_COMPILE_MODULE = "kvforge.tools.cross_compile"
_ENV_MODULE = "kvforge.tools.env"
_WARM_COMPILE_MODULE = "kvforge.compile_cli"
_EVALS = {"perplexity": ("kvforge.eval.perplexity", "perplexity of each held-out text and their mean")}


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate per answer")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    group.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely (-1: off)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats")
    group.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2]")
    group.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2]")
    group.add_argument("--n", type=int, default=1, help="answers per prompt")
    group.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="per-request sampling seed")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--min-tokens", type=int, default=0, help="generate at least this many tokens")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.sampling_seed, max_tokens=args.max_tokens,
        stop=args.stop, min_tokens=args.min_tokens, ignore_eos=args.ignore_eos,
    )


def _run_generate(args: argparse.Namespace) -> int:
    from kvforge.llm import LLM

    params = sampling_params_from_args(args)
    llm = LLM(**engine_kwargs_from_args(args))
    try:
        _print_answers(llm, args, params)
    finally:
        llm.shutdown()
    return 0


def _print_answers(llm, args: argparse.Namespace, params: SamplingParams) -> None:
    if args.chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompts], params,
                           use_tqdm=len(args.prompts) > 1)
    else:
        outputs = llm.generate(args.prompts, params, use_tqdm=len(args.prompts) > 1)
    for prompt, output in zip(args.prompts, outputs):
        for completion in output.outputs:
            if len(args.prompts) > 1 or params.n > 1:
                print(f"--- {prompt!r} [{completion.index}]")
            print(completion.text)


def _run_chat(args: argparse.Namespace) -> int:
    from kvforge.llm import LLM

    params = sampling_params_from_args(args)
    llm = LLM(**engine_kwargs_from_args(args))
    try:
        return _chat_loop(llm, args, params)
    finally:
        llm.shutdown()


def _chat_loop(llm, args: argparse.Namespace, params: SamplingParams) -> int:
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    messages = args.message or []
    interactive = not messages
    while True:
        if interactive:
            try:
                user = input("you> ")
            except EOFError:
                return 0
            if user.strip() in ("/exit", "/quit"):
                return 0
        elif messages:
            user = messages.pop(0)
        else:
            return 0
        history.append({"role": "user", "content": user})
        reply = llm.chat(history, params)[0].outputs[0].text
        history.append({"role": "assistant", "content": reply})
        print(f"assistant> {reply}" if interactive else reply, flush=True)


def build_parser() -> tuple[argparse.ArgumentParser, dict]:
    parser = argparse.ArgumentParser(prog="kvforge", description=__doc__)
    parser.add_argument("--log-level", default="INFO",
                        help="kvforge's log level: DEBUG, INFO (default: model, cache size, backend), WARNING, ERROR")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete prompts (as a chat by default)",
                                   description="Generate an answer for each prompt, batched together.")
    generate.add_argument("prompts", nargs="+", help="one or more prompts")
    generate.add_argument("--raw", dest="chat_template", action="store_false",
                          help="feed the prompt as plain text instead of wrapping it in the chat template")
    add_engine_arguments(generate)
    add_sampling_arguments(generate)
    generate.set_defaults(handler=_run_generate)

    chat = commands.add_parser("chat", help="chat with the model (interactive, or --message ...)",
                               description="Chat with the model; each turn sees the whole conversation.")
    chat.add_argument("--message", action="append", help="a user turn (repeatable); omit for interactive")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_arguments(chat)
    add_sampling_arguments(chat)
    chat.set_defaults(handler=_run_chat)

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="benchmark", required=True)
    module_parsers = {("bench", name): bench.add_parser(name, help=text, description=text)
                      for name, (_, text) in _BENCHMARKS.items()}
    module_parsers[("serve", None)] = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server", description="Serve the model over an OpenAI-compatible API.")
    module_parsers[("router", None)] = commands.add_parser(
        "router", help="one OpenAI endpoint in front of several servers, routing each request by its prompt's prefix",
        description="Route OpenAI requests over replicas started anywhere: where the prompt's longest prefix was "
        "sent, unless that replica is loaded past a bound; health checks take replicas out and back in.")
    module_parsers[("compile", None)] = commands.add_parser(
        "compile", help="compile a model's decode steps ahead of serving it (fills Inductor's on-disk caches)",
        description="Compile the decode step of every batch size the engine can run, so that a later start of the "
        "same model compiles each from Inductor's caches in seconds.")
    module_parsers[("quantize", None)] = commands.add_parser(
        "quantize", help="write a quantized checkpoint (rtn, gptq, awq, w8a8)",
        description="Quantize a float model and write a checkpoint folder.")
    module_parsers[("plan", None)] = commands.add_parser(
        "plan", help="memory and speed of each tensor x pipeline split over N devices (with --request-rate: the "
        "data-parallel replicas that serve it)",
        description="Estimate memory per device and roofline speed for each TP x PP split, and pick one; with "
        "--request-rate, how many replicas of which split serve that rate within a TTFT bound.")
    module_parsers[("profile", None)] = commands.add_parser(
        "profile", help="where each step's time goes (host, op classes, collectives), against the roofline",
        description="Run a workload on the engine under torch.profiler; report per-step time by op class, "
        "roofline verdicts, a Chrome trace and a plot.")
    module_parsers[("compile-kernels", None)] = commands.add_parser(
        "compile-kernels", help="compile every Triton kernel for the GPUs kvforge tunes for, without them",
        description="Compile every Triton kernel as the engine launches it, for GPU architectures that are "
        "not in this machine; report shared memory, registers and spills.")
    module_parsers[("env", None)] = commands.add_parser(
        "env", help="what the engine will use here: versions, C++ CPU kernels, CPU ISA, Triton, devices, threads",
        description="Print what the engine will use on this machine: kvforge and torch versions, the C++ CPU "
        "kernels (which build, or why none), the CPU's instruction set, Triton, the devices and the thread count.")
    evals = commands.add_parser("eval", help="evaluations").add_subparsers(dest="evaluation", required=True)
    module_parsers.update({("eval", name): evals.add_parser(name, help=text, description=text)
                           for name, (_, text) in _EVALS.items()})
    return parser, module_parsers


def _module_of(argv: list[str]) -> tuple[tuple, str] | None:
    """The (parser key, module) of a command whose flags live in its own module, from the raw argv."""
    words = [w for i, w in enumerate(argv) if not w.startswith("-") and (i == 0 or argv[i - 1] != "--log-level")]
    if words[:1] == ["serve"]:
        return ("serve", None), _SERVE_MODULE
    if words[:1] == ["router"]:
        return ("router", None), _ROUTER_MODULE
    if words[:1] == ["bench"] and len(words) > 1 and words[1] in _BENCHMARKS:
        return ("bench", words[1]), _BENCHMARKS[words[1]][0]
    if words[:1] == ["quantize"]:
        return ("quantize", None), _QUANTIZE_MODULE
    if words[:1] == ["plan"]:
        return ("plan", None), _PLAN_MODULE
    if words[:1] == ["profile"]:
        return ("profile", None), _PROFILE_MODULE
    if words[:1] == ["compile"]:
        return ("compile", None), _WARM_COMPILE_MODULE
    if words[:1] == ["compile-kernels"]:
        return ("compile-kernels", None), _COMPILE_MODULE
    if words[:1] == ["env"]:
        return ("env", None), _ENV_MODULE
    if words[:1] == ["eval"] and len(words) > 1 and words[1] in _EVALS:
        return ("eval", words[1]), _EVALS[words[1]][0]
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, module_parsers = build_parser()
    found = _module_of(argv)
    if found is not None:
        # These commands live in their own modules and own their flags.
        module = importlib.import_module(found[1])
        module.add_arguments(module_parsers[found[0]])
    args = parser.parse_args(argv)
    handler = module.run if found is not None else args.handler
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvforge").setLevel(args.log_level.upper())
    try:
        return handler(args)
    except ValueError as err:
        print(f"kvforge: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
