"""specexport bench on tiny artifacts (seconds in all): the order and counts of the runs, the warm-up
outside the measured set, acceptance, speedup and latency percentiles of a self-draft report, its
JSON / text / markdown outputs, the exactness caveats of quantized targets, bad arguments and the
plots. Other proposers, sampling and --constrained are in test_bench_modes.py, calibrate in
test_calibrate.py, the CLI in test_bench_cli.py."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from bench_support import NEW, PROMPTS

from specexport.bench.plots import write_plots
from specexport.bench.prompts import Prompt
from specexport.bench.report import BenchReport
from specexport.bench.run import QUANT_CAVEAT, run_bench
from specexport.cli.bench import parse_gammas
from specexport_runtime.api import load


@pytest.fixture(scope="module")
def self_report(tiny_artifacts) -> BenchReport:
    return run_bench(tiny_artifacts["self"], PROMPTS, gammas=[None, 3], repeats=2)


def test_run_counts_and_order(self_report):
    runs = self_report.runs
    assert len(runs) == len(PROMPTS) * 2 * 3  # prompts x repeats x (off + 2 gammas)
    rounds = [[r.label for r in runs[i : i + 3]] for i in range(0, len(runs), 3)]
    # prompts outer, repeats inner; every configuration once per round, rotated by one each round
    assert [(r.prompt_id, r.repeat) for r in runs[::3]] == [(p.id, rep) for p in PROMPTS for rep in (0, 1)]
    assert all(
        {(r.prompt_id, r.repeat) for r in runs[i : i + 3]} == {(runs[i].prompt_id, runs[i].repeat)}
        for i in range(0, len(runs), 3)
    )
    assert rounds[:4] == [
        ["off", "adaptive", "3"],
        ["adaptive", "3", "off"],
        ["3", "off", "adaptive"],
        ["off", "adaptive", "3"],
    ]


def test_warm_up_is_outside_the_set_and_every_run_starts_with_an_empty_store(tiny_artifacts):
    """Every generation of a bench run, as the generator sees it: the first ones (one per
    configuration) are the harness's warm-up prompt, no measured prompt; the suffix store of
    earlier answers is empty before each, although generations fill it (with repeats, a kept
    store would hand a prompt its own earlier answer)."""
    from specexport.bench.harness import warmup_case

    gen = load(tiny_artifacts["ngram"])
    store = gen.learned("suffix")
    calls = []
    generate = gen.generate

    def observed(prompt, config=None, **overrides):
        before = len(store.store.responses)
        result = generate(prompt, config, **overrides)
        calls.append((tuple(prompt), before, len(store.store.responses)))
        return result

    gen.generate = observed
    copy = Prompt(id="t-rep", domain="copy_edit", messages=None, text="40 41 42 43 44 " * 4, max_new_tokens=NEW)
    report = run_bench(gen, [copy, PROMPTS[1]], proposer="suffix", gammas=[None, 3], repeats=2)
    warm = warmup_case(gen.codec).ids
    measured = {tuple(r.prompt_ids) for r in report.runs}
    assert len(measured) == 2 and warm not in measured
    assert [ids for ids, _, _ in calls[:3]] == [warm] * 3  # off, adaptive, 3
    assert [ids for ids, _, _ in calls[3:]] == [tuple(r.prompt_ids) for r in report.runs]
    assert all(before == 0 for _, before, _ in calls), [c[1] for c in calls]
    assert any(after > 0 for _, _, after in calls[3:])  # the store does fill: the check above can fail


def test_counting_invariants(self_report):
    for r in self_report.runs:
        assert r.new_tokens == len(r.token_ids) == len(r.token_times) <= NEW
        if r.mode == "off":
            assert r.drafted == r.rounds == 0 and r.round_sizes == []
            assert r.plain_steps + 1 >= r.new_tokens
            continue
        assert sum(r.drafted_at) == r.drafted == sum(k for k, _ in r.round_sizes)
        assert sum(r.accepted_at) == r.accepted == sum(n for _, n in r.round_sizes)
        assert r.corrections + r.bonus == r.rounds == len(r.round_sizes)
        assert 1 + sum(n + 1 for _, n in r.round_sizes) + r.plain_steps >= r.new_tokens
        assert r.accepted <= r.drafted
        if r.gamma is not None:
            assert all(k <= r.gamma for k, _ in r.round_sizes)
        lat = r.token_latencies()
        assert len(lat) == r.new_tokens - 1
        assert math.isclose(sum(lat), r.token_times[-1] - r.token_times[0], rel_tol=1e-9, abs_tol=1e-12)


def test_self_draft_accepts_everything(self_report):
    assert self_report.config(3).acceptance.drafted > 0
    for c in self_report.configs:
        a = c.acceptance
        if a.drafted == 0:  # the adaptive controller may find speculation not worth it on a tiny model
            assert a.acceptance_rate is None and c.theoretical["speedup"] is None
            continue
        assert a.acceptance_rate == 1.0 and a.alpha == 1.0
        assert all(p == 1.0 for p in a.per_position)
        assert all(p in (1.0, None) for p in a.per_position_conditional)
        assert sum(a.accepted_histogram) == a.rounds
        assert a.tokens_per_target_call >= 1.0
        for d in c.by_domain.values():
            assert d["acceptance_rate"] in (1.0, None)
    assert self_report.config(3).acceptance.mean_accepted_per_round == pytest.approx(3.0, abs=0.5)


def test_speedup_and_percentiles(self_report):
    off = self_report.off
    for c in self_report.configs:
        assert c.speedup == pytest.approx(c.on.tokens_per_second / off.tokens_per_second)
        lo, hi = c.speedup_ci95
        assert 0 < lo <= hi
        th = c.theoretical
        if c.acceptance.drafted:
            assert th["speedup"] > 0 and c.efficiency == pytest.approx(c.speedup / th["speedup"])
            assert th["expected_tokens"] == pytest.approx(th["gamma"] + 1)  # alpha = 1
        assert 0.0 <= c.draft_time_share < 1.0
        assert set(c.by_domain) == {"code", "chat", "copy_edit"} and len(c.by_prompt) == len(PROMPTS)
        for d in c.by_domain.values():  # per-domain efficiency and equivalence (greedy, exact target)
            assert d["identical_share"] == 1.0
            if d["theoretical"]:
                assert d["efficiency"] == pytest.approx(d["speedup"] / d["theoretical"])
    for mode in [off] + [c.on for c in self_report.configs]:
        for pct in (mode.e2e_seconds, mode.token_latency_seconds):
            assert 0 <= pct["p50"] <= pct["p90"] <= pct["p99"]
    mem = self_report.memory
    assert 0 < mem["draft_bytes"] < mem["total_bytes"] and mem["draft_share"] == pytest.approx(0.5, abs=0.05)


def test_greedy_equivalence(self_report):
    for c in self_report.configs:
        assert c.equivalence["share"] == 1.0 and c.equivalence["divergences"] == []
        assert c.equivalence["prompts"] == len(PROMPTS) and c.quality is None
    assert self_report.caveats == []  # fp32 target


def test_report_outputs(self_report):
    data = json.loads(json.dumps(self_report.to_dict(), allow_nan=False))
    assert {"meta", "lengths", "off", "configs", "memory", "costs", "exactness", "runs"} <= set(data)
    assert data["meta"]["prompts"] == len(PROMPTS) and data["meta"]["domains"] == {"code": 2, "chat": 1, "copy_edit": 1}
    text = "\n".join(self_report.summary_lines())
    for word in (
        "target",
        "proposer",
        "gamma",
        "sampling",
        "prompts",
        "lengths",
        "acceptance",
        "per-token",
        "draft overhead",
        "memory",
        "equivalence",
    ):
        assert word in text, word
    from specexport.bench.machine import cpu_model

    assert (
        data["meta"]["machine"]["cpu"] == cpu_model() and f"machine     {cpu_model()}," in text
    )  # closing notes name the CPU
    assert "| on[3] |" in self_report.to_markdown()
    assert list(data["runs"][0]) == [
        "prompt_id",
        "domain",
        "mode",
        "gamma",
        "repeat",
        "seed",
        "prompt_tokens",
        "new_tokens",
        "finish_reason",
        "total_seconds",
        "prefill_seconds",
        "draft_seconds",
        "target_seconds",
        "tokens_per_second",
        "rounds",
        "plain_steps",
        "drafted",
        "accepted",
        "corrections",
        "bonus",
        "lookup_rounds",
        "by_source",
    ]


def test_run_records_wrap_the_generation_stats(self_report):
    """A RunRecord keeps its generation's GenerationStats and reads the counters from it."""
    from specexport_runtime.generator import GenerationStats

    for r in self_report.runs:
        assert isinstance(r.stats, GenerationStats)
        assert (r.new_tokens, r.drafted, r.round_sizes) == (r.stats.new_tokens, r.stats.drafted, r.stats.round_sizes)
        assert r.summary()["tokens_per_second"] == r.stats.tokens_per_second
    with pytest.raises(AttributeError):
        self_report.runs[0].new_tokens = 0  # a view of the stats, not a copy to edit


