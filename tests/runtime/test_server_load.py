"""The OpenAI-compatible server under load (the tiny int8 server of test_server_support.py): 64
requests from 8 concurrent openai clients against a bounded queue; requests answered 429 are
retried, and every output equals in-process generation."""

from __future__ import annotations

import concurrent.futures
import statistics
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server_support import (  # noqa: E402
    KEY,
    PROMPTS,
    PROPOSERS,
    fixture_model,  # noqa: F401 (this module's `model` fixture)
    fixture_ref,  # noqa: F401 (this module's `ref` fixture)
    fixture_served,  # noqa: F401 (this module's `served` fixture)
    get,
    metric_sum,
    metric_values,
    msgs,
)


def test_load_64_requests_from_8_clients(served, ref, model, capsys):
    """64 requests from 8 concurrent clients, streaming and not, five proposers, greedy; the queue
    holds MAX_QUEUE, so some are answered 429 and retried: 0 errors, every output equal to
    in-process generation."""
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + 5 * (i % 7), PROPOSERS[i % len(PROPOSERS)], i % 2 == 0) for i in range(64)]
    expected = {(p, n): ref.chat(msgs(p), max_new_tokens=n).text for p, n, _, _ in jobs}
    barrier = threading.Barrier(8)
    rejected, errors = [], []

    def one_client(worker_index: int) -> list[tuple[float, bool]]:
        c = openai.OpenAI(base_url=served.base_url, api_key=KEY, max_retries=0, timeout=120)
        barrier.wait()
        timings = []
        for prompt, n, proposer, stream in jobs[worker_index::8]:
            start = time.monotonic()
            for attempt in range(200):
                try:
                    kwargs = {
                        "model": model,
                        "messages": msgs(prompt),
                        "max_tokens": n,
                        "temperature": 0,
                        "extra_body": {"proposer": proposer},
                    }
                    if stream:
                        text = "".join(
                            ch.choices[0].delta.content or ""
                            for ch in c.chat.completions.create(stream=True, **kwargs)
                            if ch.choices
                        )
                    else:
                        text = c.chat.completions.create(**kwargs).choices[0].message.content
                    break
                except openai.RateLimitError as exc:
                    rejected.append(exc.response.headers.get("retry-after"))
                    time.sleep(0.005 * (1 + attempt % 8))  # client back-off; the server's queue does the pacing
            else:
                errors.append(("gave up", prompt, n))
                continue
            if text != expected[(prompt, n)]:
                errors.append(("differs", prompt, n, proposer, stream))
            timings.append((time.monotonic() - start, stream))
        return timings

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = [f.result() for f in [pool.submit(one_client, i) for i in range(8)]]
    wall = time.monotonic() - t0
    latencies = sorted(t for r in results for t, _ in r)
    assert errors == []
    assert len(latencies) == 64
    assert rejected and all(int(v) >= 1 for v in rejected)  # the queue bound was hit and said when to come back
    tokens = sum(n for _, n, _, _ in jobs)
    p50, p99 = statistics.quantiles(latencies, n=100)[49], statistics.quantiles(latencies, n=100)[98]
    with capsys.disabled():
        print(
            f"\n[load] 64 requests, 8 clients: {len(rejected)} answered 429 and retried; latency p50 {p50:.3f} s,"
            f" p99 {p99:.3f} s; {tokens / wall:.0f} generated tok/s over {wall:.2f} s"
        )
    metrics = metric_values(get(served.port, "/metrics")[1])
    assert metric_sum(metrics, "specexport:requests_rejected_total", reason="queue_full") >= len(rejected)
    assert metric_sum(metrics, "specexport:num_requests_waiting") == 0
