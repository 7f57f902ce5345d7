"""One Ray Serve replica: loads and verifies the artifact itself, and runs the single-machine app.

A replica is a Ray actor process. It opens the artifact at a path on its own machine (a folder,
or a `.spx` package that it unpacks into a private temporary folder), with the trust checks of
`load` / `unpack`: the signature against the operator's trusted keys when they are given, the
checksums always unless `verify` is off (and always with keys). Nothing is shipped between
machines but the path and the keys' public PEM bytes, so an unverified artifact never runs.

Each replica runs `server.app.create_app` (the same routes, errors, `speculative` objects and
metrics as `specexport serve`) in-process: `http(request)` feeds one HTTP request into that ASGI
app and yields the messages the app sends, each `http.response.start` tagged with the header
`x-specexport-replica: <replica id>`; after a response that ended, one more message
`{"type": LOG_MESSAGE, "fields": ...}` carries its `request` log line's fields (server/logs.py)
to the front, which logs it (ingress.py). What generation state learns across requests (the suffix
store, the gamma controllers, the measured call costs) stays in the replica.

This module does not import ray at import time; deployment.py wraps SpecReplica in
`serve.deployment`.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import socket
import tempfile
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path

from ..errors import SpecExportError
from .config import SHUTDOWN_SLACK, ClusterConfig, LoadOptions

log = logging.getLogger("specexport.cluster")
REPLICA_HEADER = b"x-specexport-replica"
REFUSED = "specexport replica refused the artifact"  # the marker of the one-line deployment error
LOG_MESSAGE = "specexport.log"  # the message after a response: {"type", "fields": its request line's fields}
_END = object()


class RequestLines(logging.Handler):
    """Keeps the fields of the server's `request` log lines by request id (the newest `keep`),
    for http() to hand to the front."""

    def __init__(self, keep: int = 1024):
        super().__init__(logging.INFO)
        self.keep, self.lines = keep, OrderedDict()

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", None)
        if record.msg == "request" and fields and "id" in fields:
            self.lines[fields["id"]] = fields
            while len(self.lines) > self.keep:
                self.lines.popitem(last=False)

    def take(self, request_id: str | None) -> dict | None:
        """The line of `request_id`, removed (emit runs on the worker's thread, under self.lock)."""
        with self.lock:
            return None if request_id is None else self.lines.pop(request_id, None)


def request_lines() -> RequestLines:
    """This process's RequestLines on the server's logger (installed once; the logger at INFO)."""
    from ..server.logs import log as server_log

    for handler in server_log.handlers:
        if isinstance(handler, RequestLines):
            return handler
    handler = RequestLines()
    server_log.addHandler(handler)
    if server_log.getEffectiveLevel() > logging.INFO:
        server_log.setLevel(logging.INFO)
    return handler


class ReplicaRefused(SpecExportError):
    """A replica could not open the artifact (bad signature, checksum, manifest, ...)."""


def open_generator(artifact: str, load: LoadOptions, batch: bool, scratch: Path):
    """The SpecGenerator of `artifact` (a folder, or a .spx unpacked under `scratch`), verified."""
    from ..api import load as load_artifact
    from ..package import SUFFIX, unpack
    from ..suffix import SuffixConfig

    path = Path(artifact)
    if path.suffix == SUFFIX and path.is_file():
        path = unpack(path, scratch / "artifact", trusted_keys=load.trusted_keys, keep=0)
    suffix = SuffixConfig.fixed_limit(load.suffix_factor, load.suffix_max_spec)
    config = {} if suffix is None else {"suffix": suffix}
    if load.prefix_cache_bytes is not None:
        config["prefix_cache_bytes"] = load.prefix_cache_bytes
    return load_artifact(
        path,
        provider=load.provider,
        threads=load.threads,
        verify=load.verify,
        shared_pool=load.shared_pool,
        trusted_keys=load.trusted_keys,
        config=config,
        batch=batch,
        backend=load.backend,
    )


def _replica_id() -> str:
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        return serve.get_replica_context().replica_id.unique_id
    except (RuntimeError, RayServeException):  # outside a Serve replica (tests calling the class directly)
        return f"local-{socket.gethostname()}"


class SpecReplica:
    """The replica deployment's class (Ray Serve calls `__init__` once per replica actor)."""

    async def __init__(self, artifact: str, config: ClusterConfig):
        from ..server.app import create_app

        self.id = _replica_id()
        self.scratch = Path(tempfile.mkdtemp(prefix="specexport-replica-"))
        try:
            gen = open_generator(artifact, config.load, config.server.max_batch > 1, self.scratch)
            self.app = create_app(gen, config.replica_server)
        except SpecExportError as exc:
            shutil.rmtree(self.scratch, ignore_errors=True)
            one_line = " ".join(str(exc).split())
            raise ReplicaRefused(f"{REFUSED} (replica {self.id} on {socket.gethostname()}): {one_line}") from None
        self.state = self.app.state.server
        self._lifespan = self.app.router.lifespan_context(self.app)  # starts the worker thread
        await self._lifespan.__aenter__()
        self._header = (REPLICA_HEADER, self.id.encode())
        self.lines = request_lines()

    async def http(self, request: dict) -> AsyncIterator[list[dict]]:
        """Run one HTTP request through the app; yields its ASGI send messages in order, in batches
        (each batch: the messages the app sent since the previous one).

        request: {"method", "path", "query_string": bytes, "headers": [(bytes, bytes)], "body": bytes,
        "client": (host, port) | None, "scheme"}. Closing the generator (Ray cancels it when the
        caller's client leaves) is the client's disconnect: a queued job never runs, a running one
        stops after its round."""
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": request["method"],
            "scheme": request.get("scheme", "http"),
            "path": request["path"],
            "raw_path": request["path"].encode(),
            "query_string": request.get("query_string", b""),
            "root_path": "",
            "headers": list(request["headers"]),
            "client": request.get("client"),
            "server": None,
            "state": {},
        }
        outbox: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body = [{"type": "http.request", "body": request.get("body", b""), "more_body": False}]

        async def receive() -> dict:
            if body:
                return body.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        request_id: list[str] = []  # the response's x-request-id, when it has one

        async def send(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = message.get("headers", [])
                request_id.extend(v.decode("latin-1") for k, v in headers if k == b"x-request-id")
                message = {**message, "headers": [*headers, self._header]}
            outbox.put_nowait(message)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: outbox.put_nowait(_END))
        complete = ended = False
        try:
            while not ended:  # one batch: what the app sent since the last one (fewer Ray objects under load)
                batch = [await outbox.get()]
                while not outbox.empty():
                    batch.append(outbox.get_nowait())
                ended = batch[-1] is _END
                batch = [m for m in batch if m is not _END]
                for message in batch:
                    complete = message["type"] == "http.response.body" and not message.get("more_body", False)
                if batch:
                    yield batch
        finally:
            gone.set()
            done, _ = await asyncio.wait({task}, timeout=self.state.config.drain_seconds + SHUTDOWN_SLACK)
            if not done:
                task.cancel()
        error = None if task.cancelled() else task.exception()
        if error is not None:  # the app answered 500 already (Starlette's error middleware)
            log.error("replica %s: error on %s %s", self.id, request["method"], request["path"], exc_info=error)
        if not complete:
            raise RuntimeError(f"replica {self.id}: the app ended {request['path']} without completing its response")
        fields = self.lines.take(request_id[0] if request_id else None)
        if fields is not None:
            yield [{"type": LOG_MESSAGE, "fields": fields}]

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose generating thread died is restarted."""
        if not self.state.worker.alive:
            raise RuntimeError(f"replica {self.id}: the worker thread is not running")

    def __del__(self) -> None:
        """Ray Serve's graceful shutdown (after the replica's requests ended): stop the worker."""
        state = getattr(self, "state", None)
        if state is not None:
            state.worker.stop(5.0)
        scratch = getattr(self, "scratch", None)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
