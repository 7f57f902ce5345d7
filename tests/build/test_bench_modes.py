"""specexport bench on tiny artifacts beyond the greedy self-draft report: sampling quality, the
hybrid proposer, the suffix proposer (learning across requests with --sequential, its draft limit)
and constrained decoding (--constrained: validity checked, forced tokens counted)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from bench_support import NEW, PROMPTS

from specexport.bench.constrained import ConstrainedError
from specexport.bench.prompts import Prompt
from specexport.bench.run import run_bench
from specexport.cli.bench import bench as bench_cmd


def test_sampling_quality(tiny_artifacts):
    report = run_bench(tiny_artifacts["ngram"], PROMPTS[:2], gammas=[2], repeats=2, temperature=0.8, top_p=0.95, seed=3)
    assert report.meta["proposer"] == "ngram" and report.memory["draft_bytes"] == 0
    c = report.configs[0]
    assert c.equivalence is None
    for q in (c.quality, report.quality_off):
        ll = q["loglik_per_token"]
        assert ll["n"] == 4 and ll["mean"] < 0 and ll["ci95"][0] <= ll["mean"] <= ll["ci95"][1]
        assert 0 <= q["distinct_2"]["mean"] <= 1
    assert set(c.quality["differences"]) == {"loglik_per_token", "output_tokens", "distinct_2"}
    assert "quality" in "\n".join(report.summary_lines())


def test_hybrid_proposer_bench(tiny_artifacts):
    """The hybrid proposer runs the draft model (its memory counts) and stays exact; the
    lookup rounds it served are counted per run and summed per configuration."""
    repeat = Prompt(id="t-rep", domain="copy_edit", messages=None, text="40 41 42 43 44 " * 6, max_new_tokens=NEW)
    report = run_bench(tiny_artifacts["noisy"], PROMPTS[:2] + [repeat], proposer="hybrid", gammas=[3], repeats=1)
    assert report.meta["proposer"] == "hybrid" and report.memory["draft_bytes"] > 0
    c = report.configs[0]
    assert c.equivalence["share"] == 1.0
    on = [r for r in report.runs if r.mode == "on"]
    assert c.acceptance.lookup_rounds == sum(r.lookup_rounds for r in on)
    assert all(0 <= r.lookup_rounds <= r.rounds for r in on)
    with pytest.raises(Exception, match="'hybrid' needs an artifact with a draft model"):
        run_bench(tiny_artifacts["ngram"], PROMPTS[:1], proposer="hybrid", repeats=1)


def test_suffix_bench_sequential_learns_across_requests(tiny_artifacts):
    """--sequential keeps the suffix store from prompt to prompt within a domain, one store per
    configuration: the same prompt asked again later in the sequence is drafted from the earlier
    answer (the last third's speedup measured, its acceptance high); without --sequential every
    run starts empty, so the repeat gains nothing from the first ask. Greedy stays exact."""
    first = Prompt(id="s-1", domain="agentic", messages=None, text="7 150 33 299 12", max_new_tokens=20)
    other = Prompt(id="s-2", domain="agentic", messages=None, text="the quick brown fox", max_new_tokens=20)
    again = replace(first, id="s-3")
    prompts = [first, other, again]
    seq = run_bench(tiny_artifacts["ngram"], prompts, proposer="suffix", gammas=[None, 3], repeats=1, sequential=True)
    ind = run_bench(tiny_artifacts["ngram"], prompts, proposer="suffix", gammas=[None, 3], repeats=1)
    assert seq.meta["sequential"] and not ind.meta["sequential"]
    for report in (seq, ind):
        for c in report.configs:
            assert c.equivalence["share"] == 1.0

    def accepted(report, pid):
        return [r.accepted for r in report.runs if r.prompt_id == pid and r.mode == "on"]

    assert all(a >= 15 for a in accepted(seq, "s-3"))  # its earlier answer, from the store
    assert accepted(ind, "s-3") == accepted(ind, "s-1")  # nothing carried over
    d = seq.configs[0].by_domain["agentic"]
    assert d["last_third_speedup"] > 0 and "first_third_speedup" in d
    assert "last third" in "\n".join(seq.summary_lines())
    assert "scaled x0.5 / x1 / x2, the fastest measured (x0.5 " in "\n".join(seq.summary_lines())  # the tuned limit
    by_source = seq.configs[0].acceptance.by_source
    assert "suffix-store" in by_source and by_source["suffix-store"]["accepted"] > 0


def test_suffix_draft_limit_is_applied_and_reported(tiny_artifacts):
    """run_bench(suffix=SuffixConfig(...)) drafts within the given limit, stays exact, and the
    report carries the setting (meta and the proposer line); a bad value from the CLI is a usage error."""
    from click.testing import CliRunner

    from specexport_runtime.suffix import SuffixConfig

    p = Prompt(id="rep", domain="copy_edit", messages=None, text="a b c d e f g a b c d e f g a b c", max_new_tokens=80)
    report = run_bench(
        tiny_artifacts["ngram"],
        [p],
        proposer="suffix",
        gammas=[8],
        repeats=1,
        suffix=SuffixConfig(max_spec=3, factor=4.0, limit_scales=(1.0,)),
    )
    on = [r for r in report.runs if r.mode == "on"]
    assert report.configs[0].equivalence["share"] == 1.0
    assert 1 <= max(len(r.drafted_at) for r in on) <= 3
    sx = report.meta["suffix"]
    assert (sx["factor"], sx["max_spec"], sx["limit_scales"]) == (4.0, 3, [1.0])
    assert list(sx["tuner"]["tokens_per_second"]) == ["1.0"]
    assert "suffix drafts up to min(3, 4 x match)" in "\n".join(report.summary_lines())
    bad = CliRunner().invoke(bench_cmd, [str(tiny_artifacts["ngram"]), "--suffix-max-spec", "0"])
    assert bad.exit_code == 2 and "max_spec" in bad.output


def test_constrained_bench_checks_validity_and_counts_forced_tokens(tmp_path):
    """--constrained: both modes decode under each prompt's schema or tools; greedy outputs stay
    identical, every answer is checked (json + jsonschema, tool calls), forced tokens are counted.
    (A self-draft artifact with room for the tools' system message.)"""
    pytest.importorskip("llguidance")
    from tiny import build_tiny_artifact

    artifact = build_tiny_artifact(tmp_path / "art", "self", max_context=1024)
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 99}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    tool = {
        "type": "function",
        "function": {
            "name": "ping",
            "parameters": {
                "type": "object",
                "properties": {"host": {"enum": ["a", "b"]}},
                "required": ["host"],
                "additionalProperties": False,
            },
        },
    }
    path = tmp_path / "schema.jsonl"
    lines = [
        {
            "id": "s1",
            "domain": "structured_json",
            "messages": [{"role": "user", "content": "give json"}],
            "max_new_tokens": 30,
            "schema": schema,
        },
        {
            "id": "t1",
            "domain": "structured_json",
            "messages": [{"role": "user", "content": "ping a"}],
            "max_new_tokens": 40,
            "tools": [tool],
            "tool_choice": "required",
        },
    ]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = run_bench(artifact, str(path), proposer="draft", gammas=[4], repeats=1, constrained=True)
    c = report.constrained
    assert set(c) == {"off", "4"} and c["off"]["runs"] == c["4"]["runs"] == 2
    assert c["off"]["valid"] == c["4"]["valid"]  # the same outputs, the same verdicts
    assert c["4"]["forced_accepted"] > 0 and c["off"]["forced"] == 0
    assert 0 < c["4"]["forced_share"] <= 1
    assert report.config(4).equivalence["share"] == 1.0
    assert any(line.startswith("  constrained") for line in report.summary_lines())
    assert report.to_dict()["constrained"]["4"]["valid"] == c["4"]["valid"]
    free = tmp_path / "free.jsonl"
    free.write_text(json.dumps({"id": "f1", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ConstrainedError, match="'f1'"):
        run_bench(artifact, str(free), proposer="draft", gammas=[4], repeats=1, constrained=True)
