"""`kvforge compile`: compile a model's decode step for every batch size it can run, ahead of serving it.

Inductor keeps what it compiles in its on-disk caches (TORCHINDUCTOR_CACHE_DIR): a later `kvforge serve` or
`kvforge generate` of the same model, options, torch and kernels compiles each batch size from them in seconds
instead of minutes (in the background either way: the engine serves eagerly meanwhile).
"""

from __future__ import annotations

import argparse
import time

from kvforge.engine_args import add_engine_arguments, engine_kwargs_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as --model takes it (default: the default model)")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="compile the batch sizes up to this (default: every --compile-buckets size the engine "
                             "can run, within --max-num-seqs)")
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from kvforge.executor.worker import max_decode_rows
    from kvforge.llm import LLM

    if args.model_tag is not None:
        args.model = args.model_tag
    if args.max_batch is not None and args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    llm = LLM(**engine_kwargs_from_args(args))
    try:
        graphs = llm.engine.runner.decode_graphs
        if graphs is None:
            raise ValueError("this engine runs its decode steps eagerly (--enforce-eager, tensor or pipeline "
                             "parallelism, or no C++ CPU kernels): there is nothing to compile")
        max_batch = args.max_batch or max_decode_rows(llm.engine.config)
        draft = llm.engine.runner.draft  # a draft model's decode steps compile too (one row per drafting request)
        models = [("", graphs)] + ([] if draft is None or draft.graphs is None else [("draft model ", draft.graphs)])
        for name, model_graphs in models:
            for bucket in (b for b in model_graphs.buckets if b <= max_batch):
                start = time.perf_counter()
                model_graphs.compile_ahead(bucket)
                if model_graphs.failed:
                    print(f"{name}batch {bucket}: cannot be compiled (see the log); the engine runs this model "
                          f"eagerly")
                    return 1
                print(f"{name}batch {bucket}: {time.perf_counter() - start:.1f} s "
                      f"({model_graphs.wrappers[bucket]} wrapper)", flush=True)
        print(f"compiled into {cache_dir()}")
    finally:
        llm.shutdown()
    return 0
