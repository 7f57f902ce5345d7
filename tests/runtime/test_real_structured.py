"""Constrained decoding on the real default artifact (SmolLM2-135M fp32 target, int8 self-draft,
fused, bitwise): greedy constrained speculation equals constrained target-only for every
proposer, gamma 1..8 and adaptive, and the JSON validates against its schema."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specexport_runtime.api import load
from specexport_runtime.structured import Grammar

pytestmark = pytest.mark.real
pytest.importorskip("llguidance")

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
TOOL = {
    "type": "object",
    "properties": {"location": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "unit"],
    "additionalProperties": False,
}
# ~31 s a case on the real model: the slow pass; tiny-model grammars keep constrained exactness in the default run
CASES = [
    pytest.param(
        "Extract the person as JSON: Maria Lopez is a 34-year-old architect living in Lisbon.",
        PERSON,
        marks=pytest.mark.slow,
    ),
    pytest.param(
        "What is the weather like in Oslo, in celsius? Answer with the arguments of get_weather as JSON.",
        TOOL,
        marks=pytest.mark.slow,
    ),
]


@pytest.fixture(scope="module")
def real_gen(real_artifact):
    return load(real_artifact)


@pytest.mark.parametrize("prompt, schema", CASES, ids=["extract", "tool-args"])
def test_real_constrained_speculation_is_exact_and_valid(real_gen, prompt, schema):
    grammar = Grammar.json_schema(schema)
    messages = [{"role": "user", "content": prompt}]
    base = real_gen.chat(messages, max_new_tokens=64, grammar=grammar, speculative=False)
    assert base.finish_reason == "eos", base.text
    jsonschema.validate(json.loads(base.text), schema)
    for proposer in ("draft", "ngram", "suffix", "hybrid"):
        for gamma in (*range(1, 9), None):  # None: the adaptive controller
            real_gen.forget_history()
            got = real_gen.chat(messages, max_new_tokens=64, grammar=grammar, proposer=proposer, gamma=gamma)
            assert got.token_ids == base.token_ids, (proposer, gamma, got.text, base.text)
            assert got.stats.forced_accepted > 0  # keys, quotes and separators came for free
