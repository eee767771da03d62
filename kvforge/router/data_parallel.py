"""`kvforge serve --data-parallel-size N`: N engine replicas on this machine, each its own `kvforge serve`
process on a loopback port, behind the router on the address the user gave.

```
 client ─► router (--host:--port) ─┬─► replica 0  127.0.0.1:P0  (its own TP x PP ranks, if any)
                                   └─► replica 1  127.0.0.1:P1
```

Each replica is started with the same flags (engine options included) as the command, so nothing is declared
twice. A replica that exits is started again on its port (at most `max_restarts` times each); the router's
health checks take it out meanwhile and back in once it answers.
"""

from __future__ import annotations

import argparse
import copy
import logging
import multiprocessing
import os
import socket
import threading
import time
from multiprocessing.process import BaseProcess

from kvforge.config import parse_bytes
from kvforge.engine_args import build_engine_config, engine_kwargs_from_args
from kvforge.router.cli import router_config, serve_router

logger = logging.getLogger(__name__)


def serve_replica(args: argparse.Namespace) -> None:
    """A replica's process: `kvforge serve` with the command's flags, on its own port and share of the cores."""
    import torch

    from kvforge.server.cli import run

    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s replica:{args.port} %(name)s: %(message)s")
    logging.getLogger("kvforge").setLevel(args.log_level.upper())
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.replicas_on_machine))
    run(args)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ReplicaProcesses:
    """The replica processes, while the context is entered: started, watched (a dead one is started again), and
    stopped at its exit."""

    def __init__(self, replica_args: list[argparse.Namespace], max_restarts: int = 5,
                 stop_timeout: float = 30.0) -> None:
        self.replica_args = replica_args
        self.max_restarts = max_restarts
        self.stop_timeout = stop_timeout
        self.urls = [f"http://{a.host}:{a.port}" for a in replica_args]
        self.num_restarts = [0] * len(replica_args)
        self._context = multiprocessing.get_context("spawn")
        self._processes: list[BaseProcess] = []
        self._stopping = threading.Event()
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self._processes]

    def __enter__(self) -> ReplicaProcesses:
        self._processes = [self._start(args) for args in self.replica_args]
        self._watcher.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _start(self, args: argparse.Namespace) -> BaseProcess:
        process = self._context.Process(target=serve_replica, args=(args,), name=f"kvforge-replica-{args.port}")
        process.start()
        logger.warning("replica on http://%s:%d: pid %d", args.host, args.port, process.pid)
        return process

    def _watch(self) -> None:
        while not self._stopping.wait(0.5):
            for i, process in enumerate(self._processes):
                if process.is_alive() or self._stopping.is_set():
                    continue
                if self.num_restarts[i] >= self.max_restarts:
                    continue
                self.num_restarts[i] += 1
                logger.warning("replica %s exited with code %s: starting it again (%d of %d)", self.urls[i],
                               process.exitcode, self.num_restarts[i], self.max_restarts)
                self._processes[i] = self._start(self.replica_args[i])

    def stop(self) -> None:
        """SIGTERM each replica (a graceful shutdown), then SIGKILL those still running after `stop_timeout`."""
        self._stopping.set()
        self._watcher.join()
        for process in self._processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + self.stop_timeout
        for process in self._processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()


def run_data_parallel(args: argparse.Namespace) -> int:
    """Serve `args.data_parallel_size` replicas behind the router until interrupted."""
    num_replicas = args.data_parallel_size
    build_engine_config(**engine_kwargs_from_args(args))  # bad engine options fail here, once, not N times
    replica_args = []
    for _ in range(num_replicas):
        one = copy.copy(args)
        one.host, one.port, one.data_parallel_size = "127.0.0.1", _free_port("127.0.0.1"), 1
        one.replicas_on_machine = num_replicas
        replica_args.append(one)
    processes = ReplicaProcesses(replica_args, stop_timeout=args.shutdown_timeout + 5)
    config = router_config(args, tuple(processes.urls), args.api_key, parse_bytes(args.max_request_size))
    # NOTE: the replicas live as long as the router's app: uvicorn ends the process with the signal it caught
    # once the app has shut down, so nothing after serve_router would run on SIGTERM.
    serve_router(config, args.host, args.port, args.uvicorn_log_level, backends_lifetime=processes)
    return 0
