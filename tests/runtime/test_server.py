"""The OpenAI-compatible server, live: uvicorn on a random local port serving the tiny int8
self-draft artifact, with the official `openai` client and raw HTTP. Outputs (chat and completions,
streamed and not, greedy and seeded sampling, stop strings, the SSE framing) are compared with
in-process generation by a second, independently loaded generator (and with target-only decoding);
also /v1/models, /health and /metrics. Bad input is in test_server_errors.py, concurrent load in
test_server_load.py; the server and its fixtures are in test_server_support.py."""

from __future__ import annotations

import json
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server_support import (  # noqa: E402
    CHAT,
    PROMPTS,
    PROPOSERS,
    SseStream,
    fixture_client,  # noqa: F401 (this module's `client` fixture)
    fixture_model,  # noqa: F401 (this module's `model` fixture)
    fixture_ref,  # noqa: F401 (this module's `ref` fixture)
    fixture_served,  # noqa: F401 (this module's `served` fixture)
    get,
    metric_sum,
    metric_values,
    msgs,
)


# --- outputs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_chat_greedy_equals_in_process_token_for_token(client, ref, model, proposer):
    """Non-streaming chat, greedy, speculation on: the server's token ids equal in-process
    generation with the same proposer and target-only decoding; usage and the speculative object
    agree with what ran."""
    for text in PROMPTS[:2]:
        r = client.chat.completions.create(
            model=model,
            messages=msgs(text),
            max_tokens=40,
            temperature=0,
            extra_body={"proposer": proposer, "return_token_ids": True},
        )
        mine = ref.chat(msgs(text), max_new_tokens=40, proposer=proposer)
        plain = ref.chat(msgs(text), max_new_tokens=40, speculative=False)
        choice = choice_extra = r.choices[0]
        choice_extra = choice.model_extra
        assert choice_extra["token_ids"] == mine.token_ids == plain.token_ids
        assert choice.message.content == mine.text and choice.message.role == "assistant"
        assert choice.finish_reason == {"eos": "stop", "stop": "stop", "length": "length"}[mine.finish_reason]
        prompt_ids = ref.codec.encode_chat(msgs(text))
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), len(mine.token_ids))
        assert r.usage.total_tokens == len(prompt_ids) + len(mine.token_ids)
        spec = r.model_extra["speculative"]
        assert spec["proposer"] == proposer
        assert spec["gamma_policy"] == ("off" if proposer == "none" else "adaptive")
        by = spec["by_source"]
        assert sum(s["drafted"] for s in by.values()) == spec["drafted"]
        assert sum(s["accepted"] for s in by.values()) == spec["accepted"] <= spec["drafted"]
        assert sum(s["rounds"] for s in by.values()) == spec["rounds"]
        if proposer == "none":
            assert spec["drafted"] == 0 and spec["plain_steps"] == len(mine.token_ids) - 1
        calls = spec["rounds"] + spec["plain_steps"]
        assert spec["mean_accepted_length"] == pytest.approx((spec["accepted"] + calls) / calls)
        assert spec["time_to_first_token_seconds"] > 0 and spec["decode_tokens_per_second"] > 0
        assert len(spec["per_position_acceptance"]) <= 32


def test_speculation_really_drafts_and_accepts(client, model):
    """The int8 self-draft is accepted often: rounds emit several tokens (not only plain steps)."""
    r = client.chat.completions.create(
        model=model,
        messages=msgs(PROMPTS[0]),
        max_tokens=60,
        temperature=0,
        extra_body={"proposer": "draft", "gamma": 4},
    )
    spec = r.model_extra["speculative"]
    assert spec["gamma_policy"] == "fixed" and spec["gamma"] == 4
    assert spec["drafted"] > 0 and spec["accepted"] > 0 and spec["mean_accepted_length"] > 1.5
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"])


