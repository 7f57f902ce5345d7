"""The OpenAI-compatible server, live: uvicorn on a random local port serving the tiny int8
self-draft artifact, with the official `openai` client and raw HTTP. Outputs are compared with
in-process generation by a second, independently loaded generator (and with target-only decoding)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import statistics
import threading
import time

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server_support import KEY, LiveServer, Spy, SseStream, get, metric_sum, metric_values, post  # noqa: E402

from specexport_runtime.api import load  # noqa: E402

KIND = "int8"  # a draft model that agrees often: rounds accept several tokens
MAX_BODY = 64 * 1024
MAX_QUEUE = 4
CHAT = "/v1/chat/completions"
PROMPTS = [
    "Write a function that adds two numbers.",
    "The quick brown fox",
    "for i in range(10): print(i)",
    '{"name": "specexport", "items": [1, 2, 3]}',
]
PROPOSERS = ["draft", "hybrid", "ngram", "suffix", "none"]


def msgs(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


@pytest.fixture(scope="module")
def served(tiny_artifacts):
    gen = load(tiny_artifacts[KIND], threads=1)
    spy = Spy(gen)
    server = LiveServer(gen, api_key=KEY, max_queue=MAX_QUEUE, max_body_bytes=MAX_BODY)
    server.spy = spy
    yield server
    server.close()


@pytest.fixture(scope="module")
def ref(tiny_artifacts):
    """In-process generation: the reference the server's output must equal."""
    return load(tiny_artifacts[KIND], threads=1)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(served):
    return served.state.model


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
    """temperature > 0 with a seed: the server draws what in-process generation draws."""
    r = client.chat.completions.create(
        model=model,
        messages=msgs(PROMPTS[3]),
        max_tokens=30,
        temperature=0.8,
        top_p=0.9,
        seed=1234,
        extra_body={"proposer": "draft"},
    )
    mine = ref.chat(msgs(PROMPTS[3]), max_new_tokens=30, temperature=0.8, top_p=0.9, seed=1234, proposer="draft")
    assert r.choices[0].message.content == mine.text
    assert r.model_extra["speculative"]["gamma_policy"] == "fixed (seeded sampling)"


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


# --- bad input: one test each, OpenAI error JSON naming the field, never a 500 ----------------------
def _chat(**fields):
    return {"messages": msgs("hi"), "max_tokens": 4, "temperature": 0, **fields}


