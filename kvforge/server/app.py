"""The FastAPI application: OpenAI routes, /health, /metrics, middleware and the engine's lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from kvforge.engine.async_engine import AsyncEngine
from kvforge.server import chat, completions
from kvforge.server.errors import error_response, install_error_handlers
from kvforge.server.metrics import CONTENT_TYPE, ServerMetrics
from kvforge.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from kvforge.server.protocol import ModelCard, ModelList
from kvforge.server.serving import ServerState

DEFAULT_MAX_BODY_BYTES = 16 * 2**20


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-side settings: the names clients address the model by, the API key and the body limit."""

    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError(f"served model names must be non-empty, got {self.served_model_names!r}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The app serving `engine`: it starts the engine thread on startup and stops it on shutdown."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await engine.shutdown()

    app = FastAPI(title="kvforge", lifespan=lifespan, docs_url=None, redoc_url=None)
    metrics = ServerMetrics(lambda: engine.stats)
    state = ServerState(engine, metrics, config.served_model_names, engine.vocab_size)
    app.state.server = state
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(chat.router)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len)
                               for name in state.model_names])

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return error_response(503, "the engine is not running")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics(_: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    # The last middleware added runs first: the key is checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    return app