def test_chat_stream_with_the_openai_client(client, ref, model):
    """Streaming through the official client: the deltas join to in-process text, the role comes
    first, the finish reason last, then one usage chunk (choices empty) carrying `speculative`."""
    text = PROMPTS[2]
    stream = client.chat.completions.create(
        model=model,
        messages=msgs(text),
        max_tokens=50,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"proposer": "hybrid"},
    )
    chunks = list(stream)
    mine = ref.chat(msgs(text), max_new_tokens=50, proposer="hybrid")
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == mine.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(mine.token_ids)
    assert [c for c in chunks[:-1] if c.usage is not None] == []  # usage in exactly one chunk
    assert chunks[-1].model_extra["speculative"]["proposer"] == "hybrid"
    assert len({c.id for c in chunks}) == 1


def test_stream_equals_non_stream_and_token_ids_stream(served, ref):
    body = {
        "messages": msgs(PROMPTS[1]),
        "max_tokens": 30,
        "temperature": 0,
        "stream": True,
        "return_token_ids": True,
        "proposer": "draft",
    }
    events = SseStream(served.port, CHAT, body).events()
    ids = [t for e in events if isinstance(e, dict) for c in e["choices"] for t in c.get("token_ids", [])]
    assert ids == ref.chat(msgs(PROMPTS[1]), max_new_tokens=30).token_ids


def test_completions_raw_prompt_text_and_token_ids(client, ref, model):
    """/v1/completions: a raw prompt (no chat template), as text and as token ids, streaming and not."""
    prompt = "def add(a, b):"
    mine = ref.generate(prompt, max_new_tokens=24)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == mine.text
    assert r.usage.prompt_tokens == len(ref.codec.encode(prompt))
    ids = ref.codec.encode(prompt)
    r2 = client.completions.create(model=model, prompt=ids, max_tokens=24, temperature=0)
    assert r2.choices[0].text == mine.text
    pieces = [
        c.choices[0].text
        for c in client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        if c.choices
    ]
    assert "".join(pieces) == mine.text
    default = client.completions.create(model=model, prompt=prompt, temperature=0)  # OpenAI's default: 16 tokens
    assert (
        default.usage.completion_tokens <= 16
        and default.choices[0].text == ref.generate(prompt, max_new_tokens=16).text
    )


def test_seeded_sampling_reproduces_in_process(client, ref, model):
    """temperature > 0 with a seed: the server draws what in-process generation draws, and what
    the target alone draws (seeded noise: independent of speculation, so gamma stays adaptive)."""
    r = client.chat.completions.create(
        model=model,
        messages=msgs(PROMPTS[3]),
        max_tokens=30,
        temperature=0.8,
        top_p=0.9,
        seed=1234,
        extra_body={"proposer": "draft"},
    )
    kw = dict(max_new_tokens=30, temperature=0.8, top_p=0.9, seed=1234)
    mine = ref.chat(msgs(PROMPTS[3]), proposer="draft", **kw)
    alone = ref.chat(msgs(PROMPTS[3]), speculative=False, **kw)
    assert r.choices[0].message.content == mine.text == alone.text
    assert r.model_extra["speculative"]["gamma_policy"] == "adaptive"


