"""benchmarks/seeded_sampling.py runs on a tiny artifact (a subprocess: it turns on ONNX Runtime's
process-wide thread pool): its seeded-noise answers equal target-only's, every row is reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "seeded_sampling.py"


def test_seeded_sampling_bench_runs_and_compares(tiny_artifacts, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"id": f"p{i}", "domain": "code", "prompt": t} for i, t in enumerate(["def add(a, b):", "x = 1\ny ="])]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "seeded.json"
    args = [str(tiny_artifacts["noisy"]), "--prompts", str(prompts), "--max-new-tokens", "12", "--threads", "1"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--temperatures", "0.7,1.0", "--proposer", "draft", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "machine:" in proc.stdout and "noise outputs differing from off: 0" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["rejection 0.7", "noise 0.7", "rejection 1.0", "noise 1.0"]
    assert all(r["identical"] == "2/2" for r in rows if r["method"].startswith("noise"))
    assert all(0 <= (r["acceptance"] or 0) <= 1 for r in rows)
    bad = subprocess.run([sys.executable, str(SCRIPT), *args, "--temperatures", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --temperatures")
