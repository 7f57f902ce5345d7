"""`specexport plan` reports the prefix cache's default bound: the models' KV caches again."""

from __future__ import annotations

from specexport.plan.estimate import plan
from specexport.plan.report import gib
from specexport.recipe.load import load_recipe, resolve_recipe
from specexport.recipe.reader import with_overrides


def test_plan_notes_the_prefix_cache_default():
    report = plan("smollm2-135m", "orin-nano-8gb")
    kv = sum(m.kv_bytes for m in report.models)
    assert kv > 0
    notes = [n for n in report.notes if n.startswith("prefix cache")]
    assert len(notes) == 1 and f"up to {gib(kv)} more host memory" in notes[0]
    assert "--prefix-cache-mib" in notes[0] and "graph: fused" not in notes[0]


def test_plan_counts_a_stored_system_prompt(tmp_path):
    prompt = tmp_path / "system.txt"
    prompt.write_text("You are a careful assistant. " * 140, encoding="utf-8")  # 4,060 bytes
    report = plan(
        with_overrides(load_recipe(resolve_recipe("smollm2-135m")), {"system_prompt": str(prompt)}), "orin-nano-8gb"
    )
    kv = sum(m.kv_bytes for m in report.models)
    tokens = 4060 // 4 + 16
    notes = [n for n in report.notes if n.startswith("stored system prompt")]
    assert len(notes) == 1 and f"about {tokens} tokens" in notes[0] and gib(kv * tokens // 2048) in notes[0]


def test_a_hybrid_pool_counts_its_state_checkpoints():
    """Granite-4.0-H-1B with its int8 self-draft at 4096 positions: each model's pool share holds
    a checkpoint of its 36 Mamba2 layers' states (55.37 MiB) per 256 positions, 16 of them."""
    report = plan("granite-4.0-h-1b-int8-self-draft", "orin-nx-16gb")
    per_position = 36 * (3 * 3328 + 48 * 64 * 128) * 4  # a conv window and a scan state a layer, fp32
    checkpoints = 2 * 16 * per_position
    kv = sum(m.kv_bytes for m in report.models)
    (note,) = [n for n in report.notes if n.startswith("prefix cache")]
    assert (
        f"up to {gib(kv + checkpoints)} more host memory" in note and f"{gib(checkpoints)} of recurrent-state" in note
    )
