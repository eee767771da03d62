"""Fixtures: the tiny random Llama served by the real app (uvicorn in a thread) on a free loopback port."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server.harness import API_KEY, ServerThread, start_tiny_server


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
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
