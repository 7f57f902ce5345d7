"""Retry-After (server/backpressure.py): the expected wait from the free slots and the queue,
checked alone and against the measured drain of a batching server's queue (4 slots, every
batched round slowed to a known length so that a request's run time is steady)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server_batch import SlowRounds  # noqa: E402
from test_server_support import KEY, LiveServer, msgs, wait_until  # noqa: E402

from specexport_runtime.api import load  # noqa: E402
from specexport_runtime.server.backpressure import expected_wait, retry_headers, update_mean  # noqa: E402

KIND = "noisy-fused-batch4"
SLOTS, QUEUE, TOKENS = 4, 8, 12


def test_expected_wait_counts_the_slots():
    # the case: 8 slots busy, 10 waiting, 2 s a request: 10 + 1 requests start at 4 per s
    assert expected_wait(2.0, 10, 8, 8) == pytest.approx(2.75)
    assert expected_wait(2.0, 10, 1, 1) == pytest.approx(22.0)  # batch-1: one after the other
    assert expected_wait(2.0, 3, 8, 4) == 0.0  # free slots take the queue and the newcomer
    assert expected_wait(2.0, 4, 8, 4) == pytest.approx(0.25)
    assert retry_headers(0.25) == {"Retry-After": "1", "retry-after-ms": "250"}
    assert retry_headers(2.75) == {"Retry-After": "3", "retry-after-ms": "2750"}
    assert update_mean(None, 3.0) == 3.0 and update_mean(1.0, 2.0) == pytest.approx(1.2)


@pytest.fixture(scope="module")
def server(tiny_artifacts):
    gen = load(tiny_artifacts[KIND], threads=1, batch=True)
    slow = SlowRounds(gen.slots)
    slow.delay = 0.04  # a round lasts >= 40 ms whatever shares the cores: run times are steady
    srv = LiveServer(gen, api_key=KEY, max_queue=QUEUE, max_batch=SLOTS)
    yield srv
    srv.close()


def test_retry_after_is_within_2x_of_the_measured_drain(server, capsys):
    """Warm-up: one full batch sets the mean run time. Then SLOTS + QUEUE + 4 requests at once:
    the last 4 get 429; the time from each 429 until the queue is empty (polled every 5 ms) is
    within a factor 2 of its retry-after-ms (the old estimate, without the slots, was 4x off)."""
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=msgs("hello hello hello hello"), max_tokens=TOKENS, temperature=0,
              extra_body={"proposer": "none"})  # fmt: skip
    first = client.chat.completions.create(**kw)
    assert first.choices[0].finish_reason == "length"  # every request runs TOKENS rounds
    with concurrent.futures.ThreadPoolExecutor(SLOTS) as pool:
        list(pool.map(lambda _: client.chat.completions.create(**kw), range(SLOTS)))

    rejected: list[tuple[float, float]] = []  # (monotonic time of the 429, its retry-after-ms / 1000)
    lock = threading.Lock()
    barrier = threading.Barrier(SLOTS + QUEUE + 4)

    def one(i: int) -> None:
        barrier.wait()
        time.sleep(0.01 * (i >= SLOTS + QUEUE))  # the last ones arrive after the queue is full
        try:
            client.chat.completions.create(**kw)
        except openai.RateLimitError as exc:
            with lock:
                rejected.append((time.monotonic(), int(exc.response.headers["retry-after-ms"]) / 1000))

    worker = server.worker
    with concurrent.futures.ThreadPoolExecutor(SLOTS + QUEUE + 4) as pool:
        futures = [pool.submit(one, i) for i in range(SLOTS + QUEUE + 4)]
        wait_until(lambda: len(rejected) >= 4 or all(f.done() for f in futures), what="the 429s")
        while worker.waiting:
            time.sleep(0.005)
        drained = time.monotonic()
        for f in futures:
            f.result()
    assert len(rejected) >= 4
    with capsys.disabled():
        print("\n[retry-after] " + ", ".join(f"{w:.2f} s vs drain {drained - at:.2f} s" for at, w in rejected))
    for at, wait in rejected:
        measured = drained - at
        assert 0.5 <= wait / measured <= 2.0, f"Retry-After {wait:.3f} s, queue drained in {measured:.3f} s"