def test_stop_string(client, ref, model):
    full = ref.chat(msgs(PROMPTS[0]), max_new_tokens=40).text
    stop = full[10:13]
    assert stop and stop in full
    r = client.chat.completions.create(
        model=model, messages=msgs(PROMPTS[0]), max_tokens=40, temperature=0, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == ref.chat(msgs(PROMPTS[0]), max_new_tokens=40, stop=(stop,)).text
    assert stop not in r.choices[0].message.content


def test_sse_framing_line_by_line(served):
    """Raw bytes: `data: {json}` lines each followed by an empty line; role chunk, content chunks,
    finish chunk (with speculative, and usage when no usage chunk is asked for), usage chunk, [DONE]."""
    for include_usage in (True, False):
        body = {"messages": msgs(PROMPTS[0]), "max_tokens": 20, "temperature": 0, "stream": True}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        s = SseStream(served.port, CHAT, body)
        assert s.resp.status == 200
        assert s.resp.getheader("content-type").startswith("text/event-stream")
        events = s.events()
        assert events[-1] == "[DONE]" and s.lines[-3:] == [b"data: [DONE]\n", b"\n", b""]  # then the stream ends
        assert s.lines[0::2][:-1] == [line for line in s.lines if line.startswith(b"data: ")]  # data, blank, data, ...
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        tail = 2 if include_usage else 1
        middle, final = chunks[1:-tail], chunks[-tail]
        assert middle and all(
            set(c["choices"][0]["delta"]) == {"content"} and c["choices"][0]["finish_reason"] is None for c in middle
        )
        assert final["choices"][0]["delta"] == {} and final["choices"][0]["finish_reason"] == "length"
        assert "speculative" in final
        if include_usage:
            assert all(c["usage"] is None for c in chunks[:-1])
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20
        else:
            assert final["usage"]["completion_tokens"] == 20
            assert all("usage" not in c for c in chunks[:-1])


def test_models_health_and_auth(served, model):
    status, body = get(served.port, "/v1/models")
    data = json.loads(body)
    assert status == 200 and [m["id"] for m in data["data"]] == [model] and data["object"] == "list"
    assert data["data"][0]["max_model_len"] == 256
    assert json.loads(get(served.port, f"/v1/models/{model}")[1])["id"] == model
    status, body = get(served.port, "/health", key=None)  # open without a key
    assert status == 200 and json.loads(body)["status"] == "ok"
    for path in ("/v1/models", "/metrics"):
        status, body = get(served.port, path, key=None)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"


def test_metrics_count_what_the_responses_report(served, client, model):
    """The Prometheus counters move by exactly the figures the responses carry."""
    before = metric_values(get(served.port, "/metrics")[1])
    spec, usage = {"drafted": 0, "accepted": 0, "rounds": 0}, 0
    for proposer in ("draft", "hybrid"):
        r = client.chat.completions.create(
            model=model, messages=msgs(PROMPTS[3]), max_tokens=30, temperature=0, extra_body={"proposer": proposer}
        )
        for k in spec:
            spec[k] += r.model_extra["speculative"][k]
        usage += r.usage.completion_tokens
    after = metric_values(get(served.port, "/metrics")[1])

    def delta(name, **labels):
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    assert delta("specexport:spec_decode_num_draft_tokens_total") == spec["drafted"]
    assert delta("specexport:spec_decode_num_accepted_tokens_total") == spec["accepted"]
    assert delta("specexport:spec_decode_num_drafts_total") == spec["rounds"]
    assert delta("specexport:spec_decode_num_accepted_tokens_per_pos_total") == spec["accepted"]
    assert delta("specexport:generation_tokens_total") == usage
    assert delta("specexport:request_success_total") == 2
    assert delta("specexport:time_to_first_token_seconds_count") == 2
    assert delta("specexport:time_per_output_token_seconds_count") == 2
    assert metric_sum(after, "specexport:num_requests_running") == 0


def test_health_and_metrics_answer_while_a_request_decodes(served):
    """Generation runs off the event loop: /health and /metrics answer mid-generation."""
    served.spy.delay = 0.03
    try:
        s = SseStream(
            served.port,
            CHAT,
            {"messages": msgs(PROMPTS[0]), "max_tokens": 150, "temperature": 0, "stream": True, "proposer": "none"},
        )
        assert s.next_event()["choices"][0]["delta"]["role"] == "assistant"
        t0 = time.monotonic()
        health = json.loads(get(served.port, "/health")[1])
        metrics = metric_values(get(served.port, "/metrics")[1])
        elapsed = time.monotonic() - t0
        assert health["running"] == 1 and metric_sum(metrics, "specexport:num_requests_running") == 1
        assert served.worker.current is not None  # still decoding after both answered
        assert elapsed < 0.5
        served.spy.delay = 0.0  # the rest at full speed
        events = s.events()
        assert events[-1] == "[DONE]"
    finally:
        served.spy.delay = 0.0
