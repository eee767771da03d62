"""The server's lifetime on uvicorn: socket timeouts, and a graceful shutdown with a deadline.

```
 SIGTERM ──► stop accepting ──► requests in flight go on ── shutdown_timeout ──► streams end with an
                                                                                 error event, others 503
          ──► connections closed ──► engine stopped (lifespan)
```
"""

from __future__ import annotations

import asyncio
import socket

import uvicorn
from fastapi import FastAPI

# uvicorn's own graceful-shutdown limit, beyond ours: time for the error events to go out.
_UVICORN_MARGIN_SECONDS = 5.0


class ShutdownDeadline:
    """Fires `shutdown_timeout` seconds after the server begins to shut down; requests still running
    then are ended (see RequestGroup.outputs)."""

    def __init__(self, shutdown_timeout: float) -> None:
        self.shutdown_timeout = shutdown_timeout
        self.expired = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None

    def begin(self) -> None:
        """Start the countdown (on the server's event loop); later calls do nothing."""
        if self._timer is None and not self.expired.is_set():
            self._timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.expired.set)


class Server(uvicorn.Server):
    """uvicorn's server, which starts the app's shutdown deadline when it begins to shut down."""

    def __init__(self, config: uvicorn.Config, deadline: ShutdownDeadline) -> None:
        super().__init__(config)
        self.deadline = deadline

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.deadline.begin()
        await super().shutdown(sockets)


def uvicorn_server(app: FastAPI, host: str, port: int, log_level: str = "info",
                   access_log: bool = False) -> Server:
    """The server for an app of `build_app`, with the timeouts of its ServerConfig."""
    config = app.state.server_config
    uvicorn_config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=access_log,
        timeout_keep_alive=config.keep_alive_timeout,
        timeout_graceful_shutdown=config.shutdown_timeout + _UVICORN_MARGIN_SECONDS,
    )
    return Server(uvicorn_config, app.state.server.shutdown_deadline)
