"""`kvforge serve --data-parallel-size N`: N engine replicas behind the router on the address the user gave. With
`--data-parallel-backend mp` (the default) each replica is its own `kvforge serve` process on a loopback port of
this machine; with `ray` each is a Ray actor on a node of a Ray cluster (see ray_replicas.py).

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
import logging
import multiprocessing
import os
import time
from multiprocessing.process import BaseProcess

from kvforge.config import parse_bytes
from kvforge.engine_args import build_engine_config, engine_kwargs_from_args
from kvforge.router.cli import router_config, serve_router
from kvforge.router.ray_replicas import RayReplicas
from kvforge.router.replica_set import ReplicaSet, free_port, replica_args, serve_replica

logger = logging.getLogger(__name__)


class ReplicaProcesses(ReplicaSet):
    """The replicas as processes on this machine, one per `replica_args` (its host and port set)."""

    def __init__(self, replica_args: list[argparse.Namespace], max_restarts: int = 5,
                 stop_timeout: float = 30.0) -> None:
        super().__init__([f"http://{a.host}:{a.port}" for a in replica_args], max_restarts, stop_timeout)
        self.replica_args = replica_args
        self._context = multiprocessing.get_context("spawn")
        self._processes: list[BaseProcess | None] = [None] * len(replica_args)

    def _start(self, index: int) -> None:
        args = self.replica_args[index]
        process = self._context.Process(target=serve_replica, args=(args,), name=f"kvforge-replica-{args.port}")
        process.start()
        logger.warning("replica on http://%s:%d: pid %d", args.host, args.port, process.pid)
        self._processes[index] = process

    def _exit_reason(self, index: int) -> str | None:
        process = self._processes[index]
        return None if process.is_alive() else f"exit code {process.exitcode}"

    def _stop_all(self) -> None:
        """SIGTERM each replica (a graceful shutdown), then SIGKILL those still running after `stop_timeout`."""
        processes = [p for p in self._processes if p is not None]
        for process in processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + self.stop_timeout
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()


def run_data_parallel(args: argparse.Namespace) -> int:
    """Serve `args.data_parallel_size` replicas behind the router until interrupted."""
    num_replicas = args.data_parallel_size
    build_engine_config(**engine_kwargs_from_args(args))  # bad engine options fail here, once, not N times
    if args.data_parallel_backend == "ray":
        replicas: ReplicaSet = RayReplicas(args, num_replicas)
    else:
        each = []
        for _ in range(num_replicas):
            one = replica_args(args, max(1, (os.cpu_count() or 1) // num_replicas))
            one.host, one.port = "127.0.0.1", free_port("127.0.0.1")
            each.append(one)
        replicas = ReplicaProcesses(each, stop_timeout=args.shutdown_timeout + 5)
    try:
        config = router_config(args, tuple(replicas.urls), args.api_key, parse_bytes(args.max_request_size))
        # NOTE: the replicas live as long as the router's app: uvicorn ends the process with the signal it caught
        # once the app has shut down, so nothing after serve_router would run on SIGTERM.
        serve_router(config, args.host, args.port, args.uvicorn_log_level, backends_lifetime=replicas)
    finally:
        replicas.stop()  # where the router did not start (a Ray placement is held from RayReplicas on)
    return 0
