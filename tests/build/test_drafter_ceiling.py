"""benchmarks/drafter_ceiling.py end to end on its tiny Gemma 4 shape (seconds): the replay drafts
the recorded answer and is accepted whole, its rounds carry 1 + gamma tokens, its output is
target-only's, and the call-cost bound is (1 + gamma) x 1-row / (1 + gamma)-row of the timed calls."""

from __future__ import annotations

import json

import pytest
from test_peer_scripts import BENCHMARKS, load_script


def test_the_call_cost_bound_by_hand():
    module = load_script(BENCHMARKS / "drafter_ceiling.py")
    # 5 one-row calls of 10 ms against one 5-row call of 12.5 ms: 4x; rows as dear as steps: 1x
    assert module.call_bound(0.010, 0.0125, 4) == pytest.approx(4.0)
    assert module.call_bound(0.010, 0.090, 8) == pytest.approx(1.0)


def test_drafter_ceiling_on_the_tiny_shape(tmp_path, capsys):
    module = load_script(BENCHMARKS / "drafter_ceiling.py")
    out = tmp_path / "ceiling.json"
    args = ["--shape", "tiny", "--tokens", "18", "--prompt-tokens", "6", "--gammas", "2,5"]
    args += ["--repeats", "1", "--calls", "1", "--threads", "1", "--json", str(out)]
    assert module.main(args) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["settings"]["threads"] == 1 and doc["target"]["form"] == "fused"
    assert doc["target_only_equal_to_recorded"] and doc["target_only_tok_s"] > 0
    assert set(doc["calls_ms"]) == {"1", "3", "6"} and doc["past"] == 6 + 9
    assert [r["gamma"] for r in doc["replay"]] == [2, 5]
    for r in doc["replay"]:
        g = r["gamma"]
        assert r["acceptance"] == 1.0 and r["equal_to_target_only"]
        assert r["tokens_per_round"] == pytest.approx(1 + g, abs=0.5)  # the last round may be cut short
        want = (1 + g) * doc["calls_ms"]["1"] / doc["calls_ms"][str(1 + g)]
        assert r["call_bound"] == pytest.approx(want) and r["rows_ms"] == doc["calls_ms"][str(1 + g)]
        assert r["vs_target_only"] > 0
    printed = capsys.readouterr().out
    assert "call bound" in printed and "gemma4-tiny-5" in printed
