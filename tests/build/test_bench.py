"""specexport bench / calibrate on tiny artifacts (seconds in all)."""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from specexport.bench import QUANT_CAVEAT, run_bench
from specexport.bench_constrained import ConstrainedError
from specexport.bench_plots import write_plots
from specexport.bench_report import BenchReport
from specexport.calibrate import calibrate, profile_gamma
from specexport.cli_bench import bench as bench_cmd
from specexport.cli_bench import calibrate as calibrate_cmd
from specexport.cli_bench import parse_gammas
from specexport.prompts import Prompt
from specexport_runtime.api import CALIBRATION_NAME, load
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.manifest import read_manifest, verify_files

NEW = 12
LINES = [
    {"id": "t-code-1", "domain": "code", "text": "def add(a, b):\n", "max_new_tokens": NEW},
    {
        "id": "t-code-2",
        "domain": "code",
        "messages": [{"role": "user", "content": "for i in range(10):"}],
        "max_new_tokens": NEW,
    },
    {
        "id": "t-chat-1",
        "domain": "chat",
        "messages": [{"role": "user", "content": "The quick brown fox"}],
        "max_new_tokens": NEW,
    },
    {"id": "t-copy-1", "domain": "copy_edit", "text": '{"name": "specexport", "version": 1}', "max_new_tokens": NEW},
]
CHEAP_DRAFT = {"decode_s": 1.0, "verify_s": {s: 1.0 for s in range(2, 10)}, "draft_step_s": 0.01}


def _prompt(line: dict) -> Prompt:
    msgs = tuple((m["role"], m["content"]) for m in line["messages"]) if "messages" in line else None
    return Prompt(
        id=line["id"],
        domain=line["domain"],
        messages=msgs,
        text=line.get("text"),
        max_new_tokens=line["max_new_tokens"],
    )


PROMPTS = [_prompt(line) for line in LINES]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "tiny.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def self_report(tiny_artifacts) -> BenchReport:
    return run_bench(tiny_artifacts["self"], PROMPTS, gammas=[None, 3], repeats=2)


@pytest.fixture(scope="module")
def far_artifact(tmp_path_factory) -> Path:
    """A draft from another random seed: it almost never agrees with the target."""
    from tiny import make_model, save_hf_folder, write_recipe

    from specexport.build import build_artifact
    from specexport.recipe import load_recipe

    work = tmp_path_factory.mktemp("tiny-far")
    target = save_hf_folder(make_model(), work / "target-hf")
    draft = save_hf_folder(make_model(seed=7), work / "draft-hf")
    recipe = write_recipe(work / "recipe.yaml", target, {"model": str(draft), "precision": "fp32"}, name="tiny-far")
    build_artifact(load_recipe(recipe), work / "artifact")
    return work / "artifact"


def _copy(artifact: Path, tmp_path: Path) -> Path:
    """Calibration writes into the artifact: never into the session-wide fixtures."""
    return Path(shutil.copytree(artifact, tmp_path / "artifact"))


# --------------------------------------------------------------------------- bench


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
    from specexport.harness import warmup_case

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
    from specexport.machine import cpu_model

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


def _equivalence_line(report) -> str:
    return next(line for line in report.summary_lines() if "equivalence (greedy)" in line)


def test_bitwise_quantized_target_no_caveat(tiny_artifacts):
    """An int4 target built with exactness bitwise (a fused graph: padded attention): the
    equivalence line says so, greedy on equals off, and no caveat."""
    report = run_bench(tiny_artifacts["int4-target"], PROMPTS[:1], gammas=[2], repeats=1, max_new_tokens=6)
    assert report.meta["target"]["precision"] == "int4" and report.caveats == []
    assert report.configs[0].equivalence["share"] == 1.0
    assert _equivalence_line(report).endswith(
        "; target exactness bitwise (rows do not depend on call size; padded attention)"
    )
    data = json.loads(json.dumps(report.to_dict(include_runs=False), allow_nan=False))
    assert data["exactness"]["class"] == "bitwise" and data["exactness"]["cache_pad"] == 1
    assert data["exactness"]["rows"]["min_rows"] == 1


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
    from specexport.bench_report import BenchError

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


# --------------------------------------------------------------------------- calibrate


def test_calibrate_self_picks_largest_gamma(tiny_artifacts, tmp_path):
    art = _copy(tiny_artifacts["self"], tmp_path)
    doc = calibrate(
        art,
        domains=("code", "chat"),
        proposers=["draft"],
        prompts=PROMPTS,
        max_new_tokens=NEW,
        device_name="devA",
        costs=CHEAP_DRAFT,
    )
    prof = doc["profiles"]["devA"]
    assert doc["version"] == 1 and doc["default_profile"] == "devA"
    assert set(prof["domains"]) == {"code", "chat", "default"}
    for entry in (prof["domains"][d]["draft"] for d in ("code", "chat", "default")):
        assert entry["gamma"] == 8 and entry["expected_speedup"] > 1
        assert entry["acceptance_rate"] == 1.0
        assert len(entry["acceptance_by_position"]) == 8 and set(entry["acceptance_by_position"]) <= {1.0, None}
    on_disk = json.loads((art / CALIBRATION_NAME).read_text())
    assert on_disk == json.loads(json.dumps(doc))
    manifest = read_manifest(art)
    assert CALIBRATION_NAME in manifest.files
    verify_files(art, manifest)
    assert not [p for p in art.iterdir() if p.name.endswith(".tmp")]
    assert profile_gamma(on_disk, "code", "draft") == 8 and profile_gamma(on_disk, "unknown", "draft") == 8

    # a second device (measured costs this time) is added beside the first
    doc2 = calibrate(art, domains=("code",), prompts=PROMPTS, max_new_tokens=NEW, device_name="devB", set_default=False)
    assert set(doc2["profiles"]) == {"devA", "devB"} and doc2["default_profile"] == "devA"
    costs = doc2["profiles"]["devB"]["costs"]
    assert costs["decode_s"] > 0 and set(costs["draft_step_s"]) == {"draft", "ngram"}
    assert set(costs["verify_s"]) == {str(s) for s in range(2, 10)}
    assert set(doc2["profiles"]["devB"]["domains"]["code"]) == {"draft", "ngram"}
    verify_files(art, read_manifest(art))
    assert load(art).calibration == json.loads((art / CALIBRATION_NAME).read_text())


