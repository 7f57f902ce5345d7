"""The cluster's front behaves as the single server does (server/cors.py, backpressure.py, logs.py),
without a Ray cluster: CORS is answered by the front (a preflight before the API key check, the
front's own errors readable by the page, replicas without a second Allow-Origin); a 429's
Retry-After is within 2x of the measured drain of a simulated cluster queue; each finished
request is logged by the front with the fields its replica reported (the replica's side runs a
tiny artifact)."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import pytest

pytest.importorskip("ray.serve")

from ray.serve.exceptions import BackPressureError  # noqa: E402
from test_cluster_units import JSON, OK, Client, FakeHandle, http_scope, status_and_body  # noqa: E402

from specexport_runtime.cluster.config import ClusterConfig, LoadOptions  # noqa: E402
from specexport_runtime.cluster.ingress import Relay, front_app  # noqa: E402
from specexport_runtime.cluster.replica import LOG_MESSAGE, REPLICA_HEADER, SpecReplica  # noqa: E402
from specexport_runtime.server.config import ServerConfig  # noqa: E402
from specexport_runtime.server.cors import LOCAL_ORIGINS, parse_origins  # noqa: E402
from specexport_runtime.server.logs import LOGGER  # noqa: E402

PAGE = "http://localhost:5173"


def run(app, method="POST", path="/v1/completions", headers=(), body=b'{"x": 1}') -> list[dict]:
    client = Client(body)
    asyncio.run(app(http_scope(method, path, headers), client.receive, client.send))
    return client.sent


def preflight(origin: str) -> tuple:
    return ((b"origin", origin.encode()), (b"access-control-request-method", b"POST"))


def test_the_front_answers_cors_before_the_key_check_and_replicas_add_none():
    handle = FakeHandle(OK)
    app = front_app(Relay(handle, queue=5, max_body_bytes=1024, api_key="k"), parse_origins("http://localhost:*"))
    status, headers, _ = status_and_body(run(app, "OPTIONS", headers=preflight(PAGE)))
    assert status == 204 and headers[b"access-control-allow-origin"] == PAGE.encode()  # a browser sends no key here
    status, headers, _ = status_and_body(run(app, "OPTIONS", headers=preflight("https://site.example")))
    assert status == 403 and b"access-control-allow-origin" not in headers
    assert handle.requests == []  # neither preflight reached a replica
    sent = run(app, headers=((b"origin", PAGE.encode()),))  # no key: the front's own 401, readable by the page
    status, headers, body = status_and_body(sent)
    assert status == 401 and headers[b"access-control-allow-origin"] == PAGE.encode()
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    sent = run(app, headers=((b"origin", PAGE.encode()), (b"authorization", b"Bearer k")))
    start = sent[0]
    assert start["status"] == 200 and [k for k, _ in start["headers"]].count(b"access-control-allow-origin") == 1
    config = ClusterConfig(server=ServerConfig())
    assert config.server.cors_origins == LOCAL_ORIGINS and config.replica_server.cors_origins == ()


class SimulatedCluster:
    """A DeploymentHandle over `replicas` x `slots` slots where a request runs `seconds`; Ray's
    router holds at most `queue` waiting requests and refuses more with BackPressureError."""

    def __init__(self, replicas: int, slots: int, queue: int, seconds: float):
        self.total, self.queue, self.seconds = replicas * slots, queue, seconds
        self.running = self.waiting = 0
        self.free: asyncio.Condition | None = None

    def options(self, **_):
        return self

    @property
    def http(self):
        return self

    def remote(self, request):
        return SimulatedResponse(self)


class SimulatedResponse:
    def __init__(self, cluster: SimulatedCluster):
        self.cluster = cluster

    def cancel(self):
        pass

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        c = self.cluster
        c.free = c.free or asyncio.Condition()
        if c.running >= c.total and c.waiting >= c.queue:
            raise BackPressureError(num_queued_requests=c.waiting, max_queued_requests=c.queue)
        async with c.free:
            c.waiting += 1
            await c.free.wait_for(lambda: c.running < c.total)
            c.waiting -= 1
            c.running += 1
        await asyncio.sleep(c.seconds)
        async with c.free:
            c.running -= 1
            c.free.notify()
        yield OK


def test_retry_after_is_within_2x_of_the_measured_drain_of_the_cluster_queue():
    """2 replicas x 2 slots, 0.4 s a request, a queue of 12. Warm-up: one request per slot sets T.
    Then 4 + 12 requests fill the slots and the queue, and 4 more get 429: the time from each 429
    until the queue is empty is within a factor 2 of its retry-after-ms (the front used to say
    Retry-After: 1 whatever the queue, with no retry-after-ms)."""
    replicas, slots, queue, seconds = 2, 2, 12, 0.4
    cluster = SimulatedCluster(replicas, slots, queue, seconds)

    async def count():
        return replicas

    relay = Relay(cluster, queue=queue, max_body_bytes=1024, replicas=count, slots=slots)

    async def one(rejected: list) -> None:
        client = Client()
        await relay(http_scope(), client.receive, client.send)
        status, headers, _ = status_and_body(client.sent)
        if status == 429:
            rejected.append((time.monotonic(), int(headers[b"retry-after-ms"]) / 1000))

    async def scenario():
        warm: list = []
        await asyncio.gather(*(one(warm) for _ in range(replicas * slots)))
        assert warm == []
        rejected: list = []
        tasks = [asyncio.ensure_future(one(rejected)) for _ in range(replicas * slots + queue)]
        while cluster.running + cluster.waiting < replicas * slots + queue:
            await asyncio.sleep(0.001)
        late = [asyncio.ensure_future(one(rejected)) for _ in range(4)]
        while cluster.waiting:
            await asyncio.sleep(0.005)
        drained = time.monotonic()
        await asyncio.gather(*tasks, *late)
        return rejected, drained

    rejected, drained = asyncio.run(scenario())
    assert len(rejected) == 4
    print("\n[cluster retry-after] " + ", ".join(f"{w:.2f} s vs drain {drained - at:.2f} s" for at, w in rejected))
    for at, wait in rejected:
        measured = drained - at
        assert 0.5 <= wait / measured <= 2.0, f"Retry-After {wait:.3f} s, queue drained in {measured:.3f} s"


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def lines():
    logger = logging.getLogger(LOGGER)
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.records
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_the_front_logs_the_request_line_its_replica_sent_after_the_answer(lines):
    start = {"type": "http.response.start", "status": 200, "headers": [*JSON, (REPLICA_HEADER, b"r1")]}
    end = {"type": "http.response.body", "body": b'{"ok": true}', "more_body": False}
    fields = {"id": "ab12", "new_tokens": 7, "acceptance": 0.5}
    handle = FakeHandle([start, end, {"type": LOG_MESSAGE, "fields": fields}], batch=2)
    relay = Relay(handle, queue=5, max_body_bytes=1024)
    client = Client()

    async def scenario():
        await relay(http_scope(), client.receive, client.send)
        while relay._tails:
            await asyncio.sleep(0.001)

    asyncio.run(scenario())
    assert client.sent == [start, end]  # the log message never reaches the client
    [record] = [r for r in lines if r.getMessage() == "request"]
    assert record.fields == {**fields, "replica": "r1"}


def test_a_replica_sends_its_request_line_after_the_response(tiny_artifacts, lines):
    config = ClusterConfig(server=ServerConfig(max_queue=2), load=LoadOptions(threads=1))
    body = json.dumps({"prompt": "hello hello", "max_tokens": 5, "temperature": 0}).encode()
    request = {"method": "POST", "path": "/v1/completions", "headers": JSON, "body": body}

    async def scenario():
        replica = object.__new__(SpecReplica)
        await SpecReplica.__init__(replica, str(tiny_artifacts["noisy"]), config)
        try:
            return [message async for batch in replica.http(request) for message in batch]
        finally:
            replica.state.worker.stop(5.0)
            replica.__del__()

    messages = asyncio.run(scenario())
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body", LOG_MESSAGE]
    request_id = dict(messages[0]["headers"])[b"x-request-id"].decode()
    usage = json.loads(messages[1]["body"])["usage"]
    fields = messages[2]["fields"]
    assert fields["id"] == request_id and fields["new_tokens"] == usage["completion_tokens"] == 5
    assert fields["prompt_tokens"] == usage["prompt_tokens"]
