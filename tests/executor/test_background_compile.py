"""The compile thread: jobs run in the turns the engine's steps leave them, hand back their values and errors, stop
when cancelled, and a section run alone never overlaps a step."""

from __future__ import annotations

import threading
import time

import torch

from kvforge import LLM, SamplingParams
from kvforge.executor.background_compile import IDLE_SECONDS, MAX_WAIT_SECONDS, CompileThread


def _count_calls(counter: list[int], stop: threading.Event) -> None:
    """A job of Python calls (as a compile is), counting them until stop is set."""
    while not stop.is_set():
        counter[0] += 1


def test_jobs_hand_back_their_values_and_errors_in_order() -> None:
    compiler = CompileThread("test-compile")

    def fails() -> None:
        raise ValueError("no graph")

    compiler.submit("a", lambda: 41 + 1)
    compiler.submit("b", fails)
    compiler.wait()
    (key_a, value), (key_b, error) = compiler.results()
    assert (key_a, value, key_b) == ("a", 42, "b") and isinstance(error, ValueError)
    assert compiler.results() == [] and compiler.num_pending == 0


def test_a_compile_waits_while_a_step_runs_and_runs_while_the_engine_idles() -> None:
    compiler = CompileThread("test-compile")
    counter, stop = [0], threading.Event()
    compiler.submit("job", lambda: _count_calls(counter, stop))
    try:
        time.sleep(0.2)
        assert counter[0] > 1000  # no step yet: the engine idles
        for _ in range(3):  # NOTE: a step stretched past MAX_WAIT_SECONDS by other work gives a forced turn: again
            with compiler.step():
                start = time.monotonic()
                time.sleep(0.05)  # the job reaches its next call and waits
                during = counter[0]
                time.sleep(0.3)
                during = counter[0] - during
                stretched = time.monotonic() - start >= MAX_WAIT_SECONDS
            if not stretched:
                break
        before = counter[0]
        time.sleep(IDLE_SECONDS + 0.2)
        assert during <= 1 and counter[0] > before + 1000
    finally:
        stop.set()
        compiler.wait()


def test_close_stops_a_running_job_at_its_next_call() -> None:
    compiler = CompileThread("test-compile")
    counter = [0]
    compiler.submit("forever", lambda: _count_calls(counter, threading.Event()))
    compiler.submit("never", lambda: 1)
    time.sleep(0.1)
    start = time.monotonic()
    compiler.close()
    assert time.monotonic() - start < 1.0 and compiler.num_pending == 0 and compiler.results() == []
    stopped = counter[0]
    time.sleep(0.1)
    assert counter[0] == stopped


def test_an_fx_trace_run_alone_never_overlaps_an_eager_step(tiny_llama_dir) -> None:
    """torch.fx's Tracer wraps torch.nn.Module.__call__ in every thread while it traces: an eager step beside it raised
    NameError ("module is not installed as a submodule"). Traced alone, the steps answer as they do without it."""
    llm = LLM(str(tiny_llama_dir[0]), kv_cache_memory="4MiB", enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(5, 40))}]
    expected = llm.generate(prompt, params)[0].outputs[0].token_ids
    compiler, stop = CompileThread("test-compile"), threading.Event()
    runner = llm.engine.runner
    execute = runner.execute

    def stepping_execute(output):  # the runner's steps, as the compiled runner wraps them
        with compiler.step():
            return execute(output)

    def trace_again_and_again() -> None:
        while not stop.is_set():
            with compiler.alone():
                torch.fx.symbolic_trace(lambda x: torch.relu(x) + 1)

    runner.execute = stepping_execute
    compiler.submit("traces", trace_again_and_again)
    try:
        for _ in range(5):
            assert llm.generate(prompt, params)[0].outputs[0].token_ids == expected
    finally:
        stop.set()
        compiler.wait()
