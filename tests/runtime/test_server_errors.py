"""The OpenAI-compatible server, live (the tiny int8 server of test_server_support.py): bad input,
one test each: an OpenAI error JSON naming the field, never a 500 (malformed JSON, wrong types and
ranges, unsupported and unknown parameters, bodies past the limit); a missing or wrong API key;
unknown routes and methods; and the server still serves afterwards."""

from __future__ import annotations

import http.client
import json

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from test_server_support import (  # noqa: E402
    CHAT,
    KEY,
    MAX_BODY,
    fixture_client,  # noqa: F401 (this module's `client` fixture)
    fixture_model,  # noqa: F401 (this module's `model` fixture)
    fixture_served,  # noqa: F401 (this module's `served` fixture)
    get,
    metric_sum,
    metric_values,
    msgs,
    post,
)


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
