"""The server's prefix reuse: cached_tokens in OpenAI's usage (read by the real openai client),
answers equal to a cold in-process generator's, one pool namespace per API key unless shared,
cache_prompt: false, the /metrics figures and the serve options."""

from __future__ import annotations

import argparse

import pytest

pytest.importorskip("starlette")
openai = pytest.importorskip("openai")

from test_server_support import CHAT, LiveServer, get, metric_sum, metric_values, post  # noqa: E402

from specexport_runtime.api import load  # noqa: E402
from specexport_runtime.errors import InvalidArgument  # noqa: E402
from specexport_runtime.server.config import ServerConfig, add_prefix_arguments, prefix_namespace, prefix_overrides  # noqa: E402

KIND = "noisy"
SYSTEM = "You are a careful assistant for a code editor: answer briefly."  # the tiny context is 256 ids
TURNS = ["def add(a, b):", "Now for three.", "The quick fox?"]


@pytest.fixture(scope="module")
def served(tiny_artifacts):
    server = LiveServer(load(tiny_artifacts[KIND], threads=1))  # no --api-key: any Authorization header
    yield server
    server.close()


@pytest.fixture(scope="module")
def cold(tiny_artifacts):
    """In-process generation without a pool: the reference."""
    return load(tiny_artifacts[KIND], threads=1, config={"prefix_cache_bytes": 0})


def client(server: LiveServer, key: str):
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60)


def chat(c, messages, **extra):
    return c.chat.completions.create(model="tiny-noisy", messages=messages, max_tokens=16, temperature=0, **extra)


def test_turns_report_cached_tokens_and_equal_a_cold_start(served, cold):
    c = client(served, "alice")
    messages = [{"role": "system", "content": SYSTEM}]
    for i, turn in enumerate(TURNS):
        messages.append({"role": "user", "content": turn})
        r = chat(c, messages, extra_body={"return_token_ids": True})
        want = cold.chat(messages, max_new_tokens=16, temperature=0.0)
        assert r.choices[0].message.content == want.text
        cached = r.usage.prompt_tokens_details.cached_tokens
        assert (cached > 0) == (i > 0), (i, cached)
        assert r.model_extra["speculative"]["cached_tokens"] == cached
        messages.append({"role": "assistant", "content": r.choices[0].message.content})


def test_api_keys_do_not_share_prefixes_unless_the_server_says_so(served, tiny_artifacts):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Keys apart?"}]
    first = chat(client(served, "key-one"), messages)
    again = chat(client(served, "key-one"), messages)
    other = chat(client(served, "key-two"), messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert other.choices[0].message.content == first.choices[0].message.content
    shared = LiveServer(load(tiny_artifacts[KIND], threads=1), share_prefix_cache=True)
    try:
        chat(client(shared, "key-one"), messages)
        r = chat(client(shared, "key-two"), messages)
        assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    finally:
        shared.close()


def test_cache_prompt_false_opts_out(served):
    body = {
        "messages": [{"role": "user", "content": "Opt out of the cache."}],
        "max_tokens": 4,
        "temperature": 0,
        "cache_prompt": False,
    }
    for _ in range(2):
        status, _, data = post(served.port, CHAT, body, key="opt-out")
        assert status == 200 and data["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, _, data = post(served.port, CHAT, {**body, "cache_prompt": "yes"}, key="opt-out")
    assert status == 400 and data["error"]["param"] == "cache_prompt"
    assert "cache_prompt must be a boolean" in data["error"]["message"]


def test_metrics_show_the_pool(served):
    before = metric_values(get(served.port, "/metrics", key=None)[1])
    body = {"messages": [{"role": "user", "content": "Count me."}], "max_tokens": 4, "temperature": 0}
    cached = [post(served.port, CHAT, body, key="metrics")[2]["usage"]["prompt_tokens_details"] for _ in range(2)]
    after = metric_values(get(served.port, "/metrics", key=None)[1])
    hits = metric_sum(after, "specexport:prefix_cache_hits_total") - metric_sum(
        before, "specexport:prefix_cache_hits_total"
    )
    assert hits == sum(c["cached_tokens"] for c in cached) > 0
    pool = served.state.gen.prefix_cache.pool
    assert metric_sum(after, "specexport:prefix_cache_bytes") == pool.nbytes > 0
    assert metric_sum(after, "specexport:prefix_cache_max_bytes") == pool.max_bytes
    assert 0 < metric_sum(after, "specexport:prefix_cache_token_hit_rate") <= 1


def test_serve_options():
    parser = argparse.ArgumentParser()
    add_prefix_arguments(parser)
    assert prefix_overrides(parser.parse_args([])) == {}
    assert prefix_overrides(parser.parse_args(["--prefix-cache-mib", "1.5"])) == {"prefix_cache_bytes": 1572864}
    with pytest.raises(InvalidArgument, match="--prefix-cache-mib must be a number of MiB >= 0"):
        prefix_overrides(parser.parse_args(["--prefix-cache-mib", "-1"]))
    assert parser.parse_args(["--share-prefix-cache"]).share_prefix_cache is True
    with pytest.raises(InvalidArgument, match="share_prefix_cache must be true or false"):
        ServerConfig(share_prefix_cache="yes")
    assert prefix_namespace("Bearer a", False) != prefix_namespace("Bearer b", False)
    assert prefix_namespace("Bearer a", True) == prefix_namespace(None, False) == ""


def test_cluster_replicas_take_the_bound(tiny_artifacts, tmp_path):
    from specexport_runtime.cluster.config import LoadOptions
    from specexport_runtime.cluster.replica import open_generator

    gen = open_generator(str(tiny_artifacts[KIND]), LoadOptions(threads=1, prefix_cache_bytes=12345), False, tmp_path)
    assert gen.prefix_cache.pool.max_bytes == 12345
