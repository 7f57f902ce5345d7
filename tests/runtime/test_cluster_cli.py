"""`specexport-runtime serve --replicas 1` as an operator runs it (the `cluster` marker: .ci/run's
second pass): the command starts its own Ray, serves, and on SIGINT lets the running request
finish whole (the drain) before it stops Ray and exits 0. Its own module: no other Ray runs in
this process meanwhile."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

from cluster_support import free_port  # noqa: E402
from test_server_support import SseStream, answers_ok, get, post  # noqa: E402
from tiny import build_tiny_artifact  # noqa: E402

from specexport_runtime.api import load  # noqa: E402

pytestmark = pytest.mark.cluster
LONG = 1500  # new tokens: a few seconds on one core, so the signal comes mid-stream
PROMPT = "The quick brown fox"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def long_artifact(tmp_path_factory) -> Path:
    return build_tiny_artifact(tmp_path_factory.mktemp("tiny-long"), "ngram", max_context=2048)


def test_sigint_drains_the_running_request_then_stops(long_artifact, tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "specexport_runtime.cli", "serve", str(long_artifact), "--replicas", "1"]
    cmd += ["--threads", "1", "--port", str(port), "--drain-seconds", "60"]
    log = open(tmp_path / "serve.log", "ab")  # appended to: Ray's processes share the descriptor
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 180
        # serving once the command says so (its signal handlers are set then), and /health answers
        while "serving " not in (tmp_path / "serve.log").read_text(errors="replace") or not answers_ok(port, "/health"):
            assert proc.poll() is None, (tmp_path / "serve.log").read_text(errors="replace")
            assert time.monotonic() < deadline, "the cluster did not serve within 180 s"
            time.sleep(0.5)
        body = {"model": "tiny-ngram", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "stream": True}
        sse = SseStream(port, "/v1/completions", body, key=None, timeout=300)
        assert sse.resp.status == 200
        text, finish, signalled, events = "", None, threading.Event(), []
        while (event := sse.next_event()) is not None:
            events.append(event)
            if event == "[DONE]":
                continue
            assert "error" not in event, event
            for choice in event["choices"]:
                text += choice["text"]
                finish = choice["finish_reason"] or finish
            if text and not signalled.is_set():  # mid-stream: the operator presses Ctrl-C
                proc.send_signal(signal.SIGINT)
                signalled.set()
                refused = _draining(port, time.monotonic() + 30)
        assert signalled.is_set() and finish == "length", (len(text), events[-3:])
        want = load(long_artifact, threads=1).generate(PROMPT, max_new_tokens=LONG, speculative=False)
        assert text == want.text  # the whole answer, not one cut at the signal
        assert refused == (503, "shutting_down")  # a new request while the running one drains
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    output = (tmp_path / "serve.log").read_text(errors="replace")
    assert "draining: running requests may finish for 60 s" in output, output[-2000:]
    # the log of the single server: a start-up summary, one line per request with its replica's figures
    assert " INFO specexport.server startup artifact=" in output and " replicas=1 " in output, output[-2000:]
    assert re.search(r" INFO specexport\.server request id=\S+ .*new_tokens=\d+ .* replica=\S+", output), output[-2000:]
    assert not answers_ok(port, "/health")


def _draining(port: int, deadline: float) -> tuple[int, str]:
    """Once /health says draining (503): (status, error code) of a new completion request."""
    while True:
        status, body = get(port, "/health", key=None)
        if status == 503 and json.loads(body)["status"] == "draining":
            break
        assert time.monotonic() < deadline, (status, body)
        time.sleep(0.05)
    status, _, body = post(port, "/v1/completions", {"model": "tiny-ngram", "prompt": "x", "max_tokens": 4}, None)
    return status, body["error"]["code"]
