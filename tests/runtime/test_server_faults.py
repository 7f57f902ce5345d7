"""Server faults: clients that leave mid-stream or while queued, timeouts, garbage on the socket, and
SIGTERM with requests in flight (a real server process). Rounds are slowed by a spy on the
generator so that "in flight" lasts; every wait polls server state, none stands in for one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")

from test_server_support import KEY, LiveServer, Spy, SseStream, get, metric_sum, metric_values, post, wait_until

from specexport_runtime.api import load

KIND = "int8"
CHAT = "/v1/chat/completions"
DELAY = 0.04  # seconds added to every round while a test slows the model


def body(text: str, n: int = 150, stream: bool = True, **extra) -> dict:
    return {
        "messages": [{"role": "user", "content": text}],
        "max_tokens": n,
        "temperature": 0,
        "stream": stream,
        "proposer": "draft",
        **extra,
    }


@pytest.fixture(scope="module")
def gen(tiny_artifacts):
    g = load(tiny_artifacts[KIND], threads=1)
    g.spy = Spy(g)
    return g


@pytest.fixture(scope="module")
def served(gen):
    server = LiveServer(gen, api_key=KEY, max_queue=4)
    yield server
    server.close()


@pytest.fixture
def slow(gen, served):
    gen.spy.delay = DELAY
    yield gen.spy
    gen.spy.delay = 0.0
    wait_until(lambda: served.worker.idle, what="the worker to go idle")


def ids(gen, text: str) -> list[int]:
    return gen.codec.encode_chat([{"role": "user", "content": text}])


def test_client_disconnect_mid_stream_frees_the_worker_within_one_round(gen, served, slow):
    """A streaming client leaves: its generation stops after the round in progress (at most one
    round ends after it left), and the queued request behind it starts right then."""
    a = SseStream(served.port, CHAT, body("abandoned stream"))
    assert a.next_event()["choices"][0]["delta"]["role"] == "assistant"
    assert "content" in a.next_event()["choices"][0]["delta"]  # mid-stream: tokens are flowing
    result = {}
    b = threading.Thread(
        target=lambda: result.update(b=post(served.port, CHAT, body("next in line", n=5, stream=False)))
    )
    b.start()
    wait_until(lambda: served.worker.waiting == 1, what="the second request to queue")
    left = time.monotonic()
    a.abandon()
    b.join(30)
    assert "b" in result, "the queued request did not finish within 30 s"
    status, _, data = result["b"]
    assert status == 200 and data["usage"]["completion_tokens"] == 5
    (run_a,) = slow.find(ids(gen, "abandoned stream"))
    (run_b,) = slow.find(ids(gen, "next in line"))
    round_seconds = max(t1 - t0 for t0, t1 in zip(run_a.round_ends, run_a.round_ends[1:]))
    assert len([t for t in run_a.round_ends if t > left]) <= 1  # stopped within one round
    assert len(run_a.tokens) < 150  # it did not run to its end
    assert run_b.start - left < round_seconds + 0.1  # the queue moved on at that round's end
    assert run_b.start >= run_a.closed  # one generation at a time
    job_a = next(j for j in served.worker.history if j.prompt_ids == run_a.prompt_ids)
    assert job_a.state == "cancelled"


def test_queued_request_whose_client_left_never_runs(gen, served, slow):
    running = SseStream(served.port, CHAT, body("keeps the worker busy"))
    assert running.next_event()["choices"][0]["delta"]["role"] == "assistant"
    before = metric_values(get(served.port, "/metrics")[1])
    gone = socket.create_connection(("127.0.0.1", served.port))
    payload = json.dumps(body("left while queued", stream=False)).encode()
    gone.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    wait_until(lambda: served.worker.waiting == 1, what="the request to queue")
    gone.close()
    wait_until(lambda: served.worker.waiting == 0, what="the queue to drop the request")
    assert served.worker.current is not None  # the first one is still running: the drop did not wait for it
    slow.delay = 0.0
    assert running.events()[-1] == "[DONE]"
    status, _, data = post(served.port, CHAT, body("after them", n=3, stream=False))
    assert status == 200 and data["usage"]["completion_tokens"] == 3
    assert slow.find(ids(gen, "left while queued")) == []  # never reached the generator
    assert len(slow.find(ids(gen, "after them"))) == 1
    after = metric_values(get(served.port, "/metrics")[1])
    cancelled = "specexport:requests_cancelled_total"
    assert metric_sum(after, cancelled, stage="queued") - metric_sum(before, cancelled, stage="queued") == 1
    dropped = [j for j in served.worker.history if j.prompt_ids == ids(gen, "left while queued")]
    assert [j.state for j in dropped] == ["dropped"] and dropped[0].started is None


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)),  # a TLS hello to a plain-HTTP port
        b"GET / HTTP/9.9\r\n\x00\x01\x02\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"\r\n" * 50 + b"BREW /coffee HTCPCP/1.0\r\n\r\n",
    ],
)
def test_garbage_bytes_on_the_socket(served, garbage):
    """Bytes that are not HTTP get a 400 from uvicorn (or the connection closes); the server goes on."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        s.sendall(garbage)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply == b"" or reply.startswith(b"HTTP/1.1 4"), reply[:100]
    status, _, data = post(served.port, CHAT, body("still here", n=2, stream=False))
    assert status == 200 and data["usage"]["completion_tokens"] == 2


