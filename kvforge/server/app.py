"""The FastAPI application: OpenAI routes, /health, /ready, /metrics, middleware and the engine's lifetime."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from kvforge import __version__
from kvforge.engine.async_engine import AsyncEngine
from kvforge.server import chat, completions, embeddings, lora_adapters, responses, scoring, tokenize
from kvforge.server.errors import error_response, install_error_handlers
from kvforge.server.lifecycle import ShutdownDeadline
from kvforge.server.lora_adapters import LoRAAdapters
from kvforge.server.metrics import CONTENT_TYPE, ServerMetrics
from kvforge.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
from kvforge.server.openapi import install_openapi
from kvforge.server.protocol import ModelCard, ModelList
from kvforge.server.responses_store import ResponseStore
from kvforge.server.serving import ServerState

DEFAULT_MAX_BODY_BYTES = 16 * 2**20


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-side settings: the names clients address the model by, the API key, the body limit, and
    the timeouts (seconds): reading a request body (408 after), an idle keep-alive connection, and
    the requests still running when a shutdown begins; and how many responses /v1/responses keeps (the
    oldest is forgotten first)."""

    served_model_names: tuple[str, ...]
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    body_read_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    shutdown_timeout: float = 30.0
    max_stored_responses: int = 1024

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError(f"served model names must be non-empty, got {self.served_model_names!r}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_stored_responses < 0:
            raise ValueError(f"max_stored_responses must be >= 0, got {self.max_stored_responses}")
        for name in ("body_read_timeout", "keep_alive_timeout", "shutdown_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")


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
    metrics = ServerMetrics(lambda: engine.stats, engine.engine.config.scheduler.max_num_seqs, engine.max_queue)
    state = ServerState(engine, metrics, config.served_model_names, engine.vocab_size,
                        ShutdownDeadline(config.shutdown_timeout), LoRAAdapters(config.served_model_names))
    app.state.server = state
    app.state.server_config = config
    app.state.responses = ResponseStore(config.max_stored_responses)
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(responses.router)
    app.include_router(tokenize.router)
    app.include_router(embeddings.router)
    app.include_router(scoring.router)
    app.include_router(lora_adapters.router)

    def model_card(name: str) -> ModelCard:
        lora = state.lora_for(name)
        if lora is not None:
            return ModelCard(id=name, root=lora.path, parent=state.model_names[0], max_model_len=engine.max_model_len)
        return ModelCard(id=name, root=engine.model_name, max_model_len=engine.max_model_len)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[model_card(name) for name in (*state.model_names, *state.adapters.by_name)])

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> ModelCard:
        return model_card(state.check_model(model_id))

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return error_response(503, "the engine is not running")
        return JSONResponse({"status": "ok"})

    awaiting_start_compiles = engine.engine.config.compilation.compile_at_start

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: the engine runs and, with --compile-at-start, the decode steps it started compiling are
        compiled (later compiles of a new batch size, in the background, leave it ready)."""
        nonlocal awaiting_start_compiles
        if not engine.is_alive:
            return error_response(503, "the engine is not running")
        if awaiting_start_compiles:
            num_compiling = engine.num_compiling()
            if num_compiling:
                return error_response(503, f"compiling the decode steps of {num_compiling} more batch sizes")
            awaiting_start_compiles = False
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics(_: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    # The last middleware added runs first: the key is checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.max_body_bytes, timeout=config.body_read_timeout)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    install_openapi(app, authenticated=bool(config.api_key))
    return app