BAD = {
    "malformed_json": (None, b'{"messages": [', 400, None, "invalid_json"),
    "json_not_object": (None, b"[1, 2]", 400, None, "invalid_type"),
    "json_nan": (
        None,
        b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
        400,
        None,
        "invalid_json",
    ),
    "empty_body": (None, b"", 400, None, "invalid_json"),
    "deeply_nested_json": (None, b"[" * 60_000, 400, None, "invalid_json"),
    "invalid_utf8": (None, b'{"messages": "\xff\xfe"}', 400, None, "invalid_json"),
    "messages_missing": ({"max_tokens": 4}, None, 400, "messages", "missing_required_parameter"),
    "messages_wrong_type": ({"messages": "hello"}, None, 400, "messages", "invalid_type"),
    "messages_empty": ({"messages": []}, None, 400, "messages", "invalid_value"),
    "message_not_object": ({"messages": ["hi"]}, None, 400, "messages[0]", "invalid_type"),
    "unknown_role": (
        {"messages": [{"role": "wizard", "content": "x"}]},
        None,
        400,
        "messages[0].role",
        "invalid_value",
    ),
    "content_wrong_type": (
        {"messages": [{"role": "user", "content": 5}]},
        None,
        400,
        "messages[0].content",
        "invalid_type",
    ),
    "image_part": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        None,
        400,
        "messages[0].content[0].type",
        "unsupported_parameter",
    ),
    "lone_surrogate": (
        None,
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        400,
        "messages[0].content",
        "invalid_value",
    ),
    "max_tokens_zero": (_chat(max_tokens=0), None, 400, "max_tokens", "invalid_value"),
    "max_tokens_string": (_chat(max_tokens="10"), None, 400, "max_tokens", "invalid_type"),
    "max_tokens_past_context": (_chat(max_tokens=10_000), None, 400, "max_tokens", "context_length_exceeded"),
    "max_completion_tokens_past_context": (
        _chat(max_tokens=None, max_completion_tokens=300),
        None,
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    "temperature_negative": (_chat(temperature=-0.5), None, 400, "temperature", "invalid_value"),
    "temperature_string": (_chat(temperature="hot"), None, 400, "temperature", "invalid_type"),
    "top_p_zero": (_chat(top_p=0), None, 400, "top_p", "invalid_value"),
    "top_p_above_one": (_chat(top_p=1.5), None, 400, "top_p", "invalid_value"),
    "seed_negative": (_chat(seed=-1), None, 400, "seed", "invalid_value"),
    "stream_not_bool": (_chat(stream="yes"), None, 400, "stream", "invalid_type"),
    "stream_options_without_stream": (
        _chat(stream_options={"include_usage": True}),
        None,
        400,
        "stream_options",
        "invalid_value",
    ),
    "stop_too_many": (_chat(stop=["a", "b", "c", "d", "e"]), None, 400, "stop", "invalid_value"),
    "stop_empty_string": (_chat(stop=[""]), None, 400, "stop[0]", "invalid_value"),
    "n_two": (_chat(n=2), None, 400, "n", "unsupported_parameter"),
    "top_logprobs_21": (_chat(logprobs=True, top_logprobs=21), None, 400, "top_logprobs", "invalid_value"),
    "top_logprobs_without_logprobs": (_chat(top_logprobs=3), None, 400, "top_logprobs", "invalid_value"),
    "logprobs_not_bool": (_chat(logprobs=3), None, 400, "logprobs", "invalid_type"),
    "tool_without_type": (_chat(tools=[{"function": {"name": "f"}}]), None, 400, "tools[0]", "invalid_value"),
    "tool_bad_name": (
        _chat(tools=[{"type": "function", "function": {"name": "no spaces"}}]),
        None,
        400,
        "tools[0].function.name",
        "invalid_value",
    ),
    "tool_bad_parameters": (
        _chat(
            tools=[
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "strin"}}}},
                }
            ]
        ),
        None,
        400,
        "tools[0].function.parameters",
        "invalid_value",
    ),
    "tool_choice_unknown_function": (
        _chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        ),
        None,
        400,
        "tool_choice.function.name",
        "invalid_value",
    ),
    "tool_choice_without_tools": (_chat(tool_choice="required"), None, 400, "tool_choice", "invalid_value"),
    "parallel_tool_calls_not_bool": (
        _chat(tools=[{"type": "function", "function": {"name": "f"}}], parallel_tool_calls="no"),
        None,
        400,
        "parallel_tool_calls",
        "invalid_type",
    ),
    "tool_message_without_call_id": (
        {"messages": [{"role": "tool", "content": "x"}]},
        None,
        400,
        "messages[0].tool_call_id",
        "invalid_type",
    ),
    "response_format_unknown_type": (
        _chat(response_format={"type": "xml"}),
        None,
        400,
        "response_format",
        "invalid_value",
    ),
    "response_format_invalid_schema": (
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}},
            }
        ),
        None,
        400,
        "response_format",
        "invalid_value",
    ),
    "response_format_without_schema": (
        _chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        None,
        400,
        "response_format.json_schema",
        "invalid_value",
    ),
    "response_format_with_tools": (
        _chat(response_format={"type": "json_object"}, tools=[{"type": "function", "function": {"name": "f"}}]),
        None,
        400,
        "response_format",
        "invalid_value",
    ),
    "functions": (_chat(functions=[{"name": "f"}]), None, 400, "functions", "unsupported_parameter"),
    "presence_penalty": (_chat(presence_penalty=0.5), None, 400, "presence_penalty", "unsupported_parameter"),
    "unknown_field": (_chat(frobnicate=1), None, 400, "frobnicate", "unknown_parameter"),
    "unknown_proposer": (_chat(proposer="magic"), None, 400, "proposer", "invalid_value"),
    "gamma_out_of_range": (_chat(gamma=99), None, 400, "gamma", "invalid_value"),
    "prompt_longer_than_context": (
        {"messages": msgs("lorem ipsum dolor " * 200)},
        None,
        400,
        "messages",
        "context_length_exceeded",
    ),
    "unknown_model": (_chat(model="gpt-4o"), None, 404, "model", "model_not_found"),
    "oversized_body": ({"messages": msgs("x" * (MAX_BODY + 10))}, None, 413, None, "request_too_large"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_chat_input(served, case):
    body, raw, status, param, code = BAD[case]
    got, headers, data = post(served.port, CHAT, body, raw=raw)
    assert got == status, data
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
    assert data["error"]["param"] == param and data["error"]["code"] == code
    assert data["error"]["message"] and "Traceback" not in data["error"]["message"]
    assert headers["content-type"] == "application/json"


BAD_COMPLETION = {
    "prompt_missing": ({"max_tokens": 4}, 400, "prompt", "missing_required_parameter"),
    "prompt_empty": ({"prompt": ""}, 400, "prompt", "invalid_value"),
    "prompt_batch": ({"prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
    "prompt_wrong_type": ({"prompt": {"text": "a"}}, 400, "prompt", "invalid_type"),
    "token_id_outside_vocabulary": ({"prompt": [5, 99999]}, 400, "prompt", "invalid_value"),
    "token_ids_longer_than_context": ({"prompt": [5] * 256}, 400, "prompt", "context_length_exceeded"),
    "echo": ({"prompt": "a", "echo": True}, 400, "echo", "unsupported_parameter"),
    "max_completion_tokens_is_chat_only": (
        {"prompt": "a", "max_completion_tokens": 3},
        400,
        "max_completion_tokens",
        "unknown_parameter",
    ),
    "response_format_invalid_schema": (
        {
            "prompt": "a",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}},
            },
        },
        400,
        "response_format",
        "invalid_value",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_COMPLETION))
