"""The cluster's pieces without a Ray cluster: settings and their errors, the Ray Serve options they
become, the one-line deployment error, and the ingress relay's answers when a replica call fails
(a fake DeploymentHandle raising Ray's own exceptions at chosen points of a response)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")

from ray.exceptions import ActorDiedError  # noqa: E402
from ray.serve.exceptions import BackPressureError  # noqa: E402

from specexport_runtime.cli import main as runtime_main  # noqa: E402
from specexport_runtime.cluster.config import ClusterConfig, parse_autoscale  # noqa: E402
from specexport_runtime.cluster.deployment import refusal  # noqa: E402
from specexport_runtime.cluster.ingress import Relay  # noqa: E402
from specexport_runtime.cluster.replica import REFUSED  # noqa: E402
from specexport_runtime.errors import InvalidArgument  # noqa: E402
from specexport_runtime.server.config import ServerConfig  # noqa: E402

SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
JSON = [(b"content-type", b"application/json")]


def test_fixed_and_autoscaled_configs_become_ray_serve_options():
    fixed = ClusterConfig(server=ServerConfig(max_queue=7, max_batch=3), replicas=2).ray_options()
    # a replica holds its 3 slots + 1 waiting request (the default replica_queue)
    assert (fixed["num_replicas"], fixed["max_ongoing_requests"], fixed["max_queued_requests"]) == (2, 4, 7)
    strict = ClusterConfig(server=ServerConfig(max_batch=3), replica_queue=0).ray_options()
    assert strict["max_ongoing_requests"] == 3  # only replicas with a free slot get requests
    assert "autoscaling_config" not in fixed
    auto = ClusterConfig(replicas=None, autoscale=(0, 4), target_ongoing=2.5, upscale_delay=1, downscale_delay=9)
    scaling = auto.ray_options()["autoscaling_config"]
    assert scaling == {
        "min_replicas": 0,
        "max_replicas": 4,
        "initial_replicas": 1,
        "target_ongoing_requests": 2.5,
        "upscale_delay_s": 1,
        "downscale_delay_s": 9,
    }
    assert "num_replicas" not in auto.ray_options()
    # each replica's app queues its replica_queue plus one batch of headroom; the cluster's queue is max_queue
    assert ClusterConfig(server=ServerConfig(max_queue=9, max_batch=4)).replica_server.max_queue == 5


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(replicas=0), "replicas must be an integer in 1..1024, got 0"),
        (dict(replicas=2, autoscale=(1, 2)), "exactly one of replicas"),
        (dict(replicas=None, autoscale=(3, 2)), "autoscale min 3 is larger than max 2"),
        (dict(replicas=None, autoscale=(0, 0)), "autoscale must be (min, max)"),
        (dict(server=ServerConfig(max_queue=0)), "max_queue must be >= 1 on a cluster"),
        (dict(target_ongoing=0), "target_ongoing must be a number in (0, 10000], got 0"),
        (dict(health_check_period=0), "health_check_period must be > 0 seconds"),
        (dict(ray_address=" "), "ray_address must be"),
        (dict(replica_queue=-1), "replica_queue must be an integer in 0..64, got -1"),
    ],
)
def test_bad_settings_are_one_typed_line(kwargs, fragment):
    with pytest.raises(InvalidArgument) as err:
        ClusterConfig(**kwargs)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_autoscale_parsing():
    assert parse_autoscale("1:4") == (1, 4)
    for bad in ("4", "1-4", "a:b", ":3", "1:"):
        with pytest.raises(InvalidArgument, match="--autoscale expects MIN:MAX"):
            parse_autoscale(bad)


def test_cli_refuses_ray_address_without_replicas_and_bad_autoscale(tmp_path, capsys):
    assert runtime_main(["serve", str(tmp_path), "--ray-address", "auto"]) == 2
    assert "--ray-address needs --replicas N or --autoscale MIN:MAX" in capsys.readouterr().err
    assert runtime_main(["serve", str(tmp_path), "--autoscale", "2"]) == 2
    assert "--autoscale expects MIN:MAX replicas (e.g. 1:4), got '2'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: the two are exclusive
        runtime_main(["serve", str(tmp_path), "--replicas", "2", "--autoscale", "1:2"])


def test_refusal_finds_the_replicas_line_in_a_deployment_error():
    text = (
        "Deploying application failed:\nTraceback (most recent call last):\n  ...\n"
        f"ReplicaRefused: {REFUSED} (replica ab12 on node-1): checksum mismatch for tokenizer.json\n"
    )
    assert refusal(text) == f"{REFUSED} (replica ab12 on node-1): checksum mismatch for tokenizer.json"
    assert refusal("something else") is None


# --- the ingress relay -----------------------------------------------------------------------------
class FakeResponse:
    """A DeploymentResponseGenerator: yields `messages` in batches of `batch`, then raises `error`."""

    def __init__(self, messages, error, batch: int):
        self.messages, self.error, self.batch, self.cancelled = messages, error, batch, False

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for i in range(0, len(self.messages), self.batch):  # the replica yields batches of messages
            await asyncio.sleep(0)
            yield self.messages[i : i + self.batch]
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    def __init__(self, messages, error=None, batch: int = 1):
        self.response = FakeResponse(messages, error, batch)
        self.requests = []

    def options(self, **_):
        return self

    @property
    def http(self):
        return self

    def remote(self, request):
        self.requests.append(request)
        return self.response


class Client:
    """One ASGI connection: the request's body once, then nothing (the client stays); .sent: what
    the app sent it."""

    def __init__(self, body: bytes = b'{"x": 1}'):
        self.sent: list[dict] = []
        self.incoming = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive(self) -> dict:
        if self.incoming:
            return self.incoming.pop()
        await asyncio.sleep(3600)

    async def send(self, message: dict) -> None:
        self.sent.append(message)


def http_scope(method: str = "POST", path: str = "/v1/completions", headers=()) -> dict:
    return {"type": "http", "method": method, "path": path, "query_string": b"", "headers": [*JSON, *headers]}


def relay_once(handle, body=b'{"x": 1}', relay=None, method="POST", path="/v1/completions", headers=()):
    """Run one request through a Relay; returns (the request the replica got or None, the messages
    sent back)."""
    client = Client(body)
    relay = relay or Relay(handle, queue=5, max_body_bytes=1024)
    asyncio.run(relay(http_scope(method, path, headers), client.receive, client.send))
    return (handle.requests[0] if handle.requests else None), client.sent


def status_and_body(sent):
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert sent[-1]["type"] == "http.response.body" and not sent[-1].get("more_body", False)
    return start["status"], dict(start["headers"]), body


@pytest.mark.parametrize("batch", [1, 2])
def test_relay_passes_a_replica_response_through_unchanged(batch):
    messages = [
        {"type": "http.response.start", "status": 200, "headers": JSON},
        {"type": "http.response.body", "body": b'{"ok": true}', "more_body": False},
    ]
    request, sent = relay_once(FakeHandle(messages, batch=batch))
    assert sent == messages
    assert (request["method"], request["path"], request["body"]) == ("POST", "/v1/completions", b'{"x": 1}')


def test_relay_answers_429_when_the_cluster_queue_is_full():
    _, sent = relay_once(FakeHandle([], BackPressureError(5, 5)))
    status, headers, body = status_and_body(sent)
    assert status == 429 and headers[b"retry-after"] == b"1"
    assert json.loads(body)["error"]["code"] == "queue_full"


def test_relay_answers_503_when_the_replica_died_before_answering():
    _, sent = relay_once(FakeHandle([], ActorDiedError()))
    status, _, body = status_and_body(sent)
    assert status == 503
    error = json.loads(body)["error"]
    assert (error["code"], error["type"]) == ("replica_failed", "service_unavailable_error")


@pytest.mark.parametrize("error", [ActorDiedError(), None], ids=["replica-died", "stream-ended-early"])
def test_relay_ends_a_broken_stream_with_an_error_event_never_a_clean_finish(error):
    chunk = b'data: {"choices": [{"text": "ab", "finish_reason": null}]}\n\n'
    messages = [
        {"type": "http.response.start", "status": 200, "headers": SSE},
        {"type": "http.response.body", "body": chunk, "more_body": True},
    ]
    _, sent = relay_once(FakeHandle(messages, error))
    status, _, body = status_and_body(sent)
    events = [e[len("data: ") :] for e in body.decode().split("\n\n") if e]
    assert status == 200 and events[0] == chunk.decode()[len("data: ") :].strip()
    assert json.loads(events[1])["error"]["code"] == "replica_failed" and events[2] == "[DONE]"


def test_relay_aborts_a_json_body_the_replica_left_half_sent():
    messages = [{"type": "http.response.start", "status": 200, "headers": JSON}]
    with pytest.raises(ActorDiedError):  # the server closes the connection: never a short 200 body
        relay_once(FakeHandle(messages, ActorDiedError()))


def test_relay_hands_an_oversized_body_to_the_replica_app_for_its_413():
    request, _ = relay_once(FakeHandle([], BackPressureError(1, 1)), body=b"x" * 5000)
    assert len(request["body"]) > 1024  # the replica's app answers 413, as the single server does


def test_cli_refuses_no_prepack_for_cluster_replicas(tmp_path, capsys):
    """--no-prepack is a one-process option: with --replicas it is refused in one line, not ignored."""
    assert runtime_main(["serve", str(tmp_path), "--replicas", "2", "--no-prepack"]) == 2
    assert "--no-prepack applies to one server process" in capsys.readouterr().err


OK = [
    {"type": "http.response.start", "status": 200, "headers": JSON},
    {"type": "http.response.body", "body": b'{"ok": true}', "more_body": False},
]


def test_relay_refuses_a_missing_or_wrong_key_itself_before_any_replica_call():
    for headers in ((), ((b"authorization", b"Bearer wrong"),), ((b"authorization", b"Basic s3cret"),)):
        handle = FakeHandle(OK)
        relay = Relay(handle, queue=5, max_body_bytes=1024, api_key="s3cret")
        request, sent = relay_once(handle, relay=relay, headers=headers)
        status, _, body = status_and_body(sent)
        assert request is None and status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    handle = FakeHandle(OK)
    relay = Relay(handle, queue=5, max_body_bytes=1024, api_key="s3cret")
    request, sent = relay_once(handle, relay=relay, headers=((b"authorization", b"Bearer s3cret"),))
    assert request is not None and sent == OK


@pytest.mark.parametrize("running, min_replicas, status", [(2, 1, 200), (0, 1, 503), (0, 0, 200)])
def test_relay_answers_health_itself_from_the_replica_count(running, min_replicas, status):
    asked = []

    async def replicas():
        asked.append(1)
        return running

    handle = FakeHandle(OK)
    relay = Relay(handle, queue=5, max_body_bytes=1024, api_key="k", replicas=replicas, min_replicas=min_replicas)
    for _ in range(2):  # no key needed; the count is cached between close probes
        request, sent = relay_once(handle, relay=relay, method="GET", path="/health")
        got, _, body = status_and_body(sent)
        assert request is None and got == status
        assert json.loads(body) == {"status": "ok" if status == 200 else "unavailable", "replicas_running": running}
    assert len(asked) == 1


def test_a_replica_stopped_by_ray_may_finish_its_requests():
    """Ray kills a replica it stops (downscaling, redeploy) after graceful_shutdown_timeout_s: that
    must outlast any request (the request timeout ends each one), so removing a replica cuts none."""
    config = ClusterConfig(server=ServerConfig(request_timeout=120, drain_seconds=10))
    assert config.ray_options()["graceful_shutdown_timeout_s"] >= 120 + 10


def test_serve_stops_after_the_drain_or_a_second_signal(monkeypatch):
    import threading
    import time

    from specexport_runtime.cluster import deployment as dep

    deleted = threading.Event()

    def slow_delete(name):
        deleted.wait(30)

    monkeypatch.setattr(dep.serve, "delete", slow_delete)
    config = ClusterConfig(server=ServerConfig(drain_seconds=20))
    signals = threading.Semaphore(0)
    threading.Timer(0.3, signals.release).start()  # the operator signals again
    start = time.monotonic()
    assert dep.drain(config, signals) is False  # still deleting: the caller shuts down what runs
    assert time.monotonic() - start < 5
    deleted.set()
    monkeypatch.setattr(dep.serve, "delete", lambda name: None)
    assert dep.drain(config, threading.Semaphore(0)) is True


def _cluster_config_of(argv, monkeypatch) -> ClusterConfig:
    from specexport_runtime.cluster import deployment as dep

    seen = []
    monkeypatch.setattr(dep, "serve_cluster", lambda artifact, config, **_: seen.append(config))
    assert runtime_main(argv) == 0
    return seen[0]


def test_cli_takes_max_batch_from_a_folder_or_a_package(tiny_artifacts, tmp_path, monkeypatch):
    from specexport_runtime.package import pack

    folder = tiny_artifacts["noisy-fused-batch8"]
    spx = pack(folder, tmp_path / "batch.spx")
    for artifact in (folder, spx):
        config = _cluster_config_of(["serve", str(artifact), "--replicas", "2"], monkeypatch)
        assert config.server.max_batch == 8, artifact
    config = _cluster_config_of(["serve", str(spx), "--replicas", "2", "--max-batch", "3"], monkeypatch)
    assert config.server.max_batch == 3


def test_cli_asks_for_max_batch_when_the_artifact_is_not_here(tmp_path, capsys):
    assert runtime_main(["serve", str(tmp_path / "elsewhere.spx"), "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert "is not on this machine: give --max-batch" in err and err.count("\n") == 1


def test_the_cluster_extra_names_the_server_packages_a_replica_needs(monkeypatch):
    import importlib.util

    from specexport_runtime.cluster import missing_cluster_extra

    assert missing_cluster_extra() is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    line = missing_cluster_extra()
    assert line == "a cluster needs the cluster extra (uvicorn not installed): pip install ./runtime[cluster]"


class HangingResponse(FakeResponse):
    """A stream that sends its start and one chunk, then waits for the replica's next round."""

    def __init__(self, messages):
        super().__init__(messages, None, len(messages))

    async def _gen(self):
        yield self.messages
        await asyncio.sleep(3600)


