"""Structured output through the live server with the official `openai` client: response_format
(json_schema, json_object), tools and tool_choice (streamed and not), logprobs; a 64-request load
test mixing constrained and free requests whose outputs must equal their sequential runs (no
matcher state leaks between requests). Bad inputs are in test_server_errors.py's BAD table."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

from test_server_support import KEY, LiveServer  # noqa: E402

from specexport_runtime.api import load  # noqa: E402
from specexport_runtime.structured import Grammar  # noqa: E402

KIND = "int8"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
PROMPTS = ["Describe a person.", "The quick brown fox", "for i in range(10): print(i)", "Tell me about Oslo."]


def msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """The tiny int8 self-draft artifact with room for the tools' system message (the tiny
    tokenizer spends about a token per character)."""
    from tiny import build_tiny_artifact

    return build_tiny_artifact(tmp_path_factory.mktemp("structured"), KIND, max_context=1024)


@pytest.fixture(scope="module")
def served(artifact):
    server = LiveServer(load(artifact, threads=1), api_key=KEY, max_queue=64)
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref(artifact):
    return load(artifact, threads=1)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


@pytest.mark.parametrize("proposer", ["draft", "hybrid", "none"])
def test_json_schema_output_validates_and_equals_in_process(client, ref, served, proposer):
    for text in PROMPTS:
        r = client.chat.completions.create(
            model=served.state.model,
            messages=msgs(text),
            max_tokens=80,
            temperature=0,
            response_format=schema_format(PERSON),
            extra_body={"proposer": proposer, "return_token_ids": True},
        )
        choice = r.choices[0]
        mine = ref.chat(msgs(text), max_new_tokens=80, grammar=Grammar.json_schema(PERSON), speculative=False)
        assert choice.model_extra["token_ids"] == mine.token_ids  # constrained target-only
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), PERSON)
        else:  # the tiny model ran out of tokens mid-object: a valid prefix
            assert choice.finish_reason == "length" and choice.message.content.startswith('{"name": "')
        spec = r.model_extra["speculative"]
        assert spec["forced"] >= spec["forced_accepted"] and "grammar_cut" in spec
        if proposer != "none":
            assert spec["forced_accepted"] > 0  # '{"name": "', '", "age": ', ... came for free


def test_json_schema_streamed_joins_to_a_valid_object(client, served):
    chunks = client.chat.completions.create(
        model=served.state.model,
        messages=msgs(PROMPTS[0]),
        max_tokens=80,
        temperature=0,
        response_format=schema_format(PERSON),
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith('{"name": "')


def test_json_object_output_is_an_object(client, served):
    r = client.chat.completions.create(
        model=served.state.model,
        messages=msgs(PROMPTS[3]),
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_tool_calls_come_back_as_tool_calls(client, served, tool_choice):
    r = client.chat.completions.create(
        model=served.state.model,
        messages=msgs("What is 2 + 3?"),
        max_tokens=120,
        temperature=0,
        tools=[WEATHER, ADD],
        tool_choice=tool_choice,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    specs = {"get_weather": WEATHER, "add": ADD}
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), specs[call.function.name]["function"]["parameters"])
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["add"]


def test_parallel_tool_calls_false_gives_one_call_as_in_process(client, served, ref):
    r = client.chat.completions.create(
        model=served.state.model,
        messages=msgs("What is 2 + 3?"),
        max_tokens=200,
        temperature=0,
        tools=[WEATHER, ADD],
        tool_choice="required",
        parallel_tool_calls=False,
        extra_body={"return_token_ids": True},
    )
    mine = ref.chat(
        msgs("What is 2 + 3?"),
        max_new_tokens=200,
        tools=[WEATHER, ADD],
        tool_choice="required",
        parallel_tool_calls=False,
        speculative=False,
    )
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    assert r.choices[0].model_extra["token_ids"] == list(mine.token_ids) and len(mine.tool_calls) == 1


def test_tool_calls_stream_in_the_openai_shape(client, served):
    stream = client.chat.completions.create(
        model=served.state.model,
        messages=msgs("Weather in Oslo?"),
        max_tokens=120,
        temperature=0,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
    )
    calls, finish, content = {}, None, ""
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == "" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])


def test_a_conversation_continues_after_a_tool_result(client, served):
    history = msgs("Weather in Oslo?") + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "celsius"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 3}'},
    ]
    r = client.chat.completions.create(
        model=served.state.model, messages=history, max_tokens=20, temperature=0, tools=[WEATHER], tool_choice="none"
    )
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_logprobs_have_the_openai_shape_and_do_not_depend_on_speculation(client, served):
    got = {}
    for proposer in ("none", "draft"):
        r = client.chat.completions.create(
            model=served.state.model,
            messages=msgs(PROMPTS[1]),
            max_tokens=24,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            extra_body={"proposer": proposer},
        )
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens
        for entry in content:
            assert entry.logprob <= 0 and len(entry.top_logprobs) == 3 and isinstance(entry.bytes, list)
            assert entry.top_logprobs[0].logprob >= entry.logprob  # greedy: the chosen token ranks first
        got[proposer] = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]
    assert got["none"] == got["draft"]
    r = client.completions.create(model=served.state.model, prompt=PROMPTS[1], max_tokens=8, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0


def test_64_mixed_requests_equal_their_sequential_runs(client, served):
    """Constrained and free requests interleaved across 8 client threads: every output equals
    the same request run alone (no matcher or proposer state leaks between requests)."""

    def request(i: int) -> dict:
        kind = i % 4
        extra = {
            "proposer": ["draft", "hybrid", "suffix", "ngram"][i % 4 if i % 8 < 4 else (i + 1) % 4],
            "return_token_ids": True,
        }
        kwargs = dict(
            model=served.state.model,
            messages=msgs(PROMPTS[i % len(PROMPTS)]),
            max_tokens=40,
            temperature=0,
            extra_body=extra,
        )
        if kind == 0:
            kwargs["response_format"] = schema_format(PERSON)
        elif kind == 1:
            kwargs.update(tools=[WEATHER, ADD], tool_choice="required")
        elif kind == 2:
            kwargs["response_format"] = {"type": "json_object"}
        return kwargs

    def run(i: int) -> list[int]:
        return client.chat.completions.create(**request(i)).choices[0].model_extra["token_ids"]

    alone = {i: run(i) for i in range(16)}  # one of each (request shape, prompt) pattern, sequentially
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(run, range(64)))
    for i, tokens in enumerate(together):
        assert tokens == alone[i % 16], i
