"""The router's HTTP app: the OpenAI generation routes forwarded to a replica chosen by the policy, /v1/models
from a healthy replica, /health, /metrics, and the health checks that take replicas out and back in."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvforge.router.metrics import render_metrics
from kvforge.router.policy import LoadBound, Policy
from kvforge.router.proxy import Forwarder
from kvforge.router.replica import Replica
from kvforge.router.request_text import ROUTED_FIELDS, routing_text
from kvforge.server.errors import error_response
from kvforge.server.metrics import CONTENT_TYPE
from kvforge.server.middleware import APIKeyMiddleware, BodyLimitMiddleware

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The replicas' base URLs, the policy ('prefix' or 'round-robin') and its load bound, the health checks
    (every `health_interval` s, each within `health_timeout` s; out after `unhealthy_after` failures in a row, at
    once on a refused connection), the API key the router asks for, and the largest body it reads."""

    backends: tuple[str, ...]
    policy: str = "prefix"
    bound: LoadBound = LoadBound()
    health_interval: float = 1.0
    health_timeout: float = 5.0
    unhealthy_after: int = 3
    api_key: str | None = None
    max_body_bytes: int = 16 * 2**20

    def __post_init__(self) -> None:
        if not self.backends:
            raise ValueError("the router needs at least one --backend URL")
        for url in self.backends:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"a backend is a base URL such as http://host:8000, got {url!r}")
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"a backend is given twice: {list(self.backends)}")
        for name in ("health_interval", "health_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.unhealthy_after < 1:
            raise ValueError(f"unhealthy_after must be >= 1, got {self.unhealthy_after}")
        Policy(self.policy, self.bound)  # names a bad policy


async def _check_all(http: httpx.AsyncClient, replicas: Sequence[Replica], policy: Policy,
                     config: RouterConfig) -> None:
    came_back = await asyncio.gather(*(r.check(http, config.health_timeout, config.unhealthy_after)
                                       for r in replicas))
    for replica, back in zip(replicas, came_back):
        if back:
            policy.forget(replica)


async def _health_loop(http: httpx.AsyncClient, replicas: Sequence[Replica], policy: Policy,
                       config: RouterConfig) -> None:
    while True:
        await asyncio.sleep(config.health_interval)
        await _check_all(http, replicas, policy, config)


def build_router_app(config: RouterConfig, backends_lifetime: AbstractContextManager | None = None) -> Starlette:
    """The router in front of `config.backends`; health checks run while the app does, and so does
    `backends_lifetime` (entered at startup, left at shutdown: the replica processes the router started)."""
    replicas = [Replica(url) for url in config.backends]
    policy = Policy(config.policy, config.bound)
    # NOTE: no read timeout: a generation may take minutes, and a replica that dies is noticed by the health
    # checks, which end whatever waits on it (see proxy.until_down).
    http = httpx.AsyncClient(timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
    forwarder = Forwarder(http, replicas, policy.choose)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        with backends_lifetime or nullcontext():
            await _check_all(http, replicas, policy, config)
            checks = asyncio.create_task(_health_loop(http, replicas, policy, config))
            try:
                yield
            finally:
                checks.cancel()
                await http.aclose()

    async def generate(request: Request) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
            text = routing_text(request.url.path, payload)
        except ValueError as error:
            return error_response(400, f"the body is not a valid request: {error}")
        stream = payload.get("stream") is True
        return await forwarder.forward(request.url.path, body, dict(request.headers), text, stream)

    async def models(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        for replica in [r for r in replicas if r.healthy]:
            try:
                answer = await http.get(f"{replica.url}{request.url.path}", headers=headers)
            except httpx.TransportError:
                continue
            return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
        return error_response(503, "no replica is healthy", headers={"Retry-After": "1"})

    async def health(_: Request) -> Response:
        num_healthy = sum(r.healthy for r in replicas)
        if not num_healthy:
            return error_response(503, "no replica is healthy")
        return JSONResponse({"status": "ok", "healthy_replicas": num_healthy, "replicas": len(replicas)})

    async def metrics(_: Request) -> Response:
        return Response(render_metrics(replicas, forwarder), media_type=CONTENT_TYPE)

    routes = [Route(path, generate, methods=["POST"]) for path in ROUTED_FIELDS]
    routes += [Route("/v1/models", models), Route("/v1/models/{model_id:path}", models),
               Route("/health", health), Route("/metrics", metrics)]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.replicas = replicas
    app.state.policy = policy
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, timeout=30.0)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    return app
