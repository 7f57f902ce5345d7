"""benchmarks/default_slots.py end to end on two tiny artifacts of one recipe (batch-1 and 4
slots), each served by a real `specexport serve` process: both phases run, memory and disk are
read, and greedy outputs through the slots server equal the batch-1 server's."""

from __future__ import annotations

import json

import pytest
from test_peer_scripts import BENCHMARKS, load_script

from specexport.errors import HarnessError


@pytest.mark.slow
def test_default_slots_serves_both_artifacts(tiny_artifacts, tmp_path, capsys):
    module = load_script(BENCHMARKS / "default_slots.py")
    b1, slots = tiny_artifacts["noisy-fused"], tiny_artifacts["noisy-fused-batch4"]
    out = tmp_path / "ds.json"
    args = [str(b1), str(slots), "--prompts", "chat", "--limit", "2", "--max-new-tokens", "6", "--passes", "1"]
    assert module.main([*args, "--clients", "2", "--threads", "1", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    a, s = summary["artifacts"]["batch1"], summary["artifacts"]["slots"]
    assert s["disk_bytes"] > a["disk_bytes"] > 0  # the slots artifact adds its batch graphs
    for row in (a, s):
        assert row["peak_rss_one_client_bytes"] >= row["rss_loaded_bytes"] > 0
        assert row["decode_tps_one_client"] > 0 and row["aggregate_tps_2_clients"] > 0
        assert row["one_client_identical"] == "2/2" and row["2_clients_identical"] == "2/2"
    assert s["gamma_policy"] == "batch" and a["gamma_policy"] != "batch"  # each ran its own graph
    assert "| slots |" in capsys.readouterr().out
    with pytest.raises(HarnessError, match="max_batch 4 and 1"):
        module.main([str(slots), str(b1)])  # the artifacts swapped: refused before any server starts
