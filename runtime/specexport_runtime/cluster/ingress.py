"""The cluster's HTTP ingress: relays each request to a replica and answers what only the cluster knows.

`serve --replicas` runs this ASGI app under uvicorn in its own process (front.py); a Ray Serve
application composed by hand (deployment.deployment) runs it as the `Ingress` deployment behind
Ray's HTTP proxy. It reads the body, sends the request through a DeploymentHandle to the replica
deployment and writes back the ASGI messages the replica's app sends, unchanged. Ray's router
sends it to the less loaded of two replicas with room (max_ongoing_requests = the replica's
max_batch + replica_queue) and holds at most `max_queue` requests for the deployment
(max_queued_requests, counted by this ingress's router: one ingress replica).

Answers of its own (OpenAI's error JSON, as the single-machine server writes them):
    GET /health                             200 {"status": "ok", "replicas_running": n}, or 503
                                            "unavailable" when none runs and min replicas > 0
                                            (never queued behind generation)
    no or a wrong API key (when one is set) 401 invalid_api_key, before the request takes a slot
    the queue is full                       429 queue_full, Retry-After / retry-after-ms: the
                                            expected drain (server/backpressure.py; below)
    the replica died before it answered     503 replica_failed (Retry-After: 1)
    the replica died mid-stream (SSE)       an error event, then data: [DONE]
    the replica died mid-JSON-body          the connection is aborted (never a short 200 body)
    the client left                         the replica's generator is cancelled: its job stops
    draining (begin_drain)                  new requests 503 shutting_down, /health 503 "draining"
    cut (close: the drain's deadline)       what still runs ends as a dead replica's would, with
                                            503 / an error event shutting_down
A response is never ended cleanly unless the replica's app ended it.

Retry-After counts the requests this ingress has in flight (running on a replica, waiting at
one, or queued by Ray's router; at most what the replicas and the queue hold, so concurrent
refused ones do not count) against S = running replicas x slots per replica: with n in
flight, min(n, S) run and the rest wait, and T is the running mean of a request's time from
hand-off to its last message, taken from requests handed off while a slot was free (so T holds
no queueing). The expected wait is backpressure.expected_wait(T, waiting, S, running).

Logs: after a response ended, the replica's generator yields one more message, LOG_MESSAGE with
the fields of its `request` log line (replica.py); the relay reads it after the client has its
answer (never holding the response) and logs it on the server's logger (server/logs.py) with
the replica's id. CORS is the front's (front_app): replicas run without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from starlette.datastructures import Headers

from ..server import logs
from ..server.app import _send_json
from ..server.backpressure import DEFAULT_SECONDS, expected_wait, retry_headers, update_mean
from ..server.cors import CorsMiddleware
from ..server.errors import RATE_LIMIT, SERVER, UNAVAILABLE, ApiError, check_api_key
from ..server.responses import DONE, sse
from ..server.worker import shutting_down
from .replica import LOG_MESSAGE, REPLICA_HEADER

log = logging.getLogger("specexport.cluster")
TAIL_SECONDS = 10.0  # how long the relay waits, after a response ended, for the replica's log message


def front_app(relay: Relay, cors_origins) -> CorsMiddleware:
    """The ASGI app the cluster serves: `relay` behind the server's CORS rules (server/cors.py), so
    a preflight is answered before the API key check and the relay's own answers carry the headers."""
    return CorsMiddleware(relay, cors_origins)


def queue_full(queue: int, wait: float = DEFAULT_SECONDS) -> ApiError:
    return ApiError(
        429,
        f"the cluster is busy: {queue} requests are waiting for a replica slot (--max-queue {queue}); retry later",
        RATE_LIMIT,
        None,
        "queue_full",
        retry_headers(wait),
    )


def replica_failed(detail: str) -> ApiError:
    return ApiError(
        503,
        f"the replica serving this request failed ({detail}); retry: the cluster routes new requests to live"
        " replicas and restarts the failed one",
        UNAVAILABLE,
        None,
        "replica_failed",
        {"Retry-After": "1"},
    )


