"""The peer comparisons and experiments in benchmarks/: every script explains every option in
--help, and compare_genai.py runs end to end on a tiny artifact next to a stand-in GenAI (no
onnxruntime_genai, no network), through the harness."""

from __future__ import annotations

import argparse
import importlib.util
import json
import stat
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# the scripts (helper modules such as llamacpp_build.py have no __main__ block)
SCRIPTS = sorted(
    p
    for p in [*BENCHMARKS.glob("*.py"), *BENCHMARKS.glob("experiments/*.py")]
    if 'if __name__ == "__main__":' in p.read_text()
)


def load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.relative_to(BENCHMARKS).as_posix() for p in SCRIPTS])
def test_help_explains_every_option(path, capsys):
    module = load_script(path)
    ap = module.parser()
    for action in ap._actions:
        assert action.help and action.help != argparse.SUPPRESS, f"{path.name}: {action.dest} has no help"
    with pytest.raises(SystemExit) as done:
        module.main(["--help"])
    assert done.value.code == 0 and "usage:" in capsys.readouterr().out


# a stand-in for onnxruntime_genai: greedy "generation" that cycles through the prompt's ids
FAKE_GENAI = """
class Model:
    def __init__(self, path):
        self.path = path

class GeneratorParams:
    def __init__(self, model):
        self.options = {}
    def set_search_options(self, **options):
        self.options = options

class Generator:
    def __init__(self, model, params):
        self.max_length, self.prompt, self.new = params.options["max_length"], [], 0
    def append_tokens(self, ids):
        self.prompt = list(ids)
    def is_done(self):
        return len(self.prompt) + self.new >= self.max_length
    def generate_next_token(self):
        self.new += 1
    def get_next_tokens(self):
        return [self.prompt[(self.new - 1) % len(self.prompt)]]
"""


