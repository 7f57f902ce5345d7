"""A local Ray Serve cluster serving a tiny batch artifact as a signed `.spx`: 2 replicas of 4 slots,
each unpacking and verifying the package itself; the openai client's concurrent greedy requests
equal in-process solo generation, both replicas serve (by their own /metrics), the ingress answers
/health and refuses a missing API key itself, and a tampered package is refused by every replica
with one line."""

from __future__ import annotations

import http.client
import json
import shutil
import tarfile
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")

from cluster_support import config, deploy_at, fixture_cluster, front_for, replica_metrics, running_replicas, wait_until  # noqa: E402, F401
from test_server_support import metric_sum, metric_values  # noqa: E402

from specexport_runtime.api import load  # noqa: E402
from specexport_runtime.cluster.deployment import ClusterError  # noqa: E402
from specexport_runtime.cluster.replica import REFUSED, REPLICA_HEADER  # noqa: E402
from specexport_runtime.package import pack  # noqa: E402
from specexport_runtime.signing import keygen, sign  # noqa: E402

KIND = "noisy-fused-batch8"  # bitwise: a sequence's batched tokens equal its solo run
SLOTS = 4  # each replica's max_batch
KEY = "cluster-test-key"
N_REQUESTS = 32
PROMPTS = ["Write a function that adds two numbers.", "The quick brown fox", "for i in range(10): print(i)"]


@pytest.fixture(scope="module")
def package(tiny_artifacts, tmp_path_factory):
    """(the signed .spx of the tiny int8 artifact, the public key's PEM bytes)."""
    tmp = tmp_path_factory.mktemp("cluster-spx")
    root = shutil.copytree(tiny_artifacts[KIND], tmp / "artifact")
    private, public = keygen(tmp / "keys")
    sign(root, private)
    return pack(root, tmp / "tiny.spx"), public.read_bytes()


@pytest.fixture(scope="module")
def ref(tiny_artifacts):
    return load(tiny_artifacts[KIND], threads=1)


@pytest.fixture(scope="module")
def two(cluster, package):
    """Ports of two entries to the same 2 replicas: (an HTTP front in this process, as `serve
    --replicas` runs it; Ray's proxy and the ingress deployment, as deployment() composes it)."""
    spx, key = package
    cfg = config(replicas=2, max_queue=N_REQUESTS, keys=(key,), max_batch=SLOTS, api_key=KEY, name="two")
    deploy_at(spx, cfg, route="/")
    assert running_replicas("two") == 2
    return front_for(cfg), cluster


def _request(client, model, i):
    """One of N_REQUESTS different greedy requests: chat or raw completion, streamed or not."""
    text, n, stream = f"{PROMPTS[i % 3]} #{i}", 6 + i % 10, i % 2 == 1
    if i % 4 < 2:
        messages = [{"role": "user", "content": text}]
        if stream:
            chunks = client.chat.completions.create(
                model=model, messages=messages, max_tokens=n, temperature=0, stream=True
            )
            return ("chat", text, n), "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), None
        r = client.chat.completions.create(
            model=model, messages=messages, max_tokens=n, temperature=0, extra_body={"return_token_ids": True}
        )
        return ("chat", text, n), r.choices[0].message.content, r.choices[0].model_extra["token_ids"]
    if stream:
        chunks = client.completions.create(model=model, prompt=text, max_tokens=n, temperature=0, stream=True)
        return ("text", text, n), "".join(c.choices[0].text for c in chunks if c.choices), None
    r = client.completions.create(
        model=model, prompt=text, max_tokens=n, temperature=0, extra_body={"return_token_ids": True}
    )
    return ("text", text, n), r.choices[0].text, r.choices[0].model_extra["token_ids"]


@pytest.mark.slow
def test_two_replicas_answer_32_concurrent_requests_as_in_process_and_share_them(two, ref):
    """Half of the requests through the front, half through Ray's proxy, all at once."""
    clients = [
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120) for port in two
    ]
    model = clients[0].models.list().data[0].id
    with ThreadPoolExecutor(N_REQUESTS) as pool:
        answers = list(pool.map(lambda i: _request(clients[i % 2], model, i), range(N_REQUESTS)))
    for (kind, text, n), got_text, got_ids in answers:
        want = (
            ref.chat([{"role": "user", "content": text}], max_new_tokens=n, speculative=False)
            if kind == "chat"
            else ref.generate(text, max_new_tokens=n, speculative=False)
        )
        assert got_text == want.text, (kind, text)
        if got_ids is not None:
            assert got_ids == want.token_ids, (kind, text)
    served = {
        replica: metric_sum(metric_values(text), "specexport:request_success_total")
        for replica, text in replica_metrics(two[0], want=2, key=KEY).items()
    }
    assert len(served) == 2 and all(count > 0 for count in served.values()), served
    assert sum(served.values()) == N_REQUESTS
    # each replica's batch-size histogram: some target call of some replica ran 2 or more sequences
    together = [
        metric_sum(values, "specexport:batch_size_count") - metric_sum(values, "specexport:batch_size_bucket", le="1.0")
        for values in map(metric_values, replica_metrics(two[0], want=2, key=KEY).values())
    ]
    assert max(together) > 0, together