def classify(exc: BaseException, queue: int, wait: float = DEFAULT_SECONDS) -> ApiError:
    """The client's error for an exception of the replica call; `wait`: the 429's expected wait."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

    if isinstance(exc, BackPressureError):
        return queue_full(queue, wait)
    if isinstance(exc, (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)):
        return replica_failed(type(exc).__name__)
    log.error("replica call failed", exc_info=exc)
    return ApiError(500, f"internal server error: {type(exc).__name__}", SERVER, None, "internal_error")


HEALTH_CACHE_SECONDS = 1.0  # /health asks Ray for the replica count at most this often


class Relay:
    """ASGI app: HTTP request -> replica.http(request) stream -> ASGI messages to the client.

    replicas: returns how many replicas run (asked for /health and a 429's Retry-After, cached
    HEALTH_CACHE_SECONDS); min_replicas: below 1 (scale to zero), no running replica is still
    healthy; slots: requests one replica runs at once, replica_queue: requests that may wait at one."""

    def __init__(
        self,
        handle,
        queue: int,
        max_body_bytes: int,
        api_key: str | None = None,
        replicas: Callable[[], Awaitable[int]] | None = None,
        min_replicas: int = 1,
        slots: int = 1,
        replica_queue: int = 0,
    ):
        # a DeploymentHandle of the replica deployment; by value: over the replicas' gRPC servers,
        # not Ray actor calls (a shorter hop: docs/serving.md)
        self.handle = handle.options(stream=True, _by_reference=False)
        self.queue, self.max_body_bytes = queue, max_body_bytes
        self.key = api_key.encode() if api_key is not None else None
        self.replicas, self.min_replicas = replicas, min_replicas
        self._count: tuple[float, int] | None = None  # (monotonic time, running replicas) last asked
        self.draining = False
        self._cut: asyncio.Event | None = None  # set by close(); made in the serving loop
        self.slots, self.replica_queue = slots, replica_queue
        self.in_flight = 0  # requests handed to the replica deployment and not yet ended
        self._mean_seconds: float | None = None  # T of the module docstring
        self._tails: set[asyncio.Task] = set()  # readers of the replicas' log messages

    def begin_drain(self) -> None:
        """From now on new requests get 503 shutting_down; the running ones go on."""
        self.draining = True

    async def close(self) -> None:
        """Cut every request still running: each ends with 503 / an error event (shutting_down),
        never as a clean short answer; its replica generator is cancelled. Run in the serving loop."""
        self.draining = True
        self._cut_event().set()

    def _cut_event(self) -> asyncio.Event:
        if self._cut is None:
            self._cut = asyncio.Event()
        return self._cut

    async def running_replicas(self) -> int | None:
        """Running replicas as last asked (at most HEALTH_CACHE_SECONDS old); None: unknown."""
        now = time.monotonic()
        if self.replicas is not None and (self._count is None or now - self._count[0] > HEALTH_CACHE_SECONDS):
            self._count = (now, await self.replicas())
        return None if self._count is None else self._count[1]

    async def expected_wait(self, ahead: int) -> float:
        """Seconds until a new request would find a slot, with `ahead` requests in flight before it."""
        await self.running_replicas()
        total = self._all_slots()
        ahead = min(ahead, total // self.slots * (self.slots + self.replica_queue) + self.queue)  # not the refused
        running = min(ahead, total)
        mean = DEFAULT_SECONDS if self._mean_seconds is None else self._mean_seconds
        return expected_wait(mean, ahead - running, total, running)

    def _all_slots(self) -> int:
        """Slots of the running replicas as last asked (min_replicas, at least 1, when unknown or none)."""
        replicas = self._count[1] if self._count is not None and self._count[1] else max(1, self.min_replicas)
        return replicas * self.slots

    async def health(self, send) -> None:
        running = await self.running_replicas()
        ok = running is None or running > 0 or self.min_replicas < 1
        status = "draining" if self.draining else "ok" if ok else "unavailable"
        body = {"status": status, "replicas_running": running}
        await _send_json(send, 200 if status == "ok" else 503, body, {})

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        if scope["path"] == "/health" and scope["method"] == "GET":
            await self.health(send)
            return
        try:  # every other route of the app asks for the key: refused here, before it takes a slot
            check_api_key(self.key, Headers(scope=scope).get("authorization"))
            if self.draining:
                raise shutting_down()
        except ApiError as error:
            await _send_json(send, error.status, error.body(), error.headers)
            return
        body, more = bytearray(), True
        while more and len(body) <= self.max_body_bytes:  # the replica answers 413 past the limit
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
        request = {
            "method": scope["method"],
            "path": scope["path"],
            "query_string": scope.get("query_string", b""),
            "headers": list(scope.get("headers", [])),
            "body": bytes(body),
            "client": scope.get("client"),
            "scheme": scope.get("scheme", "http"),
        }
        ahead, handed = self.in_flight, time.monotonic()
        self.in_flight += 1
        progress = Progress(ahead)
        try:
            await self._forward(request, send, receive, progress)
        finally:
            self.in_flight -= 1
        if progress.answered and scope["method"] == "POST" and ahead < self._all_slots():  # a free slot: its time is T
            self._mean_seconds = update_mean(self._mean_seconds, time.monotonic() - handed)

    async def _forward(self, request: dict, send, receive, progress: Progress) -> None:
        response = self.handle.http.remote(request)
        relay = asyncio.ensure_future(self._relay(response, send, progress))
        watch = asyncio.ensure_future(_disconnected(receive))
        cut = asyncio.ensure_future(self._cut_event().wait())
        left = False  # the client disconnected
        try:
            await asyncio.wait((relay, watch, cut), return_when=asyncio.FIRST_COMPLETED)
            left = watch.done()
        finally:
            if not relay.done():  # the client left or the front stops: the replica's generator is cancelled
                response.cancel()
                relay.cancel()
            watch.cancel()
            cut.cancel()
            await asyncio.gather(relay, watch, cut, return_exceptions=True)
        if relay.cancelled():
            if self._cut_event().is_set() and not left:  # cut: the client is still there, and told
                await self._fail(send, progress, shutting_down())
        elif relay.exception() is not None:  # the server aborts the connection
            raise relay.exception()

    async def _relay(self, response, send, progress: Progress) -> None:
        batches = response.__aiter__()
        try:
            async for batch in batches:  # the replica's messages, in batches (replica.SpecReplica.http)
                for message in batch:
                    if message["type"] == LOG_MESSAGE:
                        continue
                    progress.see(message)
                    await send(message)
                if progress.ended:  # the response is whole: the generator's own end is not awaited (the
                    tail = asyncio.ensure_future(_log_tail(batches, progress.replica))  # client may close
                    self._tails.add(tail)  # at once, which must not read as leaving mid-answer)
                    tail.add_done_callback(self._tails.discard)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the replica call failed: the client is told, never left with a clean short answer
            if progress.ended:
                return
            if progress.stream and progress.started:
                log.warning("replica failed mid-stream: %s", exc)
            wait = await self.expected_wait(progress.ahead)
            await self._fail(send, progress, classify(exc, self.queue, wait), exc)
            return
        if not progress.started:
            await self._fail(send, progress, replica_failed("it answered nothing"))
        elif not progress.ended:
            await self._fail(send, progress, replica_failed("its stream ended early"))

    @staticmethod
    async def _fail(send, progress: Progress, error: ApiError, cause: BaseException | None = None) -> None:
        """End a response the replica did not end: `error` as the status when nothing was sent, an
        error event and [DONE] on a stream; a JSON body already begun is aborted (raises)."""
        if progress.ended:
            return
        progress.failed = True
        if not progress.started:
            await _send_json(send, error.status, error.body(), error.headers)
        elif progress.stream:
            await send({"type": "http.response.body", "body": sse(error.body()) + DONE, "more_body": False})
        elif cause is not None:
            raise cause
        else:
            raise RuntimeError(f"the replica's JSON response was cut: {error.message}")
        progress.ended = True


class Progress:
    """What of one response went to the client: its start (and whether it is an SSE stream, which
    replica sent it, its status), its end, whether the relay failed it; `ahead`: requests in
    flight when it was handed off."""

    def __init__(self, ahead: int = 0) -> None:
        self.started = self.stream = self.ended = self.failed = False
        self.replica: str | None = None
        self.status = 0
        self.ahead = ahead

    @property
    def answered(self) -> bool:
        """The replica ended a successful response."""
        return self.ended and not self.failed and 200 <= self.status < 300

    def see(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.started, self.status = True, message.get("status", 0)
            headers = message.get("headers", [])
            self.stream = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
            self.replica = next((v.decode("latin-1") for k, v in headers if k == REPLICA_HEADER), "")
        elif message["type"] == "http.response.body":
            self.ended = not message.get("more_body", False)


async def _log_tail(batches, replica: str | None) -> None:
    """Read what a replica sends after its response (at most TAIL_SECONDS): its request line,
    logged here with the replica's id."""

    async def read() -> None:
        async for batch in batches:
            for message in batch:
                if message["type"] == LOG_MESSAGE:
                    logs.log.info("request", extra={"fields": {**message["fields"], "replica": replica}})

    try:
        await asyncio.wait_for(read(), TAIL_SECONDS)
    except Exception:  # the replica's generator failed or was slow after its answer: no line, nothing else lost
        log.debug("no request line from replica %s", replica, exc_info=True)


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