def test_a_draining_relay_refuses_new_requests_and_cuts_running_ones_with_an_error_event():
    chunk = b'data: {"choices": [{"text": "ab", "finish_reason": null}]}\n\n'
    messages = [
        {"type": "http.response.start", "status": 200, "headers": SSE},
        {"type": "http.response.body", "body": chunk, "more_body": True},
    ]

    async def scenario():
        handle = FakeHandle([])
        handle.response = HangingResponse(messages)
        relay = Relay(handle, queue=5, max_body_bytes=1024)
        first, later, health = Client(), Client(), Client()
        running = asyncio.ensure_future(relay(http_scope(), first.receive, first.send))
        while len(first.sent) < 2:  # the stream has begun
            await asyncio.sleep(0)
        relay.begin_drain()
        await relay(http_scope(), later.receive, later.send)  # a new request while draining
        await relay(http_scope("GET", "/health"), health.receive, health.send)
        assert not running.done()  # the running stream goes on while draining
        await relay.close()  # the drain's deadline: what still runs is cut
        await asyncio.wait_for(running, 5)
        return handle, first.sent, later.sent, health.sent

    handle, sent, later, health = asyncio.run(scenario())
    status, _, body = status_and_body(later)
    assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
    status, _, body = status_and_body(health)
    assert status == 503 and json.loads(body)["status"] == "draining"
    status, _, body = status_and_body(sent)
    events = [e[len("data: ") :] for e in body.decode().split("\n\n") if e]
    assert status == 200 and len(events) == 3, events
    assert json.loads(events[1])["error"]["code"] == "shutting_down" and events[2] == "[DONE]"
    assert handle.response.cancelled  # the replica's generator is told to stop
    assert len(handle.requests) == 1  # the refused request never reached a replica