def test_half_sent_request_then_close(served):
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        s.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{"messa')
    status, _, _ = post(served.port, CHAT, body("still here", n=2, stream=False))
    assert status == 200 and json.loads(get(served.port, "/health")[1])["status"] == "ok"


def test_running_request_is_cut_at_its_timeout(gen):
    """A request running past --request-timeout ends after its round with finish_reason 'length'
    and `interrupted: timeout`; a queued one past it is answered 503 without running."""
    spy = gen.spy
    spy.delay = 0.1
    server = LiveServer(gen, request_timeout=0.35, max_queue=2)
    try:
        s = SseStream(server.port, CHAT, body("runs too long"), key=None)
        events = s.events()
        final = [e for e in events if isinstance(e, dict) and e["choices"] and e["choices"][0]["finish_reason"]]
        assert events[-1] == "[DONE]" and len(final) == 1
        assert final[0]["choices"][0]["finish_reason"] == "length"
        assert final[0]["choices"][0]["interrupted"] == "timeout"
        (run,) = spy.find(ids(gen, "runs too long"))
        assert len(run.tokens) < 150 and run.round_ends[-1] - run.start < 0.35 + 0.1 + 0.2
    finally:
        spy.delay = 0.0
        server.close()


def test_queued_request_past_its_timeout_gets_503(gen):
    """Worker level: a job whose deadline passed while queued fails with 503 queue_timeout, unrun."""
    import asyncio

    from specexport_runtime.server.config import ServerConfig
    from specexport_runtime.server.metrics import Metrics
    from specexport_runtime.server.worker import Failed, Job, Worker

    runs_before = len(gen.spy.runs)

    async def scenario():
        worker = Worker(gen, ServerConfig(), Metrics("t"))
        now = time.monotonic()
        job = Job(ids(gen, "too late"), gen.configure(max_new_tokens=3), now - 10, now - 5)
        worker.submit(job)
        worker.start()
        event = await asyncio.wait_for(job.next_event(), 10)
        await asyncio.to_thread(worker.stop, 5)
        return event

    event = asyncio.run(scenario())
    assert isinstance(event, Failed) and event.error.status == 503 and event.error.code == "queue_timeout"
    assert len(gen.spy.runs) == runs_before


def test_client_that_stops_reading_stalls_then_is_dropped(gen):
    """Worker level: a handler that takes no events holds the worker MAX_BACKLOG rounds ahead at
    most; after stall_seconds the job is treated as gone and the generation is abandoned."""
    import asyncio

    from specexport_runtime.server.config import ServerConfig
    from specexport_runtime.server.metrics import Metrics
    from specexport_runtime.server.worker import MAX_BACKLOG, Job, Worker

    metrics = Metrics("t")

    async def scenario():
        worker = Worker(gen, ServerConfig(stall_seconds=0.2), metrics)
        now = time.monotonic()
        job = Job(
            ids(gen, "nobody reads this"),
            gen.configure(max_new_tokens=100, temperature=0.0, proposer="none"),
            now,
            now + 60,
        )
        worker.submit(job)
        worker.start()
        while job.state in ("queued", "running"):
            await asyncio.sleep(0.01)
        await asyncio.to_thread(worker.stop, 5)
        return job

    job = asyncio.run(scenario())
    (run,) = gen.spy.find(ids(gen, "nobody reads this"))
    assert job.state == "cancelled" and run.closed is not None
    assert len(run.round_ends) == MAX_BACKLOG + 1  # the rounds the handler had credit for, and the one it never took
    assert metric_sum(metric_values(metrics.render()), "specexport:requests_cancelled_total", stage="stalled") == 1


# --- SIGTERM on a real server process ---------------------------------------------------------------
LAUNCHER = """
import sys, time
from specexport_runtime.api import load
from specexport_runtime.server.config import ServerConfig
from specexport_runtime.generator import Generation
from specexport_runtime.server.run import serve

gen = load(sys.argv[1], threads=1)
inner = gen.events

def slow_events(prompt, config=None, **kwargs):  # a slow model: 40 ms more per round
    events = inner(prompt, config, **kwargs)

    def rounds():
        try:
            for event in events:
                time.sleep(0.04)
                yield event
        finally:
            events.close()

    return Generation(rounds(), events.stats, events.config, events.gamma_policy)

gen.events = slow_events
serve(gen, ServerConfig(port=int(sys.argv[2]), drain_seconds=float(sys.argv[3])), log_level="warning")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_in_flight_streams_and_exits(tiny_artifacts, tmp_path):
    """SIGTERM with one stream running and one queued: /health turns 503, a new request is refused
    with 503, the queued one gets 503, the running stream ends with a final chunk (finish_reason
    set, interrupted 'shutdown') and [DONE], and the process exits in bounded time."""
    drain = 0.5
    script = tmp_path / "launch.py"
    script.write_text(LAUNCHER, encoding="utf-8")
    port = _free_port()
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tiny_artifacts[KIND]), str(port), str(drain)],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:

        def healthy():
            try:
                return get(port, "/health", key=None, timeout=2)[0] == 200
            except OSError:
                assert proc.poll() is None, Path(log.name).read_text()
                return False

        wait_until(healthy, timeout=60, what="the server process to start")
        running = SseStream(port, CHAT, body("in flight at SIGTERM", n=180), key=None)
        assert running.next_event()["choices"][0]["delta"]["role"] == "assistant"
        queued = {}
        t = threading.Thread(target=lambda: queued.update(r=post(port, CHAT, body("queued at SIGTERM"), key=None)))
        t.start()
        wait_until(lambda: json.loads(get(port, "/health", key=None)[1])["waiting"] == 1, what="a queued request")
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: get(port, "/health", key=None)[0] == 503, timeout=5, what="/health to say draining")
        status, headers, data = post(port, CHAT, body("arrives during shutdown", stream=False), key=None)
        assert status == 503 and data["error"]["code"] == "shutting_down" and "retry-after" in headers
        t.join(10)
        status, _, data = queued["r"]
        assert status == 503 and data["error"]["code"] == "shutting_down"
        events = running.events()
        assert events[-1] == "[DONE]"
        final = [e for e in events if isinstance(e, dict) and e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(final) == 1 and final[0]["choices"][0]["finish_reason"] == "length"
        assert final[0]["choices"][0]["interrupted"] == "shutdown" and final[0]["usage"]["completion_tokens"] < 180
        proc.wait(timeout=drain + 15)
        assert time.monotonic() - signalled < drain + 10
        assert proc.returncode in (0, -signal.SIGTERM), Path(log.name).read_text()
        with pytest.raises(OSError):
            get(port, "/health", key=None, timeout=2)
        assert "Traceback" not in Path(log.name).read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()
