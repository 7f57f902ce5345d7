"""specexport.bench.harness: a two-prompt run on a tiny artifact is honest by construction (no measured
answer produced with a suffix store that held it, warm-up outside the set, methods interleaved
prompt by prompt), and its figures, records and refusals."""

from __future__ import annotations

import json

import pytest

from specexport.bench import harness
from specexport.bench.harness import Case, HarnessError, Method, Run, Sample
from specexport.bench.harness_workers import SpecexportWorker, generation_row, inprocess_method
from specexport.bench.prompts import Prompt

PROMPTS = [
    Prompt(id="p1", domain="copy_edit", messages=None, text="a b c d e f g a b c d e f g a b", max_new_tokens=12),
    Prompt(id="p2", domain="code", messages=(("user", "def f(x): return x + 1"),), text=None, max_new_tokens=12),
]
MODES = ("off", "suffix", "hybrid")


def stored_answers(gen) -> list[list[int]]:
    """The responses in the generator's suffix store of earlier answers, oldest first."""
    store = gen.learned("suffix").store
    return [store.buf[start - store.base : start - store.base + n - 1].tolist() for start, n in store.responses]


def observed(gen, method: Method, seen: list[dict]) -> Method:
    """The method with every call recorded: the case, the store before and after, the answer."""

    def run(case: Case) -> dict:
        before = stored_answers(gen)
        result = method.run(case)
        seen.append(
            {
                "method": method.name,
                "case": case.id,
                "ids": case.ids,
                "before": before,
                "after": stored_answers(gen),
                "answer": result["tokens"],
            }
        )
        return result

    return Method(method.name, run, method.reset, method.memory, method.info)


def honest_run(gen, methods, repeats=1):
    cases = harness.make_cases(gen.codec, PROMPTS)
    seen: list[dict] = []
    run = harness.run_interleaved(
        [observed(gen, m, seen) for m in methods], cases, harness.warmup_case(gen.codec), repeats=repeats
    )
    return run, cases, seen


@pytest.fixture(scope="module")
def gen(tiny_artifacts):
    from specexport_runtime.api import load

    return load(tiny_artifacts["self"], threads=1)


def test_no_measured_answer_comes_from_a_store_that_held_it(gen):
    methods = [inprocess_method(gen, m, m, 12) for m in MODES]
    run, cases, seen = honest_run(gen, methods, repeats=2)
    measured = [s for s in seen if s["case"] != harness.WARMUP_ID]
    assert len(measured) == len(MODES) * len(cases) * 2 == len(run.samples)
    assert any(s["after"] for s in measured), "the store never held an answer: the check would prove nothing"
    for s in measured:
        assert s["before"] == [], f"{s['method']} on {s['case']} ran with a store holding {s['before']}"
    # greedy speculation stays exact: every mode gives target-only's tokens
    assert run.same_tokens("suffix", "off") == run.same_tokens("hybrid", "off") == (2, 2)


def test_warm_up_runs_first_on_a_prompt_outside_the_set(gen):
    run, cases, seen = honest_run(gen, [inprocess_method(gen, m, m, 12) for m in MODES])
    warm = [s for s in seen if s["case"] == harness.WARMUP_ID]
    assert [s["method"] for s in warm] == list(MODES) and seen[: len(MODES)] == warm
    assert all(w["ids"] not in {c.ids for c in cases} for w in warm)
    events = [e for e, _, _ in run.log if e != "reset"]
    assert events == ["warm-up"] * len(MODES) + ["measure"] * len(MODES) * len(cases)
    # a reset precedes every call, warm-up included
    assert all(run.log[i][0] == "reset" and run.log[i][1:] == run.log[i + 1][1:] for i in range(0, len(run.log), 2))


def test_methods_interleave_prompt_by_prompt(gen):
    run, cases, _ = honest_run(gen, [inprocess_method(gen, m, m, 12) for m in MODES], repeats=2)
    measured = [(m, c) for e, m, c in run.log if e == "measure"]
    rounds = [measured[i : i + len(MODES)] for i in range(0, len(measured), len(MODES))]
    assert [{c for _, c in r} for r in rounds] == [{"p1"}, {"p1"}, {"p2"}, {"p2"}]  # prompts outer, one per round
    assert all(sorted(m for m, _ in r) == sorted(MODES) for r in rounds)  # every method once per round
    firsts = [r[0][0] for r in rounds]
    assert all(a != b for a, b in zip(firsts, firsts[1:], strict=False))  # rotated: no method always first
    assert [s.slot for s in run.samples[: len(MODES)]] == [0, 1, 2]


def test_a_method_sees_which_repeat_it_measures():
    seen = []
    method = Method("m", lambda case: seen.append((case.id, case.repeat)) or {"tokens": []})
    harness.run_interleaved([method], [Case("a", (1,)), Case("b", (2,))], Case("w", (3,)), repeats=2)
    assert seen == [("w", 0), ("a", 0), ("a", 1), ("b", 0), ("b", 1)]


