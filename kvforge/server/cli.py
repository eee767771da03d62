"""`kvforge serve`: load the model and serve it over the OpenAI-compatible HTTP API with uvicorn."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from kvforge.config import parse_bytes
from kvforge.engine_args import add_engine_arguments, build_engine_config, engine_kwargs_from_args
from kvforge.router.cli import add_router_arguments
from kvforge.router.ray_replicas import PLACEMENTS
from kvforge.server.middleware import API_KEY_ENV

if TYPE_CHECKING:
    from kvforge.server.lifecycle import Server

DATA_PARALLEL_BACKENDS = ("mp", "ray")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve, as --model takes it (a folder, a .gguf file, or a hub id "
                             "such as org/name found in the local Hugging Face cache)")
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000, help="port to listen on")
    group.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                       help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV})")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="names clients address the model by (default: the --model value, or the "
                            "default model's file name)")
    group.add_argument("--max-queue", type=int, default=1024,
                       help="most sequences waiting for a batch slot (beyond --max-num-seqs; a request's n "
                            "samples count together); beyond it requests get 503 with Retry-After")
    group.add_argument("--max-request-size", default="16MiB",
                       help="largest request body, e.g. 16MiB (larger ones get 413)")
    group.add_argument("--body-read-timeout", type=float, default=30.0,
                       help="seconds to receive a request body; slower clients get 408 and are disconnected")
    group.add_argument("--keep-alive-timeout", type=float, default=5.0,
                       help="seconds an idle keep-alive connection stays open")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGTERM, seconds the requests in flight may still run; then streams end "
                            "with an error event and other requests get 503")
    group.add_argument("--max-stored-responses", type=int, default=1024,
                       help="most responses /v1/responses keeps in memory for retrieval and previous_response_id "
                            "(the oldest is forgotten first; 0 keeps none)")
    group.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) to serve by name: a request's model field picks one "
                            "(turns on --enable-lora)")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    group.add_argument("--access-log", action="store_true", help="log every HTTP request")
    group.add_argument("--data-parallel-size", type=int, default=1,
                       help="engine replicas to start, each with its own KV cache, behind one router on "
                            "--host:--port (the router flags below apply)")
    group.add_argument("--data-parallel-backend", default="mp", choices=DATA_PARALLEL_BACKENDS,
                       help="how the replicas run: mp (processes on this machine, on loopback ports) or ray (Ray "
                            "actors across the Ray cluster at --ray-address, each serving on its node's address; "
                            "pip install kvforge[ray])")
    group.add_argument("--data-parallel-placement", default="SPREAD", choices=PLACEMENTS,
                       help="with --data-parallel-backend ray, how the replicas' placement-group bundles go over "
                            "the nodes: SPREAD (over as many nodes as it can), STRICT_SPREAD (each on a node of "
                            "its own, or no start) or PACK (as few nodes as it can)")
    group.add_argument("--data-parallel-replica-cpus", type=int, default=None,
                       help="with --data-parallel-backend ray, CPUs each replica's bundle holds (and threads it "
                            "uses; default: one beside GPUs, one per rank on CPUs)")
    add_router_arguments(parser)
    add_engine_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.data_parallel_size > 1:
        _check(args)
        from kvforge.router.data_parallel import run_data_parallel

        return run_data_parallel(args)
    build_server(args).run()
    return 0


def _check(args: argparse.Namespace) -> dict[str, str]:
    """ValueError for a bad flag, before any model loads; the LoRA modules to load (turning on --enable-lora)."""
    from kvforge.server.app import ServerConfig
    from kvforge.server.lora_adapters import parse_lora_modules

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if not 0 <= args.port < 2**16:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_replica_cpus is not None and args.data_parallel_replica_cpus < 1:
        raise ValueError(f"--data-parallel-replica-cpus must be >= 1, got {args.data_parallel_replica_cpus}")
    parse_bytes(args.max_request_size)
    ServerConfig(served_model_names=("check",), max_stored_responses=args.max_stored_responses,
                 **_timeouts(args))  # bad values fail before the model loads
    lora_modules = parse_lora_modules(args.lora_modules, tuple(args.served_model_name or ()))
    if lora_modules:
        args.enable_lora = True
    return lora_modules


def _timeouts(args: argparse.Namespace) -> dict[str, float]:
    return {"body_read_timeout": args.body_read_timeout, "keep_alive_timeout": args.keep_alive_timeout,
            "shutdown_timeout": args.shutdown_timeout}


def build_server(args: argparse.Namespace) -> Server:
    """One engine's server as `kvforge serve` runs it: the model loaded, its app on uvicorn (not yet running)."""
    from kvforge.engine.async_engine import AsyncEngine
    from kvforge.engine.engines import create_engine
    from kvforge.server.app import ServerConfig, build_app
    from kvforge.server.lifecycle import uvicorn_server

    lora_modules = _check(args)
    engine = create_engine(build_engine_config(**engine_kwargs_from_args(args)))
    names = tuple(args.served_model_name or [args.model or Path(engine.model_name).stem])
    config = ServerConfig(served_model_names=names, api_key=args.api_key,
                          max_body_bytes=parse_bytes(args.max_request_size),
                          max_stored_responses=args.max_stored_responses, **_timeouts(args))
    app = build_app(AsyncEngine(engine, max_queue=args.max_queue), config)
    try:
        app.state.server.adapters.load_at_start(engine, lora_modules)
    except ValueError:
        engine.shutdown()
        raise
    print(f"kvforge: serving {', '.join(names)} on http://{args.host}:{args.port}/v1", flush=True)
    return uvicorn_server(app, args.host, args.port, args.uvicorn_log_level, args.access_log)
