"""The replicas `kvforge serve --data-parallel-size N` starts, however they run (processes on this machine, Ray
actors across a cluster): a replica's own set-up, and the set of them that lives while the router does.

```
 __enter__ ─► start each ─► watch: one exited? ─► start it again at its URL (at most max_restarts times)
 __exit__  ─► stop each (gracefully, then by force)
```

The router reaches replica i at `urls[i]` for the whole run, so a replica started again listens where it did.
"""

from __future__ import annotations

import argparse
import copy
import logging
import socket
import threading

logger = logging.getLogger(__name__)


def replica_args(args: argparse.Namespace, num_threads: int) -> argparse.Namespace:
    """A replica's flags: the command's, for one replica with `num_threads` CPU threads (host and port still the
    command's: the caller sets them)."""
    one = copy.copy(args)
    one.data_parallel_size, one.replica_threads = 1, num_threads
    return one


def free_port(host: str) -> int:
    """A TCP port free on `host` now."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve_replica(args: argparse.Namespace, on_server=None) -> None:
    """A replica: `kvforge serve` with the command's flags on its own address, with `args.replica_threads` CPU
    threads; `on_server` sees the server before it runs (to stop it from another thread)."""
    import torch

    from kvforge.server.cli import build_server

    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s replica:{args.port} %(name)s: %(message)s")
    logging.getLogger("kvforge").setLevel(args.log_level.upper())
    torch.set_num_threads(args.replica_threads)
    server = build_server(args)
    if on_server is not None:
        on_server(server)
    server.run()


class ReplicaSet:
    """Replicas started at `__enter__`, watched (one that exits is started again, up to `max_restarts` times
    each) and stopped at `__exit__`. A kind of replica says how to start one, whether it still runs and how to
    stop them all."""

    def __init__(self, urls: list[str], max_restarts: int = 5, stop_timeout: float = 30.0) -> None:
        self.urls = urls
        self.max_restarts = max_restarts
        self.stop_timeout = stop_timeout
        self.num_restarts = [0] * len(urls)
        self._stopping = threading.Event()
        self._stopped = False
        self._watcher = threading.Thread(target=self._watch, daemon=True)

    def _start(self, index: int) -> None:
        raise NotImplementedError

    def _exit_reason(self, index: int) -> str | None:
        """Why replica `index` is no longer running (None while it runs)."""
        raise NotImplementedError

    def _stop_all(self) -> None:
        """Stop every replica: gracefully within `stop_timeout` seconds, then by force."""
        raise NotImplementedError

    def __enter__(self) -> ReplicaSet:
        for index in range(len(self.urls)):
            self._start(index)
        self._watcher.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def _watch(self) -> None:
        while not self._stopping.wait(0.5):
            for index in range(len(self.urls)):
                if self._stopping.is_set() or self.num_restarts[index] >= self.max_restarts:
                    continue
                reason = self._exit_reason(index)
                if reason is None:
                    continue
                self.num_restarts[index] += 1
                logger.warning("replica %s exited (%s): starting it again (%d of %d)", self.urls[index], reason,
                               self.num_restarts[index], self.max_restarts)
                self._start(index)

    def stop(self) -> None:
        """Stop watching and stop the replicas (once; later calls do nothing)."""
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        if self._watcher.is_alive():
            self._watcher.join()
        self._stop_all()
