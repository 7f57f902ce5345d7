"""The portable batch graph (contract 1.10: the time_major decoder with cache slots) on a
tiny artifact: its rows are measured bitwise against the batch-1 graph's, every sequence's greedy
output equals its own solo target-only run whatever shares its calls (joins, leaves, chunked
prompts, mixed proposers and gammas, a draft model drafting batched), and a runtime older than
1.10 refuses the artifact in one line.
"""

from __future__ import annotations

import json

import batch_support
import numpy as np
import pytest
from batch_support import PROMPTS, generator_pair

from specexport_runtime import contract
from specexport_runtime.api import load
from specexport_runtime.errors import ArtifactError
from specexport_runtime.slots import SlotCall

KIND = "noisy-batch3"  # portable target and draft model, 3 slots each


@pytest.fixture(scope="module")
def pair(tiny_artifacts):
    return generator_pair(tiny_artifacts[KIND])


@pytest.fixture(scope="module")
def solo_greedy(pair):
    return batch_support.solo_greedy(pair[0], PROMPTS, 32)


def test_manifest_and_graph_of_the_portable_batch_graph(tiny_artifacts):
    root = tiny_artifacts[KIND]
    data = json.loads((root / "manifest.json").read_text())
    target = data["target"]
    assert data["contract_version"] == contract.PORTABLE_SLOTS_VERSION == "1.10"
    assert target["kv_layout"] == contract.TIME_MAJOR
    assert (target["max_batch"], target["batch_graph"]) == (3, "target/batch.onnx")
    rows = target["validation"]["batch_rows"]
    assert rows["slots"] == 3 and rows["bitwise"] and rows["max_abs_diff"] == 0.0
    assert (data["draft"]["max_batch"], data["draft"]["batch_graph"]) == (3, "draft/batch.onnx")
    assert sorted(p.name for p in (root / "target").iterdir()) == ["batch.onnx", "model.onnx", "model.onnx.data"]
    import onnx

    graph = onnx.load(str(root / "target" / "batch.onnx"), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    assert not any(n.domain == "com.microsoft" for n in graph.node) and "MatMul" in ops  # standard ops only
    names = [i.name for i in graph.input]
    assert names[:3] == [contract.INPUT_IDS, contract.LOGITS_INDEX, contract.SLOT_ROWS]
    assert contract.past_key(0, 2) in names and contract.new_value(1, 2) in [o.name for o in graph.output]


def test_slot_rows_equal_batch_1_rows_with_idle_and_uneven_slots(pair):
    """Slot 1 alone, then all three with 1, 4 and 0 rows at different pasts: each slot's logits
    and cache rows equal a batch-1 call of the same tokens at the same past, bit for bit."""
    solo, batch = pair
    slots, target = batch.slots, solo.target
    prefixes = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    slots.lengths[:] = 0
    out = slots.forward([SlotCall(1, prefixes[1], 2)])[0].copy()
    target.reset()
    assert np.array_equal(out, target.forward(prefixes[1], last_rows=2))
    for b in (0, 2):
        slots.forward([SlotCall(b, prefixes[b], 1)])
    new = {0: [21], 1: [22, 23, 24, 25]}  # slot 2 idle in this call
    got = slots.forward([SlotCall(b, ids, len(ids)) for b, ids in new.items()])
    for b, ids in new.items():
        target.reset()
        target.forward(prefixes[b])
        ref = target.forward(ids, last_rows=len(ids))
        assert np.array_equal(got[b], ref), b
        n = len(prefixes[b]) + len(ids)
        for mine, theirs in zip(slots.kv_rows(b, 0, n), target.kv_rows(0, n)):
            assert np.array_equal(mine, theirs)
    assert list(slots.lengths) == [5, 6, 6]
    slots.lengths[:] = 0
    target.reset()


@pytest.mark.parametrize("proposer", ["none", "ngram", "draft"])
def test_greedy_portable_batch_equals_solo_target_only(pair, solo_greedy, proposer):
    """6 prompts through 3 slots (sequences join as others leave), prompts read in chunks of 16
    rows: every output equals its solo target-only run."""
    _, batch = pair
    scheduler = batch.scheduler(prefill_chunk=16)
    kw = {"speculative": False} if proposer == "none" else {"proposer": proposer, "gamma": 3}
    seqs = [scheduler.submit(p, max_new_tokens=32, **kw) for p in PROMPTS]
    scheduler.run()
    for prompt, seq, ref in zip(PROMPTS, seqs, solo_greedy):
        assert seq.tokens == ref, prompt
    assert max(scheduler.batch_sizes) == 3 and scheduler.stall_rows <= 16
    if proposer != "none":
        assert sum(s.stats.drafted for s in seqs) > 0
    if proposer == "draft":
        assert all(s.drafts_with_model for s in seqs)  # the draft's own batch graph


def test_a_runtime_older_than_the_portable_batch_graph_refuses_it(tiny_artifacts, monkeypatch):
    monkeypatch.setattr(contract, "CONTRACT_VERSION", "1.9")
    with pytest.raises(ArtifactError) as info:
        load(tiny_artifacts[KIND])
    assert "'1.10' is not supported" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "arch, kind", [("gpt2", "ngram-batch3"), ("gemma3_text", "ngram-batch3"), ("gemma4_text", "noisy-fused-batch3")]
)
def test_portable_batch_of_other_families_equals_solo(tmp_path_factory, arch, kind):
    """Learned positions (GPT-2: only the portable form serves it), per-layer windows with two
    rotary tables (Gemma 3, window 16 < the sequences), and Gemma 4's per-layer inputs and shared
    K/V in fused slots: rows bitwise, greedy batch = solo."""
    from tiny import build_tiny_artifact

    root = build_tiny_artifact(tmp_path_factory.mktemp(f"portable-{arch}"), kind, arch=arch)
    rows = json.loads((root / "manifest.json").read_text())["target"]["validation"]["batch_rows"]
    assert rows["bitwise"] and rows["slots"] == 3
    solo, batch = generator_pair(root)
    prompts = PROMPTS[:4]
    ref = batch_support.solo_greedy(solo, prompts, 40)
    results = batch.batch(prompts, max_new_tokens=40, proposer="ngram", gamma=3)
    assert [r.token_ids for r in results] == ref
