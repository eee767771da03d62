"""Which engine a configuration runs: LLMEngine (runner "generate") or PoolingEngine (runner "pooling")."""

from __future__ import annotations

from kvforge.config import EngineConfig
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine.pooling_engine import PoolingEngine
from kvforge.loader.pooling_config import resolve_runner

Engine = LLMEngine | PoolingEngine


def create_engine(config: EngineConfig) -> Engine:
    """The engine of the configured runner; runner "auto" reads it off the checkpoint (loader/pooling_config.py)."""
    if resolve_runner(config.model) == "pooling":
        return PoolingEngine(config)
    return LLMEngine(config)
