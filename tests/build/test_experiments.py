"""benchmarks/experiments/ run on tiny artifacts (a few calls each) and write the machine and the
command beside their figures. Scripts that turn on ONNX Runtime's process-wide thread pool
(load(shared_pool=True)) run in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXPERIMENTS = Path(__file__).resolve().parents[2] / "benchmarks" / "experiments"


def run_script(name: str, *args: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXPERIMENTS / f"{name}.py"), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "machine:" in proc.stdout


def read(path: Path) -> dict:
    doc = json.loads(path.read_text())
    assert doc["meta"]["machine"]["cpu"] and "experiments" in doc["meta"]["command"]
    return doc


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        "".join(
            json.dumps({"id": f"r{i}", "domain": "copy_edit", "prompt": text, "max_new_tokens": 10}) + "\n"
            for i, text in enumerate(["a b c d a b c d a b c", "x y z x y z x y"])
        )
    )
    return path


def test_verify_cost_times_both_graph_forms(tiny_artifacts, tmp_path):
    out = tmp_path / "cost.json"
    run_script(
        "verify_cost",
        str(tiny_artifacts["noisy"]),
        str(tiny_artifacts["int8-fused"]),
        "--past",
        "20",
        "--calls",
        "2",
        "--repeats",
        "1",
        "--sizes",
        "1,3",
        "--draft-sizes",
        "1,3",
        "--json",
        str(out),
    )
    rows = read(out)["rows"]
    labels = [label for r in rows for label in r["calls"]]
    assert len(labels) == 4
    assert any("time_major" in x for x in labels) and any("head_major_inplace" in x for x in labels)
    assert all(set(r["calls"][x]) == {"1", "3"} and r["calls"][x]["1"]["ms"] > 0 for r in rows for x in r["calls"])
    assert rows[0]["calls"][labels[0]]["1"]["vs_first_decode"] == 1.0 and rows[0]["c"] > 0


def test_suffix_limit_and_controller_ab_stay_exact(tiny_artifacts, prompt_file, tmp_path):
    out = tmp_path / "limit.json"
    run_script(
        "suffix_limit",
        str(tiny_artifacts["ngram"]),
        "--prompts",
        str(prompt_file),
        "--configs",
        "1/4,auto",
        "--threads",
        "1",
        "--json",
        str(out),
    )
    doc = read(out)
    assert {c: r["identical"] for c, r in doc["configs"].items()} == {"1/4": "2/2", "auto": "2/2"}
    assert doc["configs"]["auto"]["tuner"] is not None and doc["configs"]["1/4"]["tuner"] is None
    assert {s["method"] for s in doc["run"]["samples"]} == {"off", "1/4", "auto"}
    out = tmp_path / "ab.json"
    run_script(
        "controller_ab",
        str(tiny_artifacts["self"]),
        "--prompts",
        str(prompt_file),
        "--tolerances",
        "0,0.03",
        "--fixed",
        "4",
        "--max-new-tokens",
        "8",
        "--threads",
        "1",
        "--json",
        str(out),
    )
    rows = read(out)["rows"]
    assert [r["setting"] for r in rows] == ["fixed 4", "tolerance 0", "tolerance 0.03"]
    assert all(r["identical"] == r["prompts"] == 2 and r["speedup"] > 0 for r in rows)


def test_op_profile_and_suffix_cost(tiny_artifacts, tmp_path):
    out = tmp_path / "ops.json"
    run_script(
        "op_profile", str(tiny_artifacts["noisy"]), "--past", "10", "--steps", "3", "--threads", "1", "--json", str(out)
    )
    doc = read(out)
    assert doc["ops"] and abs(sum(r["share"] for r in doc["ops"]) - 1.0) < 0.3
    out = tmp_path / "suffix.json"
    run_script("suffix_cost", "--request", "64", "--store", "2000", "--rounds", "50", "--json", str(out))
    doc = read(out)
    assert doc["rounds"] == 50 and doc["ms_per_round"]["p50"] > 0 and doc["store"]["tokens"] > 0


@pytest.mark.slow  # ~6 s: two scripts over tiny artifacts
def test_runtime_overhead_and_head_agreement(tiny_artifacts, prompt_file, tmp_path):
    out = tmp_path / "overhead.json"
    run_script("runtime_overhead", str(tiny_artifacts["self"]), "--tokens", "30", "--threads", "1", "--json", str(out))
    rows = read(out)["rows"]
    assert [r["speculative"] for r in rows] == [False, True] and all(0 <= r["python_share"] < 1 for r in rows)
    out = tmp_path / "head.json"
    run_script(
        "head_agreement",
        str(tiny_artifacts["eagle3"]),
        "--prompts",
        str(prompt_file),
        "--max-new-tokens",
        "8",
        "--threads",
        "1",
        "--json",
        str(out),
    )
    doc = read(out)
    assert len(doc["rows"]) == 2 and all(r["same_output"] for r in doc["rows"])
    assert 0 <= doc["summary"]["teacher_forced"] <= 1


@pytest.mark.slow  # ~9 s: the row-invariance script over a tiny target
def test_row_invariance_of_a_tiny_target(tiny_artifacts, tmp_path):
    out = tmp_path / "rows.json"
    run_script(
        "row_invariance",
        "--model",
        str(tiny_artifacts["noisy"].parent / "target-hf"),
        "--configs",
        "fp32",
        "--limit",
        "1",
        "--past",
        "20",
        "--repeats",
        "1",
        "--json",
        str(out),
    )
    (row,) = read(out)["rows"]
    assert row["config"] == "fp32" and row["padded calls"]["bitwise"] and set(row["ms"]) >= {"unpadded", "verify9"}


def test_constraint_cost_times_the_grammar_apart(tiny_artifacts, tmp_path):
    pytest.importorskip("llguidance")
    prompts = tmp_path / "schema.jsonl"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    prompts.write_text(
        json.dumps(
            {"id": "s1", "messages": [{"role": "user", "content": "a number"}], "max_new_tokens": 12, "schema": schema}
        )
        + "\n"
    )
    out = tmp_path / "constraint.json"
    run_script(
        "constraint_cost", str(tiny_artifacts["ngram"]), "--prompts", str(prompts), "--threads", "1", "--json", str(out)
    )
    result = read(out)["result"]
    assert result["tokens"] > 0 and result["grammar_ms_per_token"] > 0
    parts = sum(result[f"{k}_ms_per_token"] for k in ("masks", "apply", "commit"))
    assert parts == pytest.approx(result["grammar_ms_per_token"], abs=1e-3)
    assert 0 < result["grammar_share_of_step"] < 1


def test_gqa_batch_reports_each_row_count(tmp_path):
    out = tmp_path / "gqa.json"
    run_script("gqa_batch", "--pasts", "3,11", "--rows", "1,3", "--json", str(out))
    rows = read(out)["rows"]
    assert [(r["batch"], r["rows"], r["pasts"]) for r in rows] == [(2, 1, [3, 11]), (2, 3, [3, 11])]
    # one new row per sequence: accepted, and a sequence's rows do not depend on the batch
    assert rows[0]["accepted"] and rows[0]["max_abs_diff_per_sequence"] == [0.0, 0.0]
    verify = rows[1]  # several rows: either compared per sequence or refused with ONNX Runtime's reason
    assert len(verify["max_abs_diff_per_sequence"]) == 2 if verify["accepted"] else "batch_size" in verify["error"]


def test_gqa_batch_compares_right_padded_chunks(tmp_path):
    """--query-seqlens: one call of right-padded chunks; chunks of 2 or more valid rows equal
    their own calls bit for bit (ONNX Runtime 1.32), an idle sequence is reported as such."""
    out = tmp_path / "gqa.json"
    run_script("gqa_batch", "--pasts", "5,17,9", "--rows", "1", "--query-seqlens", "3,0,2", "--json", str(out))
    padded = read(out)["rows"][-1]
    assert padded["query_seqlens"] == [3, 0, 2] and padded["accepted"]
    assert padded["max_abs_diff_per_sequence"] == [0.0, None, 0.0]


def test_gqa_batch_refuses_bad_lists():
    proc = subprocess.run(
        [sys.executable, str(EXPERIMENTS / "gqa_batch.py"), "--rows", "0"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0 and "--rows takes a comma list of integers >= 1, got '0'" in proc.stderr


def test_masked_draft_is_exact_and_never_cut(tiny_artifacts, tmp_path):
    pytest.importorskip("llguidance")
    prompts = tmp_path / "schema.jsonl"
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "string", "maxLength": 6}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    prompts.write_text(
        "".join(
            json.dumps(
                {"id": f"s{i}", "messages": [{"role": "user", "content": text}], "max_new_tokens": 40, "schema": schema}
            )
            + "\n"
            for i, text in enumerate(["def add(a, b):", "The quick brown fox"])
        )
    )
    out = tmp_path / "masked.json"
    run_script("masked_draft", str(tiny_artifacts["noisy"]), "--prompts", str(prompts), "--json", str(out))
    rows = read(out)["rows"]
    assert {(r["prompt"], r["proposer"]) for r in rows} == {
        (p, n) for p in ("s0", "s1") for n in ("draft", "draft-free")
    }
    assert all(r["identical"] for r in rows)  # both equal constrained target-only
    masked = [r for r in rows if r["proposer"] == "draft"]  # drafts inside the grammar: cut at most at an EOS
    assert sum(r["drafted"] for r in masked) > 0 and all(r["grammar_cut"] <= 1 for r in masked)


def test_slot_cost_times_the_batch_graph_against_batch_1(tiny_artifacts, tmp_path):
    out = tmp_path / "slots.json"
    run_script(
        "slot_cost", str(tiny_artifacts["noisy-fused-batch4"]), "--sizes", "1,3", "--running", "1,4",
        "--past", "8", "--calls", "2", "--repeats", "1", "--json", str(out),
    )  # fmt: skip
    cells = read(out)["cells"]
    assert [(c["rows"], c["running"]) for c in cells] == [(1, 1), (1, 4), (3, 1), (3, 4)]
    assert all(c["batch1_ms"] > 0 and c["batch_ms"] > 0 for c in cells)


def test_tree_attention_compares_tree_and_chain_calls(tmp_path):
    out = tmp_path / "tree.json"
    run_script("tree_attention", "--past", "12", "--sizes", "2,5", "--calls", "3", "--json", str(out))
    doc = read(out)
    assert [p["path"][0] for p in doc["paths"]] == [0] * len(doc["paths"]) and len(doc["paths"]) >= 3
    assert all(p["max_abs_diff_out"] < 1e-4 and p["max_abs_diff_k"] < 1e-5 for p in doc["paths"])
    assert all(p["max_abs_diff_out_vs_biased_chain"] < 1e-4 for p in doc["paths"])
    assert [c["rows"] for c in doc["costs"]] == [2, 5] and all(c["chain_us"] > 0 for c in doc["costs"])


def test_free_rows_runs_off_on_and_no_free_on_one_batch_generator(tiny_artifacts, prompt_file, tmp_path):
    out = tmp_path / "free.json"
    run_script(
        "free_rows", str(tiny_artifacts["ngram-fused-batch4"]), "--clients", "2", "--prompts", str(prompt_file),
        "--max-new-tokens", "8", "--repeats", "2", "--threads", "1", "--proposer", "suffix", "--json", str(out),
    )  # fmt: skip
    doc = read(out)
    assert list(doc["methods"]) == ["off", "on", "no-free"]
    assert all(m["identical_to_off"] == 2 and len(m["vs_off"]) == 2 for m in doc["methods"].values())
    assert doc["methods"]["off"]["vs_off"] == [1.0, 1.0] and doc["methods"]["off"]["drafted"] == 0
    assert doc["methods"]["on"]["drafted"] > 0  # the prompts repeat: suffix drafts were verified


def test_prepack_exactness_checks_repacked_and_mapped_weights(tiny_artifacts, tmp_path):
    prompts = tmp_path / "long.jsonl"
    text = "def add(a, b):\n    return a + b\n" * 4  # over 39 tokens: the row check's 30 + 9
    prompts.write_text(json.dumps({"id": "long", "domain": "code", "prompt": text, "max_new_tokens": 10}) + "\n")
    out = tmp_path / "prepack.json"
    run_script(
        "prepack_exactness", str(tiny_artifacts["noisy-fused"]), "--prompts", str(prompts),
        "--max-new-tokens", "8", "--threads", "1", "--json", str(out),
    )  # fmt: skip
    doc = read(out)
    assert set(doc["settings"]) == {"repacked", "mapped"}
    for s in doc["settings"].values():  # greedy speculation equals target-only either way
        assert s["speculative_equals_target_only"] == s["prompts"] == 1 and s["argmax_equal"]
        assert 0 <= s["max_abs_diff_9_rows"] < 1e-3
    assert doc["target_only_repacked_equals_mapped"] == 1


def test_recurrent_rollback_replay_equals_the_per_position_state(tmp_path):
    out = tmp_path / "rr.json"
    run_script("recurrent_rollback", "--layers", "2", "--rows", "4", "--repeats", "1", "--json", str(out))
    (row,) = read(out)["rows"]
    assert row["rows"] == 4 and row["max_abs_diff"] == 0.0  # a replay from the kept state is exact
    assert row["each_ms"] > 0 and row["final_ms"] > 0 and row["replay_ms"] > 0