def _equivalence_line(report) -> str:
    return next(line for line in report.summary_lines() if "equivalence (greedy)" in line)


def test_bitwise_quantized_target_no_caveat(tiny_artifacts):
    """An int4 target built with exactness bitwise (a fused graph: padded attention, or padded
    calls where this CPU's 1-row attention path differs): the equivalence line names the padding
    the build measured, greedy on equals off, and no caveat."""
    report = run_bench(tiny_artifacts["int4-target"], PROMPTS[:1], gammas=[2], repeats=1, max_new_tokens=6)
    assert report.meta["target"]["precision"] == "int4" and report.caveats == []
    assert report.configs[0].equivalence["share"] == 1.0
    data = json.loads(json.dumps(report.to_dict(include_runs=False), allow_nan=False))
    padding = "padded attention" if data["exactness"]["cache_pad"] == 1 else "padded calls"
    assert _equivalence_line(report).endswith(
        f"; target exactness bitwise (rows do not depend on call size; {padding})"
    )
    assert data["exactness"]["class"] == "bitwise"
    assert (data["exactness"]["rows"]["min_rows"], data["exactness"]["cache_pad"]) in [(1, 1), (2, 0)]


def test_numerical_quantized_target_caveat(tiny_artifacts):
    """A quantized precision whose rows were measured numerical (the fp32 n-gram artifact's
    own measurement, relabelled int4) gets the caveat and the measurement on the line."""
    gen = load(tiny_artifacts["ngram-numerical"])
    rows = gen.manifest.target.validation["rows"]
    assert gen.manifest.target.exactness == "numerical" == rows["exactness"]
    fp32 = run_bench(gen, PROMPTS[:1], gammas=[2], repeats=1, max_new_tokens=6)
    assert fp32.caveats == []  # numerical, but not quantized
    gen.manifest = replace(gen.manifest, target=replace(gen.manifest.target, precision="int4"))
    report = run_bench(gen, PROMPTS[:1], gammas=[2], repeats=1, max_new_tokens=6)
    assert report.caveats == [QUANT_CAVEAT.format(precision="int4", exactness="numerical")]
    assert "call sizes" in report.caveats[0] and "target.exactness: bitwise" in report.caveats[0]
    assert _equivalence_line(report).endswith(
        f"; target exactness numerical (rows differ between call sizes by up to {rows['max_abs_diff']:.2g}, "
        "argmax agreement 100%)"
    )
    assert report.to_dict()["exactness"]["rows"]["max_abs_diff"] == rows["max_abs_diff"]
    assert report.runs[0].new_tokens <= 6


