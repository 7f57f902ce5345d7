"""`specexport bench --constrained`: constrained target-only against constrained speculation.

Every prompt carries a constraint (prompts.Prompt: a JSON Schema, or tools with tool_choice);
both modes decode under the same grammar (structured.py), so greedy outputs must be identical,
and each output is checked: a schema answer must parse and validate (jsonschema), a tools answer
must be at least one tool call whose arguments validate against that tool's parameters. The
summary adds, per configuration, how many answers were valid and what share of the generated
tokens the grammar forced (drafted for free, GenerationStats.forced_accepted).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from specexport_runtime.structured import Grammar

from ..errors import SpecExportError
from . import harness


class ConstrainedError(SpecExportError, ValueError):
    """--constrained over a prompt that carries no constraint."""


def grammars(codec, cases: Sequence[harness.Case]) -> dict[str, Grammar]:
    """case id -> its grammar; ConstrainedError naming the first unconstrained prompt."""
    out = {}
    for case in cases:
        p = case.prompt
        if p is None or not p.constrained:
            raise ConstrainedError(
                f"--constrained: prompt {case.id!r} carries no 'schema' or 'tools'"
                " (the structured_json set has 32 that do)"
            )
        out[case.id] = Grammar.json_schema(p.schema) if p.schema is not None else harness.tool_plan(codec, p).grammar()
    return out


def valid(codec, prompt, token_ids: Sequence[int]) -> bool:
    """Whether an answer meets its prompt's constraint as a user would check it."""
    import jsonschema

    text = codec.decode(list(token_ids))
    try:
        if prompt.schema is not None:
            jsonschema.validate(json.loads(text), prompt.schema)
            return True
        _, calls = harness.tool_plan(codec, prompt).parse(text)
        params = {t["function"]["name"]: t["function"].get("parameters") or {} for t in prompt.tools}
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), params[call.name])
        return bool(calls)
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def summarize(codec, runs: Sequence, cases: Sequence[harness.Case]) -> dict:
    """Per configuration label: answers valid / runs, and the share of generated tokens forced."""
    prompts = {c.id: c.prompt for c in cases}
    out: dict[str, dict] = {}
    for r in runs:
        entry = out.setdefault(r.label, {"runs": 0, "valid": 0, "tokens": 0, "forced_accepted": 0, "forced": 0})
        entry["runs"] += 1
        entry["valid"] += valid(codec, prompts[r.prompt_id], r.token_ids)
        entry["tokens"] += len(r.token_ids)
        entry["forced_accepted"] += r.stats.forced_accepted
        entry["forced"] += r.stats.forced
    for entry in out.values():
        entry["valid_share"] = entry["valid"] / entry["runs"] if entry["runs"] else 0.0
        entry["forced_share"] = entry["forced_accepted"] / entry["tokens"] if entry["tokens"] else 0.0
    return out


def lines(summary: dict) -> list[str]:
    return [
        f"  constrained {label:<10} {e['valid']}/{e['runs']} valid, forced tokens {e['forced_share']:.0%}"
        f" of the output ({e['forced_accepted']} kept of {e['forced']} drafted)"
        for label, e in summary.items()
    ]
