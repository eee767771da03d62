"""`kvforge router --backend URL [--backend URL ...]`: one OpenAI endpoint in front of servers started anywhere."""

from __future__ import annotations

import argparse
import dataclasses
import os
from contextlib import AbstractContextManager

from kvforge.config import parse_bytes
from kvforge.router.app import RouterConfig, build_router_app
from kvforge.router.policy import POLICIES, LoadBound
from kvforge.server.middleware import API_KEY_ENV


def _default(config_class: type, name: str):
    return next(f.default for f in dataclasses.fields(config_class) if f.name == name)


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    """The routing flags, shared by `kvforge router` and `kvforge serve --data-parallel-size N`."""
    group = parser.add_argument_group("router")
    group.add_argument("--policy", default="prefix", choices=POLICIES,
                       help="prefix: send a request where its prompt's longest prefix was sent (unless that replica "
                            "is loaded past the bound, then to the least loaded); round-robin: in turn")
    group.add_argument("--route-max-queue-depth", type=int, default=_default(LoadBound, "max_queue_depth"),
                       help="a replica with more requests not yet started takes no request for its prefix")
    group.add_argument("--route-max-kv-usage", type=float, default=_default(LoadBound, "max_kv_cache_usage"),
                       help="a replica with more of its KV cache in use (0 to 1) takes no request for its prefix")
    group.add_argument("--route-max-imbalance", type=int, default=_default(LoadBound, "max_imbalance"),
                       help="a replica with this many more requests in flight than the least busy one takes no "
                            "request for its prefix")
    group.add_argument("--health-interval", type=float, default=_default(RouterConfig, "health_interval"),
                       help="seconds between health checks of each replica (GET /health and /metrics)")
    group.add_argument("--health-timeout", type=float, default=_default(RouterConfig, "health_timeout"),
                       help="seconds a health check may take")
    group.add_argument("--unhealthy-after", type=int, default=_default(RouterConfig, "unhealthy_after"),
                       help="failed health checks in a row that take a replica out (a refused connection does at once)")


def router_config(args: argparse.Namespace, backends: tuple[str, ...], api_key: str | None,
                  max_body_bytes: int) -> RouterConfig:
    bound = LoadBound(max_queue_depth=args.route_max_queue_depth, max_kv_cache_usage=args.route_max_kv_usage,
                      max_imbalance=args.route_max_imbalance)
    return RouterConfig(backends, policy=args.policy, bound=bound, health_interval=args.health_interval,
                        health_timeout=args.health_timeout, unhealthy_after=args.unhealthy_after, api_key=api_key,
                        max_body_bytes=max_body_bytes)


def serve_router(config: RouterConfig, host: str, port: int, log_level: str = "info",
                 backends_lifetime: AbstractContextManager | None = None) -> None:
    """Serve the router until interrupted (SIGINT/SIGTERM); `backends_lifetime` as build_router_app takes it."""
    import uvicorn

    if not 0 <= port < 2**16:
        raise ValueError(f"--port must be in [0, 65535], got {port}")
    app = build_router_app(config, backends_lifetime)
    print(f"kvforge: routing ({config.policy}) over {len(config.backends)} replicas on http://{host}:{port}/v1",
          flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append", required=True, metavar="URL",
                        help="a replica's base URL, e.g. http://10.0.0.2:8000 (repeat for each replica)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on /v1 routes (default: ${API_KEY_ENV}); the "
                             "header is passed on to the replicas")
    parser.add_argument("--max-request-size", default="16MiB", help="largest request body (larger ones get 413)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_router_arguments(parser)


def run(args: argparse.Namespace) -> int:
    config = router_config(args, tuple(args.backend), args.api_key, parse_bytes(args.max_request_size))
    serve_router(config, args.host, args.port, args.uvicorn_log_level)
    return 0
