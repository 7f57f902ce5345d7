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
from .logs import configure, log_startup

GRACEFUL_TIMEOUT_SECONDS = 5  # uvicorn's own wait for open connections after the drain


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if not self.force_exit:
            await self.state.drain(lambda: self.force_exit)
        await super().shutdown(sockets)


def make_server(
    gen, config: ServerConfig, log_level: str = "info", access_log: bool = True, own_logging: bool = False
) -> DrainingServer:
    """A server for `gen` (not started): `.run()` blocks; `.run(sockets=[s])` serves a bound socket.
    own_logging: logging is configured already (logs.configure); uvicorn keeps its hands off it."""
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
        **({"log_config": None} if own_logging else {}),
    )
    return DrainingServer(uv, app.state.server)


def serve(
    gen, config: ServerConfig, log_level: str = "info", log_format: str = "text", load_seconds: float | None = None
) -> None:
    """Serve until SIGTERM/SIGINT; warns on stderr when reachable from elsewhere without an API key.
    Logs (logs.py) in `log_format` at `log_level`, starting with the start-up summary."""
    warning = config.exposure_warning()
    if warning:
        print(warning, file=sys.stderr)
    configure(log_format, log_level)
    server = make_server(gen, config, log_level, own_logging=True)
    log_startup(gen, config, load_seconds)
    server.run()