def test_bad_completion_input(served, case):
    body, status, param, code = BAD_COMPLETION[case]
    got, _, data = post(served.port, "/v1/completions", body)
    assert (got, data["error"]["param"], data["error"]["code"]) == (status, param, code), data


@pytest.mark.parametrize("key", [None, "wrong-key", KEY[:-1], KEY + "x"])
def test_missing_or_wrong_api_key_is_401(served, key):
    got, _, data = post(served.port, CHAT, _chat(), key=key)
    assert got == 401 and data["error"]["code"] == "invalid_api_key"


def test_wrong_auth_scheme_is_401(served):
    got, _, data = post(served.port, CHAT, _chat(), key=None, extra_headers={"Authorization": f"Basic {KEY}"})
    assert got == 401 and data["error"]["code"] == "invalid_api_key"


def test_declared_oversized_body_is_413_before_reading(served):
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=10)
    try:
        conn.putrequest("POST", CHAT)
        for k, v in {
            "Authorization": f"Bearer {KEY}",
            "Content-Type": "application/json",
            "Content-Length": str(MAX_BODY * 100),
        }.items():
            conn.putheader(k, v)
        conn.endheaders()  # no body sent: the answer comes from the header alone
        resp = conn.getresponse()
        assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "request_too_large"
    finally:
        conn.close()


def test_unknown_route_and_method_are_json_errors(served):
    status, body = get(served.port, "/v1/nothing")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    status, body = get(served.port, CHAT)
    assert status == 405 and json.loads(body)["error"]["code"] == "method_not_allowed"


def test_server_still_serves_after_bad_input(served, client, model):
    metrics = metric_values(get(served.port, "/metrics")[1])
    assert metric_sum(metrics, "specexport:requests_rejected_total") >= len(BAD)
    r = client.chat.completions.create(model=model, messages=msgs("hi"), max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


# --- load -------------------------------------------------------------------------------------------
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