def _ask(port: int, method: str, path: str, headers: dict) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body=b'{"prompt": "x"}' if method == "POST" else None, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.slow  # a two-replica Ray Serve application (~25 s to start): .ci/run's second pass
@pytest.mark.parametrize("entry", [0, 1], ids=["front", "ray-proxy"])
def test_the_ingress_answers_health_and_refuses_a_missing_key_before_any_replica(two, entry):
    status, headers, body = _ask(two[entry], "GET", "/health", {})
    assert status == 200 and body == {"status": "ok", "replicas_running": 2}
    assert REPLICA_HEADER.decode() not in headers  # no replica answered it
    for auth in ({}, {"Authorization": "Bearer wrong"}):
        status, headers, body = _ask(
            two[entry], "POST", "/v1/completions", {"Content-Type": "application/json", **auth}
        )
        assert status == 401 and body["error"]["code"] == "invalid_api_key", body
        assert REPLICA_HEADER.decode() not in headers


@pytest.mark.slow
@pytest.mark.parametrize("entry", [0, 1], ids=["front", "ray-proxy"])
def test_cors_is_the_entrys_and_the_front_logs_each_replicas_request_line(two, entry):
    """A preflight from a page of this machine gets 204 at the entry (no key asked), an answer to
    that page carries one Access-Control-Allow-Origin (the replicas add none), and the front logs
    the request line its replica reported, with the replica's id."""
    import logging

    from specexport_runtime.server.logs import LOGGER

    page = "http://localhost:8080"
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST"}
    conn = http.client.HTTPConnection("127.0.0.1", two[entry], timeout=60)
    conn.request("OPTIONS", "/v1/completions", headers=preflight)
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 204 and resp.getheader("access-control-allow-origin") == page
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger(LOGGER)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        headers = {"Origin": page, "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
        body = json.dumps({"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0})
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        resp = conn.getresponse()
        usage = json.loads(resp.read())["usage"]
        assert (
            resp.status == 200 and [k.lower() for k, _ in resp.getheaders()].count("access-control-allow-origin") == 1
        )
        if entry == 0:  # the ray-proxy entry's relay logs in the Ingress actor's process
            wait_until(lambda: any(r.getMessage() == "request" for r in records), 10, "the request line")
            [line] = [r.fields for r in records if r.getMessage() == "request"]
            assert line["id"] == resp.getheader("x-request-id") and line["new_tokens"] == usage["completion_tokens"]
            assert line["replica"] == resp.getheader(REPLICA_HEADER.decode())
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        conn.close()


# two replicas (~20 s with their teardown); load() refuses tampering in the default run (test_runtime_errors)
@pytest.mark.slow
def test_a_tampered_package_is_refused_by_every_replica_in_one_line(two, package, tmp_path):
    from ray import serve

    spx, key = package
    tampered = shutil.copy(spx, tmp_path / "tampered.spx")
    with tarfile.open(tampered) as tar:
        member = next(m for m in tar.getmembers() if m.name == "tokenizer.json")
    with open(tampered, "r+b") as handle:  # one byte of tokenizer.json, inside the tar
        handle.seek(member.offset_data + 10)
        byte = handle.read(1)
        handle.seek(member.offset_data + 10)
        handle.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ClusterError) as err:
        deploy_at(tampered, config(replicas=2, keys=(key,), name="tampered"), route="/tampered")
    line = str(err.value)
    assert "\n" not in line and line.startswith(REFUSED), line
    assert "tokenizer.json" in line and "checksum" in line.lower(), line
    status = serve.status().applications["tampered"]
    assert status.status == "DEPLOY_FAILED" and running_replicas("tampered") == 0
    serve.delete("tampered")
    assert running_replicas("two") == 2  # the good deployment goes on
