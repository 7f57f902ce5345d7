"""Parallel tool calls end at the first call that repeats an earlier one (tools.py): a model that
repeats itself used to write identical calls until its own end or max_tokens. The tiny model,
sampled with a seed found here to repeat a parameterless call, is served by the batch-1 and the
batching server; each answers the one call, finish_reason tool_calls, and stops generating at
the repeat (fewer tokens than the unstopped generation)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

from test_server_support import KEY, LiveServer, SseStream, post  # noqa: E402

from specexport_runtime.api import load  # noqa: E402
from specexport_runtime.tools import ToolPlan  # noqa: E402

KIND = "noisy-fused-batch4"
PING = {
    "type": "function",
    "function": {"name": "ping", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
CALL = '{"name": "ping", "arguments": {}}'
MAX_TOKENS = 120
MESSAGES = [{"role": "user", "content": "hello"}]


def test_parse_keeps_the_calls_before_the_first_repeat():
    tools = [PING, {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    plan = ToolPlan.create(tools, "required", False, True)
    add1, add2 = '{"name": "add", "arguments": {"a": 1}}', '{"name": "add", "arguments": {"a": 2}}'
    whole = '{"tool_calls": [' + ", ".join([add1, add2, CALL, add2, CALL]) + "]}"
    _, calls = plan.parse(whole)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1}), ("add", {"a": 2}), ("ping", {})]
    cut = '{"tool_calls": [' + ", ".join([add1, add2, add1]) + ', {"na'
    assert [json.loads(c.arguments) for c in plan.parse(cut)[1]] == [{"a": 1}, {"a": 2}]
    assert plan.repeats(cut) and plan.repeats('{"tool_calls": [' + add1 + ", " + add1)
    assert not plan.repeats('{"tool_calls": [' + add1 + ", " + add2 + ", " + add1[:-1])  # not complete yet
    assert not ToolPlan.create(tools, "required", False, False).multiple  # one call at most: nothing can repeat


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    from tiny import build_tiny_artifact

    return build_tiny_artifact(tmp_path_factory.mktemp("repeats"), KIND, max_context=1024)


@pytest.fixture(scope="module")
def seed(artifact) -> tuple[int, int]:
    """(a seed whose sampled answer repeats the call, the tokens that answer took without a stop)."""
    gen = load(artifact, threads=1)
    chat = gen.prepare_chat(MESSAGES, [PING], "required", True)
    for seed in range(64):
        r = gen.generate(chat.ids, max_new_tokens=MAX_TOKENS, temperature=1.0, seed=seed, grammar=chat.grammar)
        if r.text.count(CALL) >= 2:
            return seed, len(r.token_ids)
    pytest.fail("no seed in 0..63 makes the tiny model repeat the call")


@pytest.fixture(scope="module", params=[1, 4], ids=["batch-1", "batching"])
def served(request, artifact):
    server = LiveServer(load(artifact, threads=1, batch=request.param > 1), api_key=KEY, max_batch=request.param)
    yield server
    server.close()


def body(seed: int, **extra) -> dict:
    return {
        "messages": MESSAGES,
        "tools": [PING],
        "tool_choice": "required",
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": seed,
        **extra,
    }


def test_a_repeated_call_ends_the_answer_and_the_generation(served, seed):
    seed, unstopped = seed
    status, _, reply = post(served.port, "/v1/chat/completions", body(seed))
    assert status == 200, reply
    choice = reply["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("ping", {})]
    assert choice["finish_reason"] == "tool_calls"
    # stopped at the second call: at most one more call's tokens than the first call took
    assert reply["usage"]["completion_tokens"] < unstopped
    stream = SseStream(served.port, "/v1/chat/completions", body(seed, stream=True))
    events = [e for e in stream.events() if e != "[DONE]"]
    deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", []) if e["choices"]]
    assert [d["function"]["name"] for d in deltas] == ["ping"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_the_batch_scheduler_takes_a_free_draft_that_the_grammar_cut_to_nothing(artifact, seed):
    """The seeded request above, on the batch scheduler alone: a lookup round whose draft the
    grammar cut to no token used to divide by zero while learning its acceptance (every running
    request then got a 500); it runs to the end and answers as the batch-1 generator does."""
    seed, _ = seed
    gen = load(artifact, threads=1, batch=True)
    chat = gen.prepare_chat(MESSAGES, [PING], "required", True)
    config = gen.configure(max_new_tokens=MAX_TOKENS, temperature=1.0, seed=seed, grammar=chat.grammar)
    scheduler = gen.scheduler(max_running=2)
    seq = scheduler.submit(chat.ids, config)
    while not seq.done:
        scheduler.step()
    solo = load(artifact, threads=1).generate(chat.ids, config)
    assert seq.tokens == solo.token_ids
