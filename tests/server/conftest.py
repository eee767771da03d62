"""Fixtures: the tiny random Llama served by the real app (uvicorn in a thread) on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from kvforge.engine.async_engine import AsyncEngine
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine_args import build_engine_config
from kvforge.server.app import ServerConfig
from tests.server.harness import API_KEY, MODEL_NAME, ServerThread, start_tiny_server


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_llama_dir: tuple[Path, object]) -> Path:
    return tiny_llama_dir[0]


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path) -> Iterator[ServerThread]:
    server = start_tiny_server(tiny_model_dir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(tiny_server: ServerThread) -> openai.OpenAI:
    return tiny_server.openai_client()


@pytest.fixture(scope="session")
def default_server() -> Iterator[ServerThread]:
    """The default model (SmolLM2-135M-Instruct) served as `kvforge serve` serves it, steps run eagerly."""
    engine = LLMEngine(build_engine_config(kv_cache_memory="128MiB", enforce_eager=True))
    server = ServerThread(AsyncEngine(engine), ServerConfig((MODEL_NAME,), api_key=API_KEY))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def default_client(default_server: ServerThread) -> openai.OpenAI:
    return default_server.openai_client(timeout=300)
