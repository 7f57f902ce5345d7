"""`specexport plan` reports the prefix cache's default bound: the models' KV caches again."""

from __future__ import annotations

from specexport.plan.estimate import plan
from specexport.plan.report import gib


def test_plan_notes_the_prefix_cache_default():
    report = plan("smollm2-135m", "orin-nano-8gb")
    kv = sum(m.kv_bytes for m in report.models)
    assert kv > 0
    notes = [n for n in report.notes if n.startswith("prefix cache")]
    assert len(notes) == 1 and f"up to {gib(kv)} more host memory" in notes[0]
    assert "--prefix-cache-mib" in notes[0] and "graph: fused" not in notes[0]
