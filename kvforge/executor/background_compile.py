"""Compiles off the engine loop: a thread that runs compile jobs one at a time, in the turns the engine lends it.

    engine thread    ─step─┐ host ┌─lend─┐ ┌─step─┐ host ┌─lend─┐ ┌─step─ ...
    compile thread         │ (waits)     └─┘      │ (waits)     └─┘            (runs only in the lends)
                     engine idle for IDLE_SECONDS: the compile runs until the next step

CPython runs one thread's Python at a time (the GIL). A compile is mostly Python (dynamo's tracing, Inductor's
lowering and code generation), and an eager step gives the GIL up around every torch op and must win it back each
time: beside a compile running freely each op waited up to the interpreter's switch interval (5 ms), and an eager
decode step of a tiny 512-wide model took 225 ms instead of 17 (median over a compile, 2-core VM). So the compile
thread runs only in turns: a profile hook of that thread alone (sys.setprofile) makes it wait at its next call
outside them. The engine lends it a turn of LEND_SHARE of the last step's time before each step when it waited to
run (a stream's chunks come that much slower while a compile runs, and the compile still ends under a full load),
and all the time the engine idles. The C++ compiler processes it starts inherit its lowest OS priority (Linux).

Python's cyclic garbage collector runs in whichever thread allocates when a threshold trips, holding the GIL: a
compile's ~200k new objects made full collections of 70-180 ms (tiny model, 2-core VM) stop the steps three times a
compile. So the collector is off while jobs run, and collects once after them when the engine idles (or after
GC_DEFER_SECONDS: one pause then).
"""

from __future__ import annotations

import atexit
import gc
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from types import FrameType

logger = logging.getLogger(__name__)

LEND_SHARE = 0.25  # of the last step's time, lent to a waiting compile before each step
MIN_LEND_SECONDS = 0.001  # NOTE: a shorter turn is mostly the two threads' wake-ups
LEND_SLACK_SECONDS = 0.002  # the engine waits this much beyond a lend for the compile to wake up and take it
IDLE_SECONDS = 0.05  # without a step for this long, the engine idles: the compile runs until its next step
# NOTE: a waiting compile may hold a lock that a step needs (a module's import lock, a logging handler's): after
# MAX_WAIT_SECONDS without a turn it takes one of FORCED_TURN_SECONDS, so such a step waits for it instead of
# deadlocking (and a step longer than that, a long prompt's, shares a tenth of its time).
MAX_WAIT_SECONDS = 0.5
FORCED_TURN_SECONDS = 0.05
GC_DEFER_SECONDS = 30.0  # the longest the collector stays off after the jobs, waiting for the engine to idle
# NOTE: the compile thread's OS priority (and its compiler processes'): the lowest, so that the engine's threads take
# a core from them at once, but not SCHED_IDLE, under which a compile never ends on a machine that other work keeps busy
NICE = 19


# Python functions a cancel is not raised at: the exits that release what their with statement took
_UNWIND_FUNCTIONS = frozenset({"__exit__", "__aexit__", "release"})


class CompileCancelled(BaseException):
    """Raised inside a cancelled compile at its next Python call (a BaseException: torch catches Exception)."""


