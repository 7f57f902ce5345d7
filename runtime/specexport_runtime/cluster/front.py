"""The HTTP front of `serve --replicas/--autoscale`: the cluster's Relay under uvicorn, in the
command's own process.

    HTTP -> this process (uvicorn, ingress.Relay) -> DeploymentHandle, over gRPC -> SpecReplica x N

Ray Serve runs the replicas only (an application with no HTTP route and no Ray proxy): a request
makes one Ray hop, where Ray's proxy and an ingress deployment add two processes and most of the
cluster's per-request time (docs/serving.md measures both). The listening socket is bound before
Ray starts, so a busy port fails at once. uvicorn runs in a thread of its own; the command's main
thread keeps the signals (deployment.serve_cluster). The app served is the Relay behind the
server's CORS rules (ingress.front_app).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from ..errors import SpecExportError
from .ingress import Relay, front_app

GRACEFUL_SECONDS = 5  # uvicorn's wait for open connections once the front stops
START_SECONDS = 30.0  # how long the front may take to start serving


class FrontError(SpecExportError):
    """The front could not listen on its address, or did not start."""


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (asyncio listens on it when uvicorn starts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise FrontError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, remembering its loop (the Relay's close runs there)."""

    loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets)


class Front:
    """Serves `relay` on the bound socket `sock` from a thread: start(), then stop()."""

    def __init__(
        self,
        relay: Relay,
        sock: socket.socket,
        log_level: str = "info",
        access_log: bool = True,
        cors_origins: tuple[str, ...] = (),
        own_logging: bool = False,
    ):
        """cors_origins: parsed patterns (server/cors.py; () = no CORS); own_logging: logging is
        configured already (server/logs.configure), uvicorn keeps its hands off it."""
        self.relay, self.sock = relay, sock
        config = uvicorn.Config(
            front_app(relay, cors_origins),
            log_level=log_level,
            access_log=access_log,
            lifespan="on",
            timeout_graceful_shutdown=GRACEFUL_SECONDS,
            server_header=False,
            **({"log_config": None} if own_logging else {}),
        )
        self.server = _Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="front", daemon=True)

    def start(self, timeout: float = START_SECONDS) -> None:
        """Serve from now on; FrontError when uvicorn did not start within `timeout` seconds."""
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            self.stop()
            raise FrontError(f"the HTTP front did not start on {self.address}")

    @property
    def address(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def begin_drain(self) -> None:
        """New requests get 503 shutting_down; running ones go on (ingress.Relay.begin_drain)."""
        self.relay.begin_drain()

    def stop(self) -> None:
        """Cut what still runs (each client gets 503 or an error event, never a clean short answer),
        stop listening, and wait for uvicorn to end (GRACEFUL_SECONDS for open connections)."""
        loop = self.server.loop
        if loop is not None and self.thread.is_alive():
            asyncio.run_coroutine_threadsafe(self.relay.close(), loop).result(GRACEFUL_SECONDS)
        self.server.should_exit = True
        self.thread.join(GRACEFUL_SECONDS + 5)
        self.sock.close()