def test_calibrate_warms_up_outside_the_calibrated_prompts(tiny_artifacts, monkeypatch):
    """The first generation is the harness's warm-up prompt, in no calibrated domain; the rest are
    the calibrated prompts; the profile names this machine."""
    from specexport import calibrate as calibrate_module
    from specexport.harness import WARMUP_ID, warmup_case
    from specexport.machine import cpu_model

    seen = []
    run_one = calibrate_module.run_one

    def observed(gen, case, config, **kw):
        seen.append(case)
        return run_one(gen, case, config, **kw)

    monkeypatch.setattr(calibrate_module, "run_one", observed)
    doc = calibrate(
        tiny_artifacts["self"],
        domains=("code", "chat"),
        proposers=["draft"],
        prompts=PROMPTS,
        max_new_tokens=NEW,
        device_name="devW",
        costs=CHEAP_DRAFT,
        write=False,
    )
    warm, measured = seen[0], seen[1:]
    assert warm.id == WARMUP_ID and warm.ids == warmup_case(load(tiny_artifacts["self"]).codec).ids
    assert [c.id for c in measured] == ["t-code-1", "t-code-2", "t-chat-1"]
    assert warm.ids not in {c.ids for c in measured}
    device = doc["profiles"]["devW"]["device"]
    assert set(device) == {"platform", "cpu", "cpu_count", "machine", "threads"} and device["cpu"] == cpu_model()


def test_calibrate_disagreeing_draft_picks_zero(far_artifact, tmp_path):
    art = _copy(far_artifact, tmp_path)
    doc = calibrate(
        art,
        domains=("code", "chat", "copy_edit"),
        proposers=["draft"],
        prompts=PROMPTS,
        max_new_tokens=NEW,
        device_name="devA",
        costs=CHEAP_DRAFT,
    )
    for d, per in doc["profiles"]["devA"]["domains"].items():
        entry = per["draft"]
        assert entry["acceptance_rate"] < 0.2, d
        assert entry["gamma"] == 0 and entry["expected_speedup"] == 1.0, d
        assert max(entry["expected_speedup_by_gamma"].values()) < 1.0
    verify_files(art, read_manifest(art))


# --------------------------------------------------------------------------- CLI


def test_cli_bench_smoke(tiny_artifacts, prompt_file, tmp_path):
    from click.testing import CliRunner

    out, md = tmp_path / "r.json", tmp_path / "r.md"
    result = CliRunner().invoke(
        bench_cmd,
        [
            str(tiny_artifacts["self"]),
            "--prompts",
            str(prompt_file),
            "--gamma",
            "2,adaptive",
            "--repeats",
            "1",
            "--max-new-tokens",
            "6",
            "--limit",
            "1",
            "--json",
            str(out),
            "--markdown",
            str(md),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "speedup" in result.output and "equivalence (greedy)" in result.output
    data = json.loads(out.read_text())
    assert data["meta"]["prompts"] == 3 and [c["label"] for c in data["configs"]] == ["2", "adaptive"]
    assert md.read_text().startswith("# specexport bench")
    bad = CliRunner().invoke(bench_cmd, [str(tiny_artifacts["self"]), "--gamma", "two"])
    assert bad.exit_code == 2 and "--gamma" in bad.output


def test_cli_calibrate_smoke(tiny_artifacts, prompt_file, tmp_path):
    from click.testing import CliRunner

    art = _copy(tiny_artifacts["self"], tmp_path)
    result = CliRunner().invoke(
        calibrate_cmd,
        [
            str(art),
            "--prompts",
            str(prompt_file),
            "--domains",
            "code,chat",
            "--device",
            "cli-dev",
            "--prompts-per-domain",
            "1",
            "--max-new-tokens",
            "6",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "calibration profile 'cli-dev'" in result.output and "default" in result.output
    assert json.loads((art / CALIBRATION_NAME).read_text())["default_profile"] == "cli-dev"
    verify_files(art, read_manifest(art))
    for cmd in (bench_cmd, calibrate_cmd):
        helped = CliRunner().invoke(cmd, ["--help"])
        assert helped.exit_code == 0
        for param in cmd.params:
            if isinstance(param, __import__("click").Option):
                assert param.help, f"{cmd.name} {param.name} has no help"


def test_calibrate_an_eagle_head(tiny_artifacts, tmp_path):
    """An artifact with an EAGLE-3 head calibrates the 'eagle' proposer (its step timed in the
    loop: head calls per drafted token) beside n-gram; 'draft' is not offered."""
    art = _copy(tiny_artifacts["eagle3"], tmp_path)
    doc = calibrate(art, domains=("code",), prompts=PROMPTS, max_new_tokens=NEW, device_name="devE")
    prof = doc["profiles"]["devE"]
    assert set(prof["domains"]["code"]) == {"eagle", "ngram"}
    assert prof["costs"]["draft_step_s"]["eagle"] > 0
    with pytest.raises(InvalidArgument, match="'draft' is not available"):
        calibrate(art, domains=("code",), proposers=["draft"], prompts=PROMPTS, max_new_tokens=NEW)


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