class CompileThread:
    """Runs submitted jobs in submission order on a daemon thread of its own, which exists while there are jobs.

    `step()` wraps each engine step; `results()` hands the finished jobs (their values, or the exceptions they
    raised) to the engine's thread; `close()` cancels what is queued or running."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)  # notified when the last job ends
        self._jobs: deque[tuple[Hashable, Callable[[], object]]] = deque()
        self._running: tuple[Hashable, Callable[[], object]] | None = None
        self._results: list[tuple[Hashable, object]] = []
        self._thread: threading.Thread | None = None
        self._turn = threading.Event()  # set: the compile may run, until _turn_ends (time.perf_counter())
        self._turn_ends: float | None = math.inf  # None: a lend of _lent seconds from when the compile wakes up
        self._lent = 0.0
        self._turn_over = threading.Event()  # set by the compile when a lend ends
        self._stepping = False
        self._last_step_end = 0.0
        self._step_seconds = 0.0
        self._waited = False  # the compile waited for a turn since the last one: it has Python to run
        self._cancelled = False
        self._alone = threading.Lock()  # held by each step, and by the compile in a section no step may run beside
        self._in_alone = False

    @property
    def num_pending(self) -> int:
        """Jobs queued or running (any thread may ask)."""
        with self._lock:
            return len(self._jobs) + (self._running is not None)

    def submit(self, key: Hashable, job: Callable[[], object]) -> None:
        """Queue job; its value (or exception) comes back from results() under key. Ignored once closed."""
        with self._lock:
            if self._cancelled:
                return
            self._jobs.append((key, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                # NOTE: a daemon thread still compiling when the interpreter finalizes aborts the process (torch's C++
                # meets the finalizing interpreter: "terminate called without an active exception"): at exit, the
                # compile is cancelled and its thread joined first
                atexit.register(self.close)
                self._thread.start()

    def thread_options(self) -> dict[str, object]:
        """Inductor's configuration for a compile on this thread (none elsewhere): its work on this thread alone.

        NOTE: Inductor compiles its C++ kernels on threads and processes of its own where it may (compile_threads,
        which its caches do not key on): the Python of those threads would take no turns, and the steps would wait
        for the GIL beside it."""
        return {"compile_threads": 1} if threading.current_thread() is self._thread else {}

    def results(self, owner: object | None = None) -> list[tuple[Hashable, object]]:
        """The jobs finished since the last call: (key, value or the exception it raised). With owner (a thread that
        several owners share), only those submitted under keys (owner, key), as (key, value)."""
        with self._lock:
            if owner is None:
                done, self._results = self._results, []
                return done
            mine = [isinstance(key, tuple) and key[0] is owner for key, _ in self._results]
            done = [(key[1], value) for (key, value), is_mine in zip(self._results, mine) if is_mine]
            self._results = [result for result, is_mine in zip(self._results, mine) if not is_mine]
        return done

    def wait(self) -> None:
        """Block until every submitted job has finished (call it between steps, or it waits on the steps)."""
        with self._drained:
            self._drained.wait_for(lambda: not self._jobs and self._running is None)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around an engine step: first lend the compile its turn if it waited for one (it has Python to run, not
        a C++ build to wait for), then keep it waiting until the step ends."""
        with self._lock:
            self._stepping = True
            self._turn.clear()
            lend = max(LEND_SHARE * self._step_seconds, MIN_LEND_SECONDS) if self._waited else 0.0
            if lend:
                self._waited = False
                self._turn_over.clear()
                self._lent, self._turn_ends = lend, None
                self._turn.set()
        if lend:
            self._turn_over.wait(lend + LEND_SLACK_SECONDS)
            self._turn.clear()
        start = time.perf_counter()
        try:
            with self._alone:
                yield
        finally:
            end = time.perf_counter()
            with self._lock:
                self._stepping, self._last_step_end, self._step_seconds = False, end, end - start

    @contextmanager
    def alone(self) -> Iterator[None]:
        """For a job: a section that no engine step runs beside (it waits for the step running now, and the next
        one waits for it), in which the compile does not wait for turns."""
        self._alone.acquire()
        self._in_alone = True
        try:
            yield
        finally:
            # NOTE: released before the compile may wait for a turn again: waiting with it held stops the steps
            self._alone.release()
            self._in_alone = False

    def close(self, timeout: float = 10.0) -> None:
        """Cancel the queued jobs and the running one (at its next call), and drop the results not taken yet; wait up
        to timeout seconds for the running job to stop.
        A compile inside a long C++ build may outlast that: its daemon thread is then left behind, and ends when the
        build returns."""
        with self._lock:
            self._cancelled = True
            self._jobs.clear()
            self._results.clear()
            thread = self._thread
        self._give_turn(math.inf)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("a decode-step compile is still inside the C++ compiler after %.0f s; leaving its "
                               "thread to end", timeout)

    def _give_turn(self, ends: float) -> None:
        with self._lock:
            self._turn_ends = ends
            self._turn.set()

    def _wait_for_turn(self, frame: FrameType, event: str, arg: object) -> None:
        """The compile thread's profile hook, called at each call and return of its Python and C functions (C calls
        too: a Python loop of C calls, hashing files say, makes no Python call)."""
        if (event != "call" and event != "c_call") or self._in_alone:
            return
        if self._cancelled:
            # NOTE: raised only as a Python function starts, never as a C one does: raised at a lock's __exit__ (a C
            # call) it left the lock held by a thread that then ended, and the next compile waited on it forever.
            # The profile hook is unset once it raises, so what runs while the exception unwinds runs unhooked.
            if event == "call" and frame.f_code.co_name not in _UNWIND_FUNCTIONS:
                raise CompileCancelled
            return
        ends = self._turn_ends  # NOTE: read once: the engine's thread may set it to None (a lend) meanwhile
        if not self._turn.is_set() or ends is None or time.perf_counter() >= ends:
            self._wait()

    def _wait(self) -> None:
        """Wait (without the GIL) for a turn: a lend, the engine idling, or MAX_WAIT_SECONDS without one."""
        give_up = time.perf_counter() + MAX_WAIT_SECONDS
        while True:
            now = time.perf_counter()
            with self._lock:
                if self._turn.is_set() and self._turn_ends is None:  # a lend begins
                    self._turn_ends = now + self._lent
                if self._turn.is_set() and now < self._turn_ends:
                    return
                self._turn.clear()  # a turn that has ended
                self._turn_over.set()
                self._waited = True
                idle = not self._stepping and now - self._last_step_end >= IDLE_SECONDS
                if self._cancelled or idle or now >= give_up:
                    self._turn_ends = math.inf if self._cancelled or idle else now + FORCED_TURN_SECONDS
                    self._turn.set()  # until the next step begins, or the forced turn ends
                    return
            self._turn.wait(IDLE_SECONDS)

    def _work(self) -> None:
        if sys.platform == "linux":  # NOTE: a per-thread priority on Linux, inherited by the processes it starts
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICE)
        collector_was_on = gc.isenabled()
        while True:
            gc.disable()
            while (job := self._next_job()) is not None:
                key, value = job[0], self._run(job[1])
                with self._lock:
                    if not self._cancelled:
                        self._results.append((key, value))
            if collector_was_on:
                self._collect_when_idle()
            with self._lock:
                if not self._jobs or self._cancelled:  # else jobs came while it collected
                    self._thread = None
                    atexit.unregister(self.close)
                    return

    def _next_job(self) -> tuple[Hashable, Callable[[], object]] | None:
        with self._lock:
            self._running = self._jobs.popleft() if self._jobs and not self._cancelled else None
            if self._running is None:
                self._drained.notify_all()
            return self._running

    def _run(self, job: Callable[[], object]) -> object:
        sys.setprofile(self._wait_for_turn)
        try:
            return job()
        except CompileCancelled as cancelled:
            return cancelled
        except Exception as error:  # noqa: BLE001 -- handed to the engine's thread, which raises or logs it
            return error
        finally:
            sys.setprofile(None)

    def _collect_when_idle(self) -> None:
        """Turn the collector back on, and collect what the compiles left once the engine idles."""
        deadline = time.perf_counter() + GC_DEFER_SECONDS
        while not self._cancelled and time.perf_counter() < deadline:
            with self._lock:
                if not self._stepping and time.perf_counter() - self._last_step_end >= IDLE_SECONDS:
                    break
            time.sleep(IDLE_SECONDS)
        gc.enable()
        gc.collect()