def test_the_store_check_fails_when_the_store_is_kept(gen):
    """The same run with a reset that does nothing: the second measurement of a prompt finds
    its own earlier answer in the store, which the check above would report."""
    gen.forget_history()
    methods = [
        Method(m.name, m.run, lambda: None, m.memory, m.info)
        for m in (inprocess_method(gen, mode, mode, 12) for mode in ("suffix", "hybrid"))
    ]
    _, _, seen = honest_run(gen, methods, repeats=2)
    assert any(s["answer"] in s["before"] for s in seen if s["case"] != harness.WARMUP_ID)
    gen.forget_history()


def test_refusals(gen):
    cases = harness.make_cases(gen.codec, PROMPTS)
    off = inprocess_method(gen, "off", "off", 4)
    with pytest.raises(HarnessError, match="warm-up prompt is a measured prompt"):
        harness.run_interleaved([off], cases, Case("other", cases[1].ids))
    kept = Method("server", off.run, None, "its n-gram pool, never cleared")
    with pytest.raises(HarnessError, match="cannot clear them"):
        harness.run_interleaved([kept], cases, harness.warmup_case(gen.codec), repeats=2)
    notes = harness.run_interleaved([kept], cases, harness.warmup_case(gen.codec)).memory_notes()
    assert notes == ["server: its n-gram pool, never cleared"]
    with pytest.raises(HarnessError, match="method names repeat"):
        harness.run_interleaved([off, off], cases, harness.warmup_case(gen.codec))
    with pytest.raises(HarnessError, match="no 'tokens' list"):
        harness.run_interleaved([Method("bad", lambda c: {})], cases, harness.warmup_case(gen.codec))
    with pytest.raises(HarnessError, match="holds no prompts|limit"):
        harness.load_prompt_set("code", limit=0)