def test_a_whole_response_ends_the_relay_without_waiting_for_the_generator_to_close():
    """The client may close as soon as the last body message arrives: that must not read as a
    client leaving mid-answer (no cancel of the replica call, nothing logged as a failure)."""
    handle = FakeHandle([])
    handle.response = HangingResponse(OK)  # the generator's own end comes later
    client = Client()
    asyncio.run(
        asyncio.wait_for(Relay(handle, queue=5, max_body_bytes=1024)(http_scope(), client.receive, client.send), 5)
    )
    assert client.sent == OK and not handle.response.cancelled


@pytest.mark.parametrize("joined, deleted", [("auto", ["specexport"]), (None, [])])
def test_a_front_that_fails_leaves_no_application_on_a_joined_cluster(monkeypatch, joined, deleted):
    """serve --replicas --ray-address: the application goes with the command, also when the
    command fails after deploying (here its HTTP front does not start)."""
    import ray

    from specexport_runtime.cluster import deployment as dep
    from specexport_runtime.cluster.front import FrontError

    def failing_front(*args, **kwargs):
        raise FrontError("the HTTP front did not start on 127.0.0.1:0")

    gone: list[str] = []
    monkeypatch.setattr(ray, "init", lambda **_: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(dep.serve, "start", lambda **_: None)
    monkeypatch.setattr(dep.serve, "shutdown", lambda: None)
    monkeypatch.setattr(dep.serve, "delete", gone.append)
    monkeypatch.setattr(dep, "deploy", lambda *args, **kwargs: FakeHandle(OK))
    monkeypatch.setattr(dep, "Front", failing_front)
    config = ClusterConfig(server=ServerConfig(port=0), ray_address=joined)
    with pytest.raises(FrontError):
        dep.serve_cluster("artifact", config)
    assert gone == deleted
