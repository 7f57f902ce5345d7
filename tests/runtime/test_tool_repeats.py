"""Repeated parallel tool calls: the tiny model, sampled with a seed found here to repeat a
parameterless call, on the batch scheduler."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance")

from specexport_runtime.api import load  # noqa: E402

KIND = "noisy-fused-batch4"
PING = {
    "type": "function",
    "function": {"name": "ping", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
CALL = '{"name": "ping", "arguments": {}}'
MAX_TOKENS = 120
MESSAGES = [{"role": "user", "content": "hello"}]


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
