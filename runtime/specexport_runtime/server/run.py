"""Run the app under uvicorn, with a shutdown that drains before the listener closes.

On SIGTERM (or SIGINT) uvicorn stops its main loop and calls `shutdown`; DrainingServer first
drains (new requests get 503 while the listener is still open, queued ones get 503, the running
one may finish within drain_seconds and is otherwise cut after its round with a final chunk),
then lets uvicorn close the listener and wait for the last responses. A second SIGINT forces
the exit. The process exits within drain_seconds + one round + CUT_GRACE_SECONDS + uvicorn's
graceful timeout.
"""

from __future__ import annotations

import socket
import sys

import uvicorn

from .app import create_app
from .config import ServerConfig

GRACEFUL_TIMEOUT_SECONDS = 5  # uvicorn's own wait for open connections after the drain


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if not self.force_exit:
            await self.state.drain(lambda: self.force_exit)
        await super().shutdown(sockets)


def make_server(gen, config: ServerConfig, log_level: str = "info", access_log: bool = True) -> DrainingServer:
    """A server for `gen` (not started): `.run()` blocks; `.run(sockets=[s])` serves a bound socket."""
    app = create_app(gen, config)
    uv = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_level=log_level,
        access_log=access_log,
        lifespan="on",
        timeout_graceful_shutdown=GRACEFUL_TIMEOUT_SECONDS,
        server_header=False,
    )
    return DrainingServer(uv, app.state.server)


def serve(gen, config: ServerConfig, log_level: str = "info") -> None:
    """Serve until SIGTERM/SIGINT; warns on stderr when reachable from elsewhere without an API key."""
    warning = config.exposure_warning()
    if warning:
        print(warning, file=sys.stderr)
    make_server(gen, config, log_level).run()