def test_prompt_sets_load_from_paths_lists_and_comma_specs(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one\ntwo\nthree\n")
    b.write_text("four\n")
    assert [p.id for p in harness.load_prompt_set(a)] == ["a-1", "a-2", "a-3"]  # one path
    assert [p.id for p in harness.load_prompt_set(f"{a},{b}", limit=2)] == ["a-1", "a-2", "b-1"]  # per domain
    assert [p.id for p in harness.load_prompt_set([a, b, a])] == ["a-1", "a-2", "a-3", "b-1"]  # an id once
    code = harness.load_prompt_set("code", limit=2)
    assert len(code) == 2 and {p.domain for p in code} == {"code"}


def _sample(method, case, seconds, tokens, repeat=0):
    return Sample(method, case, repeat, 0, seconds, {"tokens": tokens, "tok_s": 10 / seconds})


def test_figures_are_medians_and_paired_ratios():
    cases = [Case("a", (1,)), Case("b", (2,)), Case("c", (3,))]
    run = Run([Method("x", lambda c: {}), Method("y", lambda c: {})], cases, 2)
    for case, xs, ys in (("a", (1.0, 3.0), (2.0, 2.0)), ("b", (2.0, 2.0), (4.0, 4.0)), ("c", (5.0, 5.0), (5.0, 5.0))):
        for r in range(2):
            run.samples += [_sample("x", case, xs[r], [1, 2, 9], r), _sample("y", case, ys[r], [1, 2, 7, 9], r)]
    assert run.per_case("x", "seconds") == {"a": 2.0, "b": 2.0, "c": 5.0}
    assert run.median("x", "seconds") == 2.0 and run.median("y", "seconds") == 4.0
    ratio = run.ratio("x", "y", "seconds")
    assert ratio["per_case"] == {"a": 1.0, "b": 0.5, "c": 1.0} and ratio["median"] == 1.0
    lo, hi = ratio["ci95"]
    assert 0.5 <= lo <= hi <= 1.0
    assert run.same_tokens("x", "y", eos={7, 9}) == (3, 3) and run.same_tokens("x", "y") == (0, 3)
    assert harness.wall_tok_s(run.samples[0]) == 3.0
    doc = run.to_dict()
    assert len(doc["samples"]) == 12 and doc["samples"][0]["tokens"] == [1, 2, 9]
    with pytest.raises(HarnessError, match="no method 'z'"):
        run.median("z", "seconds")


def test_statistics_helpers():
    assert harness.until_eos([5, 6, 2, 7], {2}) == [5, 6] and harness.until_eos([5, 6], {2}) == [5, 6]
    assert harness.rotated([1, 2, 3], 4) == [2, 3, 1] and harness.rotated([], 3) == []
    assert harness.bootstrap_ci([2.0], seed=0) == (2.0, 2.0) and harness.bootstrap_ci([], seed=0) is None
    assert harness.percentiles([])["p50"] is None
    # the bench re-exports keep working
    from specexport.bench import stats as bench_stats

    assert bench_stats.ratio_ci is harness.ratio_ci and bench_stats.bootstrap_ci is harness.bootstrap_ci


def test_interleaved_seconds_warms_up_then_rotates():
    order = []
    seconds = harness.interleaved_seconds({k: (lambda k=k: order.append(k)) for k in "abc"}, 3)
    assert "".join(order) == "abc" + "abc" + "bca" + "cab"  # an untimed round, then rotated rounds
    assert set(seconds) == set("abc") and all(v >= 0 for v in seconds.values())


def test_metadata_names_the_machine_and_the_command(tmp_path):
    meta = harness.run_metadata(["benchmarks/x.py", "A B", "--json", "o.json"], limit=3, path=tmp_path)
    assert meta["command"] == "python benchmarks/x.py 'A B' --json o.json"
    assert meta["machine"]["cpu"] and meta["machine"]["cpu_count"] >= 1 and "numpy" in meta["versions"]
    assert meta["settings"] == {"limit": 3, "path": str(tmp_path)}
    line = harness.header(meta)
    assert meta["machine"]["cpu"] in line and "'A B'" in line
    harness.write_json(tmp_path / "run.json", {"meta": meta})
    assert json.loads((tmp_path / "run.json").read_text())["meta"]["command"] == meta["command"]


def test_worker_process_answers_like_the_library(gen, tiny_artifacts, tmp_path):
    ids = [5, 9, 14, 3, 7, 21]
    want = generation_row(gen, ids, "off", 8)["tokens"]
    worker = SpecexportWorker(tiny_artifacts["self"], 1, tmp_path / "worker.log")
    try:
        method = worker.method("w hybrid", "hybrid", 8)
        method.reset()
        row = method.run(Case("x", tuple(ids)))
        assert row["tokens"] == want and row["new_tokens"] == len(want) and row["calls"] >= 1
        with pytest.raises(HarnessError, match="KeyError"):
            worker.request({"op": "generate"})
    finally:
        worker.close()


def test_worker_decodes_under_a_cases_grammar(gen, tiny_artifacts, tmp_path):
    """A grammar given per case id reaches the worker's generation: its tokens are the library's
    constrained target-only tokens (greedy), and a case without one decodes free."""
    from specexport_runtime.structured import Grammar

    grammar = Grammar.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    ids = [5, 9, 14, 3, 7, 21]
    want = [int(t) for t in gen.generate(ids, max_new_tokens=12, speculative=False, grammar=grammar).token_ids]
    free = generation_row(gen, ids, "off", 12)["tokens"]
    assert want != free
    worker = SpecexportWorker(tiny_artifacts["self"], 1, tmp_path / "worker.log")
    try:
        method = worker.method("w hybrid", "hybrid", 12, grammars={"x": grammar})
        assert method.run(Case("x", tuple(ids)))["tokens"] == want
        assert method.run(Case("y", tuple(ids)))["tokens"] == free
    finally:
        worker.close()


def test_ci_cell_prints_an_interval_or_the_empty_mark():
    assert harness.ci_cell((0.9512, 1.1049)) == "[0.95-1.10]"
    assert harness.ci_cell(None) == "-" and harness.ci_cell(None, "") == ""


def test_by_domain_takes_the_median_within_each_domain():
    per_case = {"code-1": 1.0, "code-2": 3.0, "code-3": 2.0, "chat-1": 0.5, "chat-2": 1.5}
    domain_of = {"chat-1": "chat", "code-1": "code", "chat-2": "chat", "code-2": "code", "code-3": "code"}
    assert harness.by_domain(per_case, domain_of) == {"chat": 1.0, "code": 2.0}
    assert list(harness.by_domain(per_case, domain_of)) == ["chat", "code"]  # domain_of's order


def test_best_medians_rotates_the_cells_and_keeps_each_ones_lowest_round(monkeypatch):
    """Round k runs the cells rotated by k, before() precedes each cell's calls, and each cell
    keeps the lowest of its rounds' medians (a fake clock: each call of a cell advances it by the
    next of that cell's costs)."""
    clock, order, befores = [0.0], [], []
    costs = {"a": iter([1, 1, 1, 4, 4, 4]), "b": iter([5, 5, 9, 2, 2, 3])}  # round 0, then round 1

    def cell(name: str):
        def run() -> None:
            order.append(name)
            clock[0] += next(costs[name])

        return name, run

    monkeypatch.setattr(harness.time, "perf_counter", lambda: clock[0])
    out = harness.best_medians([cell("a"), cell("b")], 2, 3, before=lambda: befores.append(len(order)))
    assert order == ["a"] * 3 + ["b"] * 3 + ["b"] * 3 + ["a"] * 3  # round 1 rotated by one
    assert befores == [0, 3, 6, 9]
    assert out == {"a": 1.0, "b": 2.0}  # a: medians 1, 4; b: medians 5, 2
