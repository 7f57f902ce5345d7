"""The cluster's HTTP ingress: relays each request to a replica and answers what only the cluster knows.

Ray Serve's proxy hands every HTTP request to this ASGI app (the `Ingress` deployment, no model,
no CPU reserved). It reads the body, sends the request through a DeploymentHandle to the replica
deployment and writes back the ASGI messages the replica's app sends, unchanged. Ray's router
picks a replica with a free slot (max_ongoing_requests = the replica's max_batch) and holds at
most `max_queue` requests for the whole deployment (max_queued_requests, one ingress replica).

Answers of its own (OpenAI's error JSON, as the single-machine server writes them):
    the queue is full                       429 queue_full, Retry-After: 1
    the replica died before it answered     503 replica_failed (Retry-After: 1)
    the replica died mid-stream (SSE)       an error event, then data: [DONE]
    the replica died mid-JSON-body          the connection is aborted (never a short 200 body)
    the client left                         the replica's generator is cancelled: its job stops
A response is never ended cleanly unless the replica's app ended it.
"""

from __future__ import annotations

import asyncio
import logging

from ..server.app import _send_json
from ..server.errors import RATE_LIMIT, SERVER, UNAVAILABLE, ApiError
from ..server.responses import DONE, sse

log = logging.getLogger("specexport.cluster")


def queue_full(queue: int) -> ApiError:
    return ApiError(
        429,
        f"the cluster is busy: {queue} requests are waiting for a replica slot (--max-queue {queue}); retry later",
        RATE_LIMIT,
        None,
        "queue_full",
        {"Retry-After": "1"},
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


def classify(exc: BaseException, queue: int) -> ApiError:
    """The client's error for an exception of the replica call."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError

    if isinstance(exc, BackPressureError):
        return queue_full(queue)
    if isinstance(exc, (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)):
        return replica_failed(type(exc).__name__)
    log.error("replica call failed", exc_info=exc)
    return ApiError(500, f"internal server error: {type(exc).__name__}", SERVER, None, "internal_error")


class Relay:
    """ASGI app: HTTP request -> replica.http(request) stream -> ASGI messages to the client."""

    def __init__(self, handle, queue: int, max_body_bytes: int):
        self.handle = handle.options(stream=True)  # a DeploymentHandle of the replica deployment
        self.queue, self.max_body_bytes = queue, max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
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
        response = self.handle.http.remote(request)
        relay = asyncio.ensure_future(self._relay(response, send))
        watch = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait((relay, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not relay.done():  # the client left: the replica's generator is cancelled, its job stops
                response.cancel()
                relay.cancel()
            watch.cancel()
            await asyncio.gather(relay, watch, return_exceptions=True)
        if not relay.cancelled() and relay.exception() is not None:  # the server aborts the connection
            raise relay.exception()

    async def _relay(self, response, send) -> None:
        started = stream = ended = False
        try:
            async for batch in response:  # the replica's messages, in batches (replica.SpecReplica.http)
                for message in batch:
                    if message["type"] == "http.response.start":
                        started = True
                        stream = any(
                            k == b"content-type" and v.startswith(b"text/event-stream") for k, v in message["headers"]
                        )
                    elif message["type"] == "http.response.body":
                        ended = not message.get("more_body", False)
                    await send(message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the replica call failed: the client is told, never left with a clean short answer
            if ended:
                return
            error = classify(exc, self.queue)
            if not started:
                await _send_json(send, error.status, error.body(), error.headers)
            elif stream:
                log.warning("replica failed mid-stream: %s", exc)
                await send({"type": "http.response.body", "body": sse(error.body()) + DONE, "more_body": False})
            else:
                raise  # a JSON body already begun: the server aborts the connection
            return
        if not ended:  # the replica's stream ended without the response's last message
            if not started:
                error = replica_failed("it answered nothing")
                await _send_json(send, error.status, error.body(), error.headers)
            elif stream:
                error = replica_failed("its stream ended early")
                await send({"type": "http.response.body", "body": sse(error.body()) + DONE, "more_body": False})
            else:
                raise RuntimeError("the replica's response ended without its last body message")


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
