"""AsyncEngine on its own: batching of concurrent callers, aborts that free blocks, clean shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from kvforge.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError
from kvforge.engine.llm_engine import LLMEngine
from kvforge.engine_args import build_engine_config
from kvforge.sampling_params import SamplingParams

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_llama_dir: tuple[Path, object]) -> Path:
    return tiny_llama_dir[0]


def _engine(model_dir: Path, max_queue: int = 1024, **engine_kwargs: object) -> AsyncEngine:
    config = build_engine_config(model=str(model_dir), kv_cache_memory="16MiB", **engine_kwargs)
    return AsyncEngine(LLMEngine(config), max_queue=max_queue)


async def _wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_concurrent_callers_share_batches_and_match_alone(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=8)

    async def main() -> tuple[list[str], str, int]:
        engine.start()
        peak = 0

        async def collect(i: int) -> str:
            nonlocal peak
            text = ""
            async for output in engine.generate(f"r{i}", [5 + i, 6, 7, 8], params):
                peak = max(peak, engine.stats.num_running)
                text = output.outputs[0].text
            return text

        texts = await asyncio.gather(*(collect(i) for i in range(8)))
        alone = await collect(3)  # the same prompt again, alone in the batch (its id is free again)
        await engine.shutdown()
        return texts, alone, peak

    texts, alone, peak = asyncio.run(main())
    assert texts[3] == alone
    assert peak > 1


def test_closing_a_stream_aborts_and_frees_blocks(tiny_model_dir: Path) -> None:
    # NOTE: eager: with Inductor's cache cold, a bucket's compile (on the engine's thread, mid-generation) took
    # longer than the 20 s this test waits for an abort to land; compiled steps have their own tests.
    engine = _engine(tiny_model_dir, enforce_eager=True)

    async def main() -> None:
        engine.start()
        free = engine.stats.num_free_blocks
        outputs = engine.generate("a", [5, 6, 7, 8] * 20, LONG)
        first = await anext(outputs)
        assert not first.finished
        await outputs.aclose()
        await _wait_for(lambda: engine.stats.num_running == 0 and engine.stats.num_free_blocks == free)
        # A cancelled reader aborts too.
        task = asyncio.ensure_future(engine.generate("b", [9, 10, 11] * 30, LONG).__anext__())
        await _wait_for(lambda: engine.stats.num_running == 1)
        task.cancel()
        await _wait_for(lambda: engine.stats.num_running == 0 and engine.stats.num_free_blocks == free)
        await engine.shutdown()

    asyncio.run(main())


def test_queue_bound_and_shutdown_fail_requests_instead_of_hanging(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, max_queue=1, max_num_seqs=1)

    async def main() -> None:
        engine.start()
        running = await engine.add_request("run", [5, 6, 7], LONG)
        await _wait_for(lambda: engine.stats.num_running == 1)
        waiting = await engine.add_request("wait", [5, 6, 8], LONG)
        with pytest.raises(EngineOverloadedError):
            await engine.add_request("refused", [5, 6, 9], LONG)
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("run", [5], LONG)
        await engine.shutdown()
        for stream in (running, waiting):
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", [5, 6], LONG)
        assert engine.engine.runner is None  # the model, its KV cache and graphs are released

    asyncio.run(asyncio.wait_for(main(), timeout=60))


def test_shutdown_releases_an_engine_whose_loop_never_ran_or_died(tiny_model_dir: Path) -> None:
    never_started, crashed = _engine(tiny_model_dir), _engine(tiny_model_dir)

    async def main() -> None:
        await never_started.shutdown()
        crashed.engine.step = lambda: 1 / 0  # the loop dies on its first step
        crashed.start()
        stream = await crashed.add_request("a", [5, 6, 7], LONG)
        with pytest.raises(EngineDeadError, match="ZeroDivisionError"):
            async for _ in stream:
                pass
        await crashed.shutdown()

    asyncio.run(asyncio.wait_for(main(), timeout=60))
    for engine in (never_started, crashed):
        assert engine.engine.runner is None
        with pytest.raises(RuntimeError, match="the engine has been shut down"):
            engine.engine.add_request("b", [5, 6], LONG)