def test_compare_genai_runs_through_the_harness(tiny_artifacts, tmp_path, capsys):
    fake = tmp_path / "fake"
    (fake / "onnxruntime_genai").mkdir(parents=True)
    (fake / "onnxruntime_genai" / "__init__.py").write_text(FAKE_GENAI)
    python = tmp_path / "genai-python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    model = tmp_path / "genai-fp32"
    model.mkdir()
    (model / "genai_config.json").write_text(json.dumps({"model": {"decoder": {}}}))
    (model / "model.onnx").write_text("")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": text}]}) + "\n"
            for i, text in enumerate(["a b c a b c a b", "def f(x): return x"])
        )
    )
    out = tmp_path / "genai.json"
    module = load_script(BENCHMARKS / "compare_genai.py")
    assert (
        module.main(
            [
                str(tiny_artifacts["self"]),
                "--genai-model",
                f"fp32={model}",
                "--genai-python",
                str(python),
                "--prompts",
                str(prompts),
                "--limit",
                "2",
                "--max-new-tokens",
                "6",
                "--repeats",
                "2",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "machine:" in printed and "memory: specexport" in printed and "genai fp32" in printed
    doc = json.loads(out.read_text())
    assert doc["meta"]["machine"]["cpu"] and "compare_genai.py" in doc["meta"]["command"]
    rows = {r["method"]: r for r in doc["rows"]}
    name = tiny_artifacts["self"].name
    modes = ("off", "draft", "ngram", "hybrid", "suffix")
    assert set(rows) == {"genai fp32"} | {f"specexport {name} {m}" for m in modes}
    assert rows["genai fp32"]["vs_ref"] == 1.0
    assert rows[f"specexport {name} hybrid"]["identical_to_off"] == "2/2"
    run = doc["run"]
    assert {s["case"] for s in run["samples"]} == {"q0", "q1"} and len(run["samples"]) == 2 * 2 * len(rows)
    firsts = [s["method"] for s in run["samples"] if s["slot"] == 0]
    assert len(set(firsts)) == len(firsts)  # every round starts with another method


def test_compare_genai_refuses_bad_input(tmp_path):
    module = load_script(BENCHMARKS / "compare_genai.py")
    from specexport.bench.harness import HarnessError

    with pytest.raises(HarnessError, match="no genai_config.json"):
        module.parse_genai_models([f"fp32={tmp_path}"])
    with pytest.raises(HarnessError, match="want PRECISION=LABEL"):
        module.parse_pairs(["int4=nope"], ["fp32"])
    assert module.harness.cli(module.main, ["x", "--genai-model", "y", "--genai-python", str(tmp_path / "no")]) == 2


def test_compare_transformers_runs_through_the_harness(tiny_artifacts, tmp_path, capsys):
    """On a tiny artifact and the transformers folder it was built from: every method measured on
    every prompt, hf greedy the reference, specexport's tokens equal to it."""
    art = tiny_artifacts["self"]
    out = tmp_path / "hf.json"
    module = load_script(BENCHMARKS / "compare_transformers.py")
    assert (
        module.main(
            [
                str(art),
                "--model",
                str(art.parent / "target-hf"),
                "--prompts",
                "code",
                "--limit",
                "2",
                "--max-new-tokens",
                "6",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    assert "machine:" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    rows = {r["method"]: r for r in doc["rows"]}
    assert rows["hf greedy"]["ratio"] == 1.0 and rows["specexport off"]["identical"] == 2
    assert {"specexport draft (gamma 4)", "specexport ngram (gamma 4)", "hf prompt lookup (10)"} <= set(rows)
    assert len(doc["run"]["samples"]) == 2 * len(rows)


def test_serve_overhead_runs_through_the_harness(tiny_artifacts, tmp_path, capsys):
    """Both paths on one tiny generator, the store emptied before each: same tokens."""
    out = tmp_path / "serve.json"
    module = load_script(BENCHMARKS / "serve_overhead.py")
    assert (
        module.main(
            [
                str(tiny_artifacts["self"]),
                "--limit",
                "2",
                "--max-new-tokens",
                "6",
                "--repeats",
                "1",
                "--threads",
                "1",
                "--proposer",
                "hybrid",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    assert doc["summary"]["outputs_equal"] == "2/2" and doc["summary"]["proposer"] == "hybrid"
    assert {s["method"] for s in doc["run"]["samples"]} == {"in_process", "server"}
    assert "memory: in_process, server: suffix store" in capsys.readouterr().out


def test_batch_throughput_runs_on_a_batch_artifact(tiny_artifacts, tmp_path, capsys):
    """benchmarks/batch_throughput.py end to end on a tiny artifact with batch graphs: every method
    row, greedy outputs identical to batch-1 target-only."""
    module = load_script(BENCHMARKS / "batch_throughput.py")
    out = tmp_path / "bt.json"
    args = [str(tiny_artifacts["noisy-fused-batch4"]), "--limit", "2", "--max-new-tokens", "12", "--no-shared-pool"]
    assert module.main([*args, "--concurrency", "1,4", "--repeats", "1", "--threads", "1", "--json", str(out)]) == 0
    methods = json.loads(out.read_text())["methods"]
    assert set(methods) == {"batch1-default", "batch1-off"} | {f"batch-{c}-{m}" for c in (1, 4) for m in ("on", "off")}
    for row in methods.values():
        assert row["identical_to_target_only"] == row["compared"] > 0
        assert row["tok_s"] > 0 and row["ttft_p99_ms"] >= row["ttft_p50_ms"] > 0
    with pytest.raises(SystemExit):
        module.main([*args, "--concurrency", "8"])  # more clients than the artifact's slots


def test_versus_checkout_runs_both_sides_in_workers(tiny_artifacts, tmp_path, capsys):
    """benchmarks/versus_checkout.py end to end with this checkout as its own baseline: a worker
    per side, every method's row, greedy outputs identical to baseline off; a folder that is not
    a checkout ends in one line."""
    module = load_script(BENCHMARKS / "versus_checkout.py")
    art, out = tiny_artifacts["self"], tmp_path / "vs.json"
    repo = BENCHMARKS.parent
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "q0", "messages": [{"role": "user", "content": "a b c a b c"}]}) + "\n")
    args = [str(repo), str(art), "--current-artifact", str(art), "--modes", "off,draft", "--prompts", str(prompts)]
    assert module.main([*args, "--max-new-tokens", "8", "--threads", "1", "--json", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {f"{side} {m}" for side in ("baseline", "current", "current-build") for m in ("off", "draft")}
    for name, row in rows.items():
        assert row["identical_to_baseline_off"] == row["prompts"] > 0
        assert (row["vs_baseline"] is None) == name.startswith("baseline") and row["tok_s"] > 0
    assert "current draft" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a specexport checkout"):
        module.main([str(tmp_path), str(art)])
    # the baseline side runs the baseline checkout's worker, not this one's: a stand-in that
    # answers every generation with the same two tokens differs from this checkout's outputs
    stub = tmp_path / "stub"
    (stub / "specexport").mkdir(parents=True)
    (stub / "specexport" / "__init__.py").write_text("")
    (stub / "specexport" / "harness_workers.py").write_text(STUB_WORKER)
    args = [str(stub), str(art), "--modes", "off", "--prompts", str(prompts), "--max-new-tokens", "8"]
    assert module.main([*args, "--threads", "1", "--json", str(out)]) == 1
    samples = json.loads(out.read_text())["run"]["samples"]
    assert {tuple(s["tokens"]) for s in samples if s["method"] == "baseline off"} == {(7, 7)}
    assert all(s["tokens"] != [7, 7] for s in samples if s["method"] == "current off")


# a baseline checkout's worker that answers every generation with tokens [7, 7]
STUB_WORKER = """
import json, sys
print("@@ready", flush=True)
for line in sys.stdin:
    req = json.loads(line)
    out = {} if req.get("op") == "forget" else {"tokens": [7, 7], "new_tokens": 2}
    print("@@" + json.dumps(out), flush=True)
"""
