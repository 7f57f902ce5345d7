"""Ray Serve replicas that die and replicas that come and go (the `cluster` marker: .ci/run's second pass).

The artifact is the tiny n-gram one with a 2048-token context: a greedy answer of ~2000 tokens
takes about 2 s on one core, long enough to kill its replica mid-stream and to build a queue."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")

from cluster_support import config, deploy_at, fixture_cluster, kill_replica, running_replicas, wait_until  # noqa: E402, F401
from test_server_support import SseStream, get, metric_sum, metric_values, post  # noqa: E402
from tiny import build_tiny_artifact  # noqa: E402

from specexport_runtime.api import load  # noqa: E402
from specexport_runtime.cluster.replica import REPLICA_HEADER  # noqa: E402

pytestmark = pytest.mark.cluster
CONTEXT = 2048
LONG = 1900  # new tokens of a long answer
PROMPT = "The quick brown fox"  # answered with LONG tokens (no end of sequence) by the tiny model


@pytest.fixture(scope="module")
def long_artifact(tmp_path_factory) -> Path:
    return build_tiny_artifact(tmp_path_factory.mktemp("tiny-long"), "ngram", max_context=CONTEXT)


@pytest.fixture(scope="module")
def ref(long_artifact):
    return load(long_artifact, threads=1)


def _stream_body(prompt: str, n: int) -> dict:
    return {"model": "tiny-ngram", "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}


def _read_stream(port: int, prompt: str = PROMPT, n: int = LONG, on_text=None) -> dict:
    """One streamed greedy completion: {"status", "replica", "text", "finish", "error"} (error: the
    code of the error event or error body; finish: the finish_reason of a clean end). on_text(replica)
    is called once the first text arrived."""
    sse = SseStream(port, "/v1/completions", _stream_body(prompt, n), key=None, timeout=120)
    out = {"status": sse.resp.status, "replica": sse.resp.getheader(REPLICA_HEADER.decode()), "text": ""}
    out["finish"] = out["error"] = None
    if sse.resp.status != 200:
        out["error"] = json.loads(sse.resp.read())["error"]["code"]
        return out
    done = False
    while (event := sse.next_event()) is not None:
        if event == "[DONE]":
            done = True
            continue
        if "error" in event:
            out["error"] = event["error"]["code"]
            continue
        for choice in event["choices"]:
            out["text"] += choice["text"]
            out["finish"] = choice["finish_reason"] or out["finish"]
        if on_text is not None and out["text"]:
            on_text(out["replica"])
            on_text = None
    assert done, "every stream ends with data: [DONE]"
    return out


def test_a_replica_killed_mid_stream_fails_its_requests_cleanly_and_comes_back(cluster, long_artifact, ref):
    from ray import serve

    port = deploy_at(long_artifact, config(replicas=2, max_queue=8, health_check_period=1.0, name="failover"))
    want = ref.generate(PROMPT, max_new_tokens=LONG, speculative=False).text
    victim_replica: list[str] = []
    running = threading.Event()

    def on_text(replica):
        victim_replica.append(replica)
        running.set()

    with ThreadPoolExecutor(5) as pool:
        victim = pool.submit(_read_stream, port, PROMPT, LONG, on_text)
        assert running.wait(60), "the victim's stream started"
        others = [pool.submit(_read_stream, port) for _ in range(4)]  # in flight or queued meanwhile
        kill_replica(victim_replica[0])  # mid-stream: ~2 s of tokens are left
        results = [victim.result(timeout=120)] + [f.result(timeout=120) for f in others]
    assert results[0]["error"] == "replica_failed" and results[0]["finish"] is None, results[0]
    assert len(results[0]["text"]) < len(want)  # it was cut, and said so
    for r in results:  # every request: the whole answer, or an error the client sees; never a short success
        if r["error"] is None:
            assert r["status"] == 200 and r["finish"] == "length" and r["text"] == want
        else:
            assert r["error"] == "replica_failed" and r["finish"] is None
    # new requests succeed on a live replica, and Ray brings the killed one back
    for _ in range(4):
        status, headers, body = post(
            port, "/v1/completions", {"model": "tiny-ngram", "prompt": "x", "max_tokens": 4}, None
        )
        assert status == 200 and headers[REPLICA_HEADER.decode()] != victim_replica[0], body
    wait_until(lambda: running_replicas("failover") == 2, 90, "Ray to restart the killed replica")
    serve.delete("failover")


def test_a_client_that_leaves_mid_stream_frees_its_replica_slot(cluster, long_artifact):
    """One replica of one slot: a client closes its connection after the first text of a long
    answer; the cancel reaches the replica through the ingress (its job stops: the replica's own
    metrics count a cancelled request and no running one, long before the answer could end), and
    the next request is served whole."""
    from ray import serve

    port = deploy_at(long_artifact, config(replicas=1, max_queue=1, replica_queue=0, name="leave"))
    sse = SseStream(port, "/v1/completions", _stream_body(PROMPT, LONG), key=None, timeout=60)
    assert sse.resp.status == 200
    while not ((event := sse.next_event()) and event != "[DONE]" and event["choices"][0]["text"]):
        assert event is not None, "the stream ended before its first text"
    sse.conn.sock.shutdown(2)  # the client leaves mid-answer (~2 s of tokens left)
    sse.conn.close()

    def replica_metrics() -> dict:
        status, body = get(port, "/metrics", key=None)
        assert status == 200
        return metric_values(body)

    def cancelled() -> bool:
        values = replica_metrics()  # one scrape: both figures from the same moment
        return (
            metric_sum(values, "specexport:requests_cancelled_total") == 1
            and metric_sum(values, "specexport:num_requests_running") == 0
        )

    wait_until(cancelled, 10, "the replica to cancel the job of the client that left")
    assert metric_sum(replica_metrics(), "specexport:request_success_total") == 0
    after = _read_stream(port, "x", 8)
    assert after["status"] == 200 and after["finish"] == "length" and after["error"] is None, after
    serve.delete("leave")


def test_autoscaling_adds_a_replica_under_a_queue_and_removes_it_after(cluster, long_artifact):
    from ray import serve

    cfg = config(
        replicas=None,
        autoscale=(1, 2),
        target_ongoing=1,
        upscale_delay=1.0,
        downscale_delay=3.0,
        max_queue=16,
        name="autoscale",
    )
    port = deploy_at(long_artifact, cfg)
    assert running_replicas("autoscale") == 1
    peak = [1]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], running_replicas("autoscale"))
            time.sleep(0.25)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: _read_stream(port), range(8)))
    finally:
        stop.set()
        watcher.join()
    assert all(r["error"] is None and r["finish"] == "length" for r in results), results
    assert peak[0] == 2, "a queue of 8 long requests at target 1 per replica scales to 2"
    assert len({r["replica"] for r in results}) == 2, "both replicas served"
    wait_until(lambda: running_replicas("autoscale") == 1, 90, "the idle cluster to scale back to 1")
    serve.delete("autoscale")


def test_the_cluster_queue_bound_answers_429_through_ray(cluster, long_artifact):
    """One replica of one slot, nothing waiting at it (replica_queue 0), and a cluster queue of 1:
    of 4 long requests at once, one runs, one waits at the ingress, and the rest get 429
    queue_full from Ray's back-pressure on the streaming handle; the admitted ones finish whole."""
    from ray import serve

    port = deploy_at(long_artifact, config(replicas=1, max_queue=1, replica_queue=0, name="bounded"))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: _read_stream(port), range(4)))
    refused = [r for r in results if r["status"] == 429]
    served = [r for r in results if r["status"] == 200]
    assert len(refused) >= 2 and all(r["error"] == "queue_full" for r in refused), results
    assert served and all(r["error"] is None and r["finish"] == "length" for r in served), results
    assert len(refused) + len(served) == 4
    serve.delete("bounded")
