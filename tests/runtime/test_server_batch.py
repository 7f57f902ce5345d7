"""The batching server (`serve --max-batch N`, server/batch_worker.py) on a tiny artifact with a
batch graph of 8 slots: concurrent openai clients get exactly the in-process (batch-1) answers,
/health answers while every slot decodes, a client that leaves frees its slot, and a load of 256
requests from 16 clients loses nothing."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server_support import KEY, LiveServer, SseStream, get, metric_sum, metric_values, msgs, wait_until  # noqa: E402

from specexport_runtime.api import load  # noqa: E402
from specexport_runtime.errors import InvalidArgument  # noqa: E402
from specexport_runtime.server.batch_worker import BatchWorker  # noqa: E402

KIND = "noisy-fused-batch8"
PROMPTS = [
    "Write a function that adds two numbers.",
    "The quick brown fox",
    "for i in range(10): print(i)",
    '{"name": "specexport", "items": [1, 2, 3]}',
    "hello hello hello hello",
    "Once upon a time",
    "x = [1, 2, 3]\ny = [1, 2,",
    "a b c d e f g",
]


class SlowRounds:
    """Makes every batched call of the slot model last `delay` seconds longer (a slow device), and
    counts the sequences of each call."""

    def __init__(self, slots):
        self.delay, self.sizes = 0.0, []
        inner = slots.forward

        def forward(calls):
            self.sizes.append(len(calls))
            if self.delay:
                time.sleep(self.delay)
            return inner(calls)

        slots.forward = forward


@pytest.fixture(scope="module")
def batch_server(tiny_artifacts):
    gen = load(tiny_artifacts[KIND], threads=1, batch=True)
    slow = SlowRounds(gen.slots)
    server = LiveServer(gen, api_key=KEY, max_queue=64, max_batch=8)
    server.slow = slow
    yield server
    server.close()


@pytest.fixture(scope="module")
def ref(tiny_artifacts):
    return load(tiny_artifacts[KIND], threads=1)


def _client(server):
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def _stream(client, model, prompt, n, **extra) -> str:
    chunks = client.chat.completions.create(
        model=model, messages=msgs(prompt), max_tokens=n, temperature=0, stream=True, extra_body=extra
    )
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


def test_worker_is_the_batching_one(batch_server):
    assert isinstance(batch_server.worker, BatchWorker) and batch_server.worker.max_batch == 8


def test_8_streaming_clients_get_the_sequential_answers_and_health_answers(batch_server, ref):
    """8 concurrent streaming clients; every answer equals in-process batch-1 generation; while all
    8 slots decode (rounds slowed to 30 ms), /health answers and reports 8 running."""
    model = batch_server.state.model
    expected = [ref.chat(msgs(p), max_new_tokens=48).text for p in PROMPTS]
    seen_running, barrier = [], threading.Barrier(9)

    def one(i):
        barrier.wait()
        return _stream(_client(batch_server), model, PROMPTS[i], 48)

    batch_server.slow.delay = 0.03
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(8)]
            barrier.wait()

            def all_running():
                status, body = get(batch_server.port, "/health", key=None)
                assert status == 200
                running = __import__("json").loads(body)["running"]
                seen_running.append(running)
                return running == 8

            wait_until(all_running, what="8 running requests in /health")
            answers = [f.result() for f in futures]
    finally:
        batch_server.slow.delay = 0.0
    assert answers == expected
    assert max(batch_server.slow.sizes) == 8 and 8 in seen_running


def test_a_client_that_leaves_frees_its_slot(batch_server, ref):
    model = batch_server.state.model
    worker = batch_server.worker
    _, before = get(batch_server.port, "/metrics")
    batch_server.slow.delay = 0.02
    try:
        stream = SseStream(
            batch_server.port,
            "/v1/chat/completions",
            {"model": model, "messages": msgs("Once upon a time"), "max_tokens": 190, "stream": True, "temperature": 0},
        )
        assert stream.next_event() is not None  # it runs
        wait_until(lambda: worker.running == 1, what="the request to run")
        stream.abandon()
        wait_until(lambda: worker.running == 0, what="the slot to be freed")
    finally:
        batch_server.slow.delay = 0.0
    _, after = get(batch_server.port, "/metrics")
    cancelled = metric_sum(metric_values(after), "specexport:requests_cancelled_total") - metric_sum(
        metric_values(before), "specexport:requests_cancelled_total"
    )
    assert cancelled == 1
    # the next request is served in full
    assert _stream(_client(batch_server), model, PROMPTS[1], 32) == ref.chat(msgs(PROMPTS[1]), max_new_tokens=32).text


@pytest.mark.slow
def test_load_256_requests_from_16_clients(batch_server, ref):
    """256 requests (mixed lengths and proposers, streaming and not) from 16 clients: 0 errors,
    none lost, every answer equal to in-process generation; the batch-size histogram saw full
    batches."""
    model = batch_server.state.model
    proposers = ["hybrid", "ngram", "suffix", "none"]
    jobs = [(PROMPTS[i % 8], 4 + 7 * (i % 9), proposers[i % 4], i % 2 == 0) for i in range(256)]
    expected = {(p, n): ref.chat(msgs(p), max_new_tokens=n).text for p, n, _, _ in jobs}
    errors, done = [], []

    def one_client(k: int) -> None:
        c = _client(batch_server)
        for prompt, n, proposer, stream in jobs[k::16]:
            for attempt in range(400):
                try:
                    if stream:
                        text = _stream(c, model, prompt, n, proposer=proposer)
                    else:
                        text = (
                            c.chat.completions.create(
                                model=model,
                                messages=msgs(prompt),
                                max_tokens=n,
                                temperature=0,
                                extra_body={"proposer": proposer},
                            )
                            .choices[0]
                            .message.content
                        )
                    break
                except openai.RateLimitError:
                    time.sleep(0.005 * (1 + attempt % 8))
            else:
                errors.append(("gave up", prompt, n))
                continue
            done.append(1)
            if text != expected[(prompt, n)]:
                errors.append(("differs", prompt, n, proposer, stream))

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for f in [pool.submit(one_client, k) for k in range(16)]:
            f.result()
    assert errors == [] and len(done) == 256
    _, text = get(batch_server.port, "/metrics")
    values = metric_values(text)
    assert metric_sum(values, "specexport:batch_size_count") > 0
    assert metric_sum(values, "specexport:batch_size_bucket", le="4.0") < metric_sum(
        values, "specexport:batch_size_count"
    )  # some rounds ran more than 4 sequences


def test_max_batch_beyond_the_artifact_is_refused(tiny_artifacts):
    gen = load(tiny_artifacts["noisy-fused"], threads=1)
    with pytest.raises(InvalidArgument, match="max_batch"):
        LiveServer(gen, max_batch=4)
