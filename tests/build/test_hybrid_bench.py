"""benchmarks/hybrid_mechanics.py end to end on a tiny LFM2 and its attention-only twin (seconds):
every figure reaches the JSON and the table, and the ceiling's speculative runs (the replay and
the always-wrong proposer, driven through SpeculativeLoop) give target-only's output."""

from __future__ import annotations

import json

from test_peer_scripts import BENCHMARKS, load_script


def test_hybrid_mechanics_reports_every_figure(tmp_path, capsys):
    module = load_script(BENCHMARKS / "hybrid_mechanics.py")
    out = tmp_path / "mechanics.json"
    args = ["--shape", "tiny", "--precisions", "fp32,int4", "--apart", "int4", "--past", "24", "--tokens", "12"]
    args += ["--prompt-tokens", "6", "--warmup-tokens", "40", "--repeats", "1", "--threads", "1", "--pool", "own"]
    assert module.main([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["meta"]["machine"]["cpu"] and doc["meta"]["threads"] == 1

    labels = {f"{k} {p} fused" for k in ("hybrid", "attention") for p in ("fp32", "int4")}
    assert {m["model"] for m in doc["models"]} == labels
    assert {r["model"] for r in doc["verify"]} == labels
    for row in doc["verify"]:
        assert row["past"] == 24 and set(row["calls"]) == {"1", "5", "9"}
        for call in row["calls"].values():
            assert call["ms"] > 0 and call["run_ms"] > 0 and call["vs_1_row"] > 0 and 0 <= call["host_share"] < 1

    # the state bookkeeping exists on the hybrids only, timed directly and as an A/B of rounds
    assert {(r["model"], r["gamma"]) for r in doc["rollback"]} == {
        (f"hybrid {p} fused", g) for p in ("fp32", "int4") for g in (4, 8)
    }
    for row in doc["rollback"]:
        assert row["round_ms_with"] > 0 and row["round_ms_without"] > 0 and "overhead_ab" in row
        assert row["bind_us"] > 0 and row["store_us"] > 0 and row["truncate_us"] > 0 and 0 < row["direct_share"] < 1

    assert {r["model"] for r in doc["ceiling"]} == labels
    for row in doc["ceiling"]:
        assert row["gamma"] == 8 and row["tokens"] == 12
        for method in ("target-only", "replay", "always-wrong"):
            assert row[method]["tok_s"] > 0 and row[method]["equal_to_target_only"], (row["model"], method)
        assert row["replay"]["acceptance"] == 1.0 and row["replay"]["vs_target_only"] > 0
        assert row["always-wrong"]["accepted"] == 0 and row["always-wrong"]["vs_target_only"] > 0
        hybrid = row["kind"] == "hybrid"
        assert (row["replay"]["bookkeeping_share"] > 0) == hybrid
    assert any("call-cost bound" in line for line in doc["limits"])
    assert any("always-wrong" in line for line in doc["limits"])

    table = capsys.readouterr().out
    assert "machine:" in table and "threads: 1" in table
    for title in ("Verify cost", "Rollback overhead", "Ceiling", "What limits each figure"):
        assert f"### {title}" in table
    assert "| hybrid int4 fused |" in table and "| attention fp32 fused |" in table


def test_qwen35_shape_is_said_to_be_assumed_and_has_a_qwen3_twin():
    load_script(BENCHMARKS / "hybrid_mechanics.py")  # puts benchmarks/ on the path
    import hybrid_graphs

    cfg = hybrid_graphs.shape_config("qwen3.5-0.8b", [])
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + cfg["layer_types"][4:]
    assert len(cfg["layer_types"]) == 24 and cfg["layer_types"].count("full_attention") == 6
    line = hybrid_graphs.describe("qwen3.5-0.8b", cfg)
    assert "assumed" in line and "18 linear_attention" in line and "heads 8/2 x 256" in line
    hybrid, twin = (hybrid_graphs.hf_config(k, cfg) for k in ("hybrid", "attention"))
    assert hybrid.model_type == "qwen3_5_text" and hybrid.linear_num_value_heads == 16
    assert twin.model_type == "qwen3" and twin.head_dim == 256 and twin.num_key_value_heads == 2
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert getattr(twin, key) == getattr(hybrid, key), key
    # overriding the layer count repeats the pattern; lfm2's default shape is unchanged
    assert hybrid_graphs.shape_config("qwen3.5-0.8b", ["num_hidden_layers=6"])["layer_types"][4:] == [
        "linear_attention",
        "linear_attention",
    ]
    assert "assumed" not in hybrid_graphs.describe("lfm2-1.2b", hybrid_graphs.shape_config("lfm2-1.2b", []))