def test_unmeasured_quantized_target_caveat(tiny_artifacts):
    """An older artifact (no exactness, no validation.rows) with a quantized target."""
    gen = load(tiny_artifacts["ngram-numerical"])
    target = replace(gen.manifest.target, precision="dynamic-int8", exactness=None, validation={})
    gen.manifest = replace(gen.manifest, target=target)
    report = run_bench(gen, PROMPTS[:1], gammas=[2], repeats=1, max_new_tokens=6)
    assert report.caveats == [QUANT_CAVEAT.format(precision="dynamic-int8", exactness="not measured")]
    assert _equivalence_line(report).endswith("; target exactness not measured")
    assert report.to_dict()["exactness"] == {"class": None, "min_rows": 1, "cache_pad": 0, "rows": None}  # unpadded


def test_bad_arguments(tiny_artifacts):
    from specexport.bench.report import BenchError

    with pytest.raises(BenchError):
        run_bench(tiny_artifacts["self"], [], repeats=1)
    with pytest.raises(BenchError):
        run_bench(tiny_artifacts["self"], PROMPTS, gammas=[0], repeats=1)
    with pytest.raises(Exception, match="draft"):
        run_bench(tiny_artifacts["ngram"], PROMPTS, proposer="draft", repeats=1)
    assert parse_gammas("2,4,adaptive") == [2, 4, None]


def test_plots(self_report, tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed: pip install 'specexport[plot]' to test plots")
    paths = write_plots(self_report, tmp_path / "plots")
    assert [p.name for p in paths] == [
        "latency_cdf.png",
        "accepted_length.png",
        "acceptance_by_position.png",
        "speedup_by_domain.png",
    ]
    for p in paths:
        data = p.read_bytes()
        assert len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"
