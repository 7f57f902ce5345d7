"""Batch slots on hybrid targets (feature recurrent_slots): each slot carries its own recurrent
state (conv windows, Mamba2 and Gated DeltaNet states) through packed calls, rolls it back on its
own, and every sequence's greedy output equals its solo target-only run from the batch-1 graph,
whatever shares its calls (the build measured the batch rows bitwise)."""

from __future__ import annotations

import numpy as np
import pytest
from batch_support import PROMPTS, generator_pair, solo_greedy
from exactness_support import check_pairs_follow_target, first_pair, sample_pairs
from tiny import build_tiny_artifact

from specexport_runtime.api import load
from specexport_runtime.slots import SlotCall

CASES = [  # (family, artifact kind): a fused and a portable target, a draft model with its own batch graph
    ("granitemoehybrid", "noisy-fused-batch4"),
    pytest.param("qwen3_5_text", "noisy-batch4", marks=pytest.mark.slow),
    pytest.param("lfm2", "noisy-fused-batch4", marks=pytest.mark.slow),
    pytest.param("falcon_h1", "noisy-batch4", marks=pytest.mark.slow),
    pytest.param("nemotron_h", "noisy-fused-batch4", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    built: dict = {}

    def get(arch: str, kind: str):
        if (arch, kind) not in built:
            root = build_tiny_artifact(tmp_path_factory.mktemp(f"{arch}-{kind}"), kind, arch=arch, max_context=256)
            solo, batch = generator_pair(root)
            built[arch, kind] = solo, batch, solo_greedy(solo, PROMPTS, 40)
        return built[arch, kind]

    return get


@pytest.mark.parametrize("arch, kind", CASES)
def test_batch_slots_of_a_hybrid_equal_solo_runs(pairs, arch, kind):
    """8 prompts through 4 slots (sequences join as others leave), target-only, n-gram and the
    batched draft model at gamma 3: every output equals its solo target-only run."""
    solo, batch, want = pairs(arch, kind)
    m = batch.manifest
    assert "recurrent_slots" in m.graph_features and m.target.validation["batch_rows"]["bitwise"]
    for kw in ({"speculative": False}, {"proposer": "ngram", "gamma": 3}, {"proposer": "draft", "gamma": 3}):
        results = batch.batch(PROMPTS, max_new_tokens=40, **kw)
        assert [r.token_ids for r in results] == want, kw
        if kw.get("proposer") == "draft":
            assert sum(r.stats.corrections for r in results) > 0  # rejections rolled slots back


@pytest.mark.parametrize("arch, kind", CASES[:2])
def test_a_slot_rolls_back_its_own_state(pairs, arch, kind):
    """Two slots in one call; slot 0's last 3 rows are rejected and rolled back while slot 1
    keeps its rows: slot 0's next logits equal a fresh slot that never saw the rejected tokens,
    and slot 1's equal its own uninterrupted run."""
    _, batch, _ = pairs(arch, kind)
    model = batch.slots
    a, b = [7, 150, 33, 99, 12], [40, 41, 42, 43, 44, 45]
    for v in (model.view(0), model.view(1)):
        v.reset()
    model.forward([SlotCall(0, a), SlotCall(1, b)])
    model.forward([SlotCall(0, [11, 12, 13, 14], 4), SlotCall(1, [20, 21])])
    model.view(0).truncate(len(a) + 1)  # keep 11, reject 12 13 14
    got0, got1 = (x.copy() for x in model.forward([SlotCall(0, [99]), SlotCall(1, [22])]))

    for v in (model.view(0), model.view(1)):
        v.reset()
    model.forward([SlotCall(0, a + [11])])  # slot 1 idle in these calls
    want0 = model.forward([SlotCall(0, [99])])[0].copy()
    model.view(0).reset()
    model.forward([SlotCall(1, b + [20, 21])])
    want1 = model.forward([SlotCall(1, [22])])[0].copy()
    np.testing.assert_array_equal(got0, want0)
    np.testing.assert_array_equal(got1, want1)


@pytest.mark.slow
def test_sampling_law_holds_for_a_hybrid_in_a_batch(pairs):
    """N seeded sequences of one prompt run 4 at a time with the batched draft model at gamma 3:
    the first two tokens follow the target law (chi-square against the exact pair distribution
    from the batch-1 graph; two-sample TV against solo target-only)."""
    solo, batch, _ = pairs("granitemoehybrid", "noisy-fused-batch4")
    (eos,) = solo.eos
    ids = [int(t) for t in np.random.default_rng(0).permutation(np.arange(5, 250))[:40]]
    N = 1500
    scheduler = batch.scheduler()
    seqs = [
        scheduler.submit(
            ids, max_new_tokens=2, seed=s, temperature=1.0, top_k=0, gamma=3, proposer="draft", seeded_noise=False
        )
        for s in range(N)
    ]
    scheduler.run()
    spec = [first_pair(s.result(), eos) for s in seqs]
    assert sum(s.stats.drafted for s in seqs) > N // 2
    base = sample_pairs(solo, ids, range(N, 2 * N), False, temperature=1.0, top_k=0)
    check_pairs_follow_target(solo.target, ids, spec, base, eos, "draft model on a hybrid in a batch")


@pytest.mark.parametrize("arch, kind", CASES[:1])
def test_long_prompts_in_a_batch_are_read_in_the_solo_calls(pairs, arch, kind):
    """Prompts past recurrent.STEP_ROWS (the chunked scan, whose bits follow the call) joining
    while others decode: each slot reads its prompt in the calls a solo run makes (the prompt's
    rows in a slot call equal a solo call's bit for bit), and outputs equal solo runs."""
    solo, batch, _ = pairs(arch, kind)
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(3, 300, size=n)] for n in (90, 200, 20, 150)]
    want = [solo.generate(p, max_new_tokens=24, speculative=False).token_ids for p in prompts]
    scheduler = batch.scheduler()
    reads: list = []  # (slot, rows) of every slot call
    inner = batch.slots.forward
    batch.slots.forward = lambda calls: [reads.append((c.slot, len(c.ids))) for c in calls] and inner(calls)
    try:
        seqs = [scheduler.submit(prompts[2], max_new_tokens=24, proposer="ngram", gamma=3)]
        for _ in range(3):  # the short one decodes when the long ones join
            scheduler.step()
        seqs += [scheduler.submit(p, max_new_tokens=24, proposer="ngram", gamma=3) for p in prompts]
        scheduler.run()
    finally:
        batch.slots.forward = inner
    assert [s.tokens for s in seqs[1:]] == want
    sizes = [n for _, n in reads]
    for n in (90, 200, 150):  # each long prompt in one call, as the solo engine reads it (<= MAX_CALL_ROWS)
        assert n in sizes, (n, sizes)
    model, ort = batch.slots, solo.target  # one long call in a slot and in the batch-1 graph: the same bits
    ids = prompts[3]
    model.view(0).reset()
    got = model.forward([SlotCall(0, ids, 4), SlotCall(1, [5])])[0].copy()
    ort.reset()
    np.testing.assert_array_equal(got, ort.forward(ids, last_rows=4))


def test_a_batch_slot_resumes_a_hybrid_prefix_at_a_checkpoint(tmp_path):
    """Batched requests reuse a hybrid's prefix through the pool (its checkpoints, not a slot's
    resident rows): a longer prompt resumes at 256 and equals its cold solo run."""
    root = build_tiny_artifact(tmp_path, "noisy-fused-batch4", arch="granitemoehybrid", max_context=512)
    solo, batch = generator_pair(root)
    rng = np.random.default_rng(9)
    ids = [int(t) for t in rng.integers(3, 300, size=300)]
    first = batch.batch([ids, ids[:50]], max_new_tokens=8)
    longer = ids + list(first[0].token_ids) + [int(t) for t in rng.integers(3, 300, size=30)]
    second = batch.batch([longer, ids[:60]], max_new_tokens=12)
    assert second[0].stats.cached_tokens == 256
    reference = load(root, config={"prefix_cache_bytes": 0}).generate(longer, max_new_tokens=12, speculative=False)
    assert second[0].token_ids == reference.token_ids
