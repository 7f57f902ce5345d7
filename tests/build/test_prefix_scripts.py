"""The prefix-reuse benchmarks run end to end on tiny artifacts (dry runs: nothing timed is
asserted): the first request over a stored system prompt, and concurrent sessions through the
HTTP batch server within the pool's bound."""

from __future__ import annotations

import json
import shutil

from test_peer_scripts import BENCHMARKS, load_script


def test_system_prompt_ttft_runs_on_a_stored_prompt(tiny_artifacts, tmp_path, capsys):
    from specexport.build.prompt import store_system_prompt

    root = tmp_path / "artifact"
    shutil.copytree(tiny_artifacts["noisy-fused"], root)
    store_system_prompt(root, "You are a careful assistant. Answer briefly and show code.", lambda _: None, threads=1)
    out = tmp_path / "sp.json"
    module = load_script(BENCHMARKS / "system_prompt_ttft.py")
    args = [str(root), "--repeats", "2", "--threads", "1", "--max-new-tokens", "6", "--json", str(out)]
    assert module.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["equal"] == 2 and all(len(v) == 2 for v in doc["ms"].values())
    assert "drop/prefill" in capsys.readouterr().out


def test_prefix_sessions_run_through_the_batch_server(tiny_artifacts, tmp_path, capsys):
    out = tmp_path / "ps.json"
    module = load_script(BENCHMARKS / "prefix_sessions.py")
    args = [str(tiny_artifacts["noisy-batch4"]), "--sessions", "6", "--turns", "2", "--max-batch", "4"]
    args += ["--system-tokens", "30", "--max-new-tokens", "6", "--prefix-cache-mib", "1", "--threads", "1"]
    assert module.main([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["errors"] == [] and sum(t["requests"] for t in doc["turns"]) == 12
    assert doc["final"]["max_bytes"] == 1 << 20 and doc["final"]["bytes"] <= doc["final"]["max_bytes"]
    assert doc["turns"][1]["cached"] > 0  # the second turns reuse their sessions' histories
