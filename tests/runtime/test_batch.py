"""Batched generation (contract 1.5 / 1.6, batch.py) on tiny artifacts with a batch graph: every
sequence's greedy output equals its own solo target-only run from the batch-1 graph, whatever
shares its calls (bit for bit: the build measured the batch rows bitwise), sampling follows the
target law per sequence, and the scheduler's joins, leaves and cancellations happen at round
boundaries as its own event record shows.
"""

from __future__ import annotations

import json
import shutil

import batch_support
import numpy as np
import pytest
from batch_support import PROMPTS, generator_pair
from exactness_support import check_pairs_follow_target, first_pair, sample_pairs

from specexport_runtime.api import load
from specexport_runtime.batch import BatchSequence
from specexport_runtime.batch_gamma import (
    EVIDENCE_ROUNDS,
    FREE,
    GUARD_ROUNDS,
    PRIOR_ALPHA,
    PROBE_GAMMA,
    RECHECK_EVERY,
    RECHECK_ROUNDS,
    SEQUENCES_KEPT,
    SWITCH_ROUNDS,
    TRUST_SEQUENCES,
    BatchCost,
    BatchGamma,
)
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.slots import SlotCall

KIND = "noisy-fused-batch4"  # a draft model with its own batch graph: it drafts batched too


@pytest.fixture(scope="module")
def pair(tiny_artifacts):
    return generator_pair(tiny_artifacts[KIND])


@pytest.fixture(scope="module")
def solo_greedy(pair):
    return batch_support.solo_greedy(pair[0], PROMPTS, 40)


def test_manifest_records_the_batch_graph(tiny_artifacts):
    data = json.loads((tiny_artifacts[KIND] / "manifest.json").read_text())
    target = data["target"]
    assert data["contract_version"] == "1.6"  # idle slots take no rows
    assert (target["max_batch"], target["batch_graph"]) == (4, "target/batch.onnx")
    rows = target["validation"]["batch_rows"]
    assert rows["slots"] == 4 and rows["bitwise"] and rows["max_abs_diff"] == 0.0
    assert (data["draft"]["max_batch"], data["draft"]["batch_graph"]) == (4, "draft/batch.onnx")
    # one weights file for both graphs
    assert sorted(p.name for p in (tiny_artifacts[KIND] / "target").iterdir()) == [
        "batch.onnx",
        "model.onnx",
        "model.onnx.data",
    ]


@pytest.mark.parametrize("proposer", ["none", "ngram", "suffix", "draft"])
def test_greedy_batch_equals_solo_target_only(pair, solo_greedy, proposer):
    """8 prompts (1 to ~60 tokens) through 4 slots: sequences join as others leave."""
    _, batch = pair
    kw = {"speculative": False} if proposer == "none" else {"proposer": proposer, "gamma": 3}
    results = batch.batch(PROMPTS, max_new_tokens=40, **kw)
    adaptive = batch.batch(PROMPTS, max_new_tokens=40, **{k: v for k, v in kw.items() if k != "gamma"})
    assert [r.token_ids for r in adaptive] == solo_greedy  # the batch's own gamma (here mostly 0)
    for prompt, r, ref in zip(PROMPTS, results, solo_greedy):
        assert r.token_ids == ref, prompt
        assert r.finish_reason in ("eos", "length")
    if proposer != "none":
        assert sum(r.stats.drafted for r in results) > 0  # speculation ran in the batch


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_batch_with_fixed_gamma_and_mixed_configs(pair, solo_greedy, gamma):
    """Each sequence its own proposer, gamma and length limit in one batch."""
    _, batch = pair
    scheduler = batch.scheduler(prefill_chunk=16)  # prompts longer than 16 rows are read in chunks
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        kw = [{"proposer": "ngram", "gamma": gamma}, {"speculative": False}, {"proposer": "suffix", "gamma": gamma}][
            i % 3
        ]
        seqs.append(scheduler.submit(prompt, max_new_tokens=40 - i, **kw))
    scheduler.run()
    for i, (seq, ref) in enumerate(zip(seqs, solo_greedy)):
        assert seq.tokens == ref[: 40 - i], PROMPTS[i]
        assert all(k <= gamma for k, _ in seq.stats.round_sizes)  # free proposals too stop at the gamma
    assert scheduler.stall_rows <= 16
    assert max(scheduler.batch_sizes) == 4 and scheduler.idle


def _run_counting_draft_calls(batch, scheduler) -> list[int]:
    """Run the scheduler; the number of sequences of every call of the draft's batch graph."""
    calls: list[int] = []
    inner = batch.draft_slots.forward
    batch.draft_slots.forward = lambda c: calls.append(len(c)) or inner(c)
    try:
        scheduler.run()
    finally:
        del batch.draft_slots.forward
    return calls


@pytest.mark.parametrize("proposer", ["draft", "hybrid"])
def test_draft_model_drafts_batched(pair, solo_greedy, proposer):
    """With a fixed gamma every sequence drafts with the draft's batch graph (one draft call per
    step for all of them): greedy output still equals solo target-only."""
    _, batch = pair
    scheduler = batch.scheduler()
    seqs = [scheduler.submit(p, max_new_tokens=40, proposer=proposer, gamma=3) for p in PROMPTS]
    calls = _run_counting_draft_calls(batch, scheduler)
    for seq, ref in zip(seqs, solo_greedy):
        assert seq.tokens == ref and seq.proposer == proposer and seq.drafts_with_model
    assert sum(s.stats.by_source.get("draft", [0, 0, 0])[1] for s in seqs) > 0
    assert max(calls) > 1  # draft steps of several sequences in one call


@pytest.mark.slow  # ~24 s; test_sampling_law_per_sequence_in_a_batch keeps the batch law in the default run
def test_sampling_law_with_a_batched_draft_model(pair):
    """Sampled drafts from the draft's batch graph (q its distribution, gamma 3), 4 sequences at a
    time: the first two tokens follow the target law (chi-square, two-sample TV)."""
    solo, batch = pair
    (eos,) = solo.eos
    ids = solo.codec.encode("The quick brown fox")
    N = 2000
    scheduler = batch.scheduler()
    kw = dict(max_new_tokens=2, temperature=1.0, top_k=0)
    seqs = [scheduler.submit(ids, seed=s, gamma=3, proposer="draft", seeded_noise=False, **kw) for s in range(N)]
    scheduler.run()
    assert sum(s.stats.drafted for s in seqs) > N  # most first rounds drafted with the model
    spec = [first_pair(s.result(), eos) for s in seqs]
    base = sample_pairs(solo, ids, range(N, 2 * N), False, temperature=1.0, top_k=0)
    check_pairs_follow_target(solo.target, ids, spec, base, eos, "draft in a batch")


def test_a_sequence_alone_in_the_batch_graph_equals_solo(pair, solo_greedy):
    _, batch = pair
    for prompt, ref in zip(PROMPTS[:3], solo_greedy):
        assert batch.generate(prompt, max_new_tokens=40, proposer="ngram").token_ids == ref


def test_cancelled_slot_is_reused_within_one_round(pair):
    _, batch = pair
    scheduler = batch.scheduler()
    seqs = [scheduler.submit(p, max_new_tokens=200, speculative=False) for p in PROMPTS[:5]]
    scheduler.step()
    scheduler.step()
    assert [s.slot for s in seqs[:4]] == [0, 1, 2, 3] and seqs[4].slot is None
    victim = seqs[1]
    scheduler.cancel(victim)
    cancelled_at = scheduler.round
    assert victim.finish_reason == "cancelled" and victim.slot is None
    scheduler.step()
    joins = [e for e in scheduler.events if e.kind == "join" and e.sequence == seqs[4].id]
    cancels = [e for e in scheduler.events if e.kind == "cancel"]
    assert cancels == [type(cancels[0])(cancelled_at, "cancel", victim.id, 1)]
    assert joins and joins[0].slot == 1 and joins[0].round == cancelled_at
    assert victim.result().finish_reason == "cancelled"


def test_waiting_request_cancelled_before_it_runs(pair):
    _, batch = pair
    scheduler = batch.scheduler()
    seqs = [scheduler.submit(p, max_new_tokens=5, speculative=False) for p in PROMPTS[:6]]
    scheduler.cancel(seqs[5])
    scheduler.run()
    assert seqs[5].finish_reason == "cancelled" and seqs[5].tokens == []
    assert all(s.finish_reason in ("eos", "length") for s in seqs[:5])
    assert [e.sequence for e in scheduler.events if e.kind == "join"] == [s.id for s in seqs[:5]]


def test_sampling_law_per_sequence_in_a_batch(pair):
    """N sequences of one prompt with seeds 0..N-1 run 4 at a time (prompt lookup, gamma 3, on a
    prompt of 200 distinct tokens, so most first tokens have a draft): the first two tokens follow
    the target law (chi-square against the exact pair distribution from the batch-1 graph;
    two-sample TV against solo target-only)."""
    solo, batch = pair
    (eos,) = solo.eos
    pool = [t for t in range(5, solo.manifest.target.vocab_size) if t != eos]
    ids = [int(t) for t in np.random.default_rng(0).permutation(pool)[:200]]
    N = 2000

    scheduler = batch.scheduler()
    seqs = [
        scheduler.submit(
            ids, max_new_tokens=2, seed=s, temperature=1.0, top_k=0, gamma=3, proposer="ngram", seeded_noise=False
        )
        for s in range(N)
    ]
    scheduler.run()
    spec = [first_pair(s.result(), eos) for s in seqs]
    assert sum(s.stats.drafted for s in seqs) > N // 4  # drafts were verified, not only plain steps
    base = sample_pairs(solo, ids, range(N, 2 * N), False, temperature=1.0, top_k=0)
    check_pairs_follow_target(solo.target, ids, spec, base, eos, "ngram in a batch")


def test_slot_model_rows_equal_batch1_rows_bitwise(pair):
    """Logits of one slot's rows do not depend on the other slots' sequences or row counts, nor
    on which slots sit idle (no rows in the call)."""
    solo, batch = pair
    model, one = batch.slots, solo.target
    prefix = solo.codec.encode("the quick brown fox jumps over")
    tokens = solo.codec.encode(" the lazy dog again and again")[:6]
    one.reset()
    one.forward(prefix)
    ref = one.forward(tokens, last_rows=len(tokens)).copy()
    for slot in (0, 2, 3):
        for others in ([], [1], [1, 7, 3]):
            busy = [b for b in range(4) if b != slot][: len(others)]
            model.lengths[:] = 0
            model.forward([SlotCall(b, prefix[b:] or prefix, 1) for b in range(4)])
            model.lengths[slot] = 0
            model.forward([SlotCall(slot, prefix, 1)])
            calls = [SlotCall(slot, tokens, len(tokens))] + [SlotCall(b, tokens[:n], 1) for b, n in zip(busy, others)]
            got = model.forward(calls)[0]
            assert np.array_equal(got, ref), (slot, others)
    model.lengths[:] = 0
    one.reset()


def test_a_1_5_batch_artifact_feeds_idle_slots_a_row(tiny_artifacts, tmp_path, solo_greedy):
    """A manifest that declares contract 1.5 runs its batch graph with one throwaway row per idle
    slot (1.5 graphs need a row in every slot); the output is unchanged."""
    from specexport_runtime.slots import idle_rows

    assert (idle_rows("1.5"), idle_rows("1.6")) == (1, 0)
    root = tmp_path / "artifact"
    shutil.copytree(tiny_artifacts[KIND], root)
    data = json.loads((root / "manifest.json").read_text())
    data["contract_version"] = "1.5"
    (root / "manifest.json").write_text(json.dumps(data))
    old = load(root, batch=True, verify=False)
    assert old.slots.idle_rows == 1
    results = old.batch(PROMPTS[:2], max_new_tokens=20, speculative=False)
    assert [r.token_ids for r in results] == [ref[:20] for ref in solo_greedy[:2]]


def test_slot_model_refuses_bad_calls(pair):
    _, batch = pair
    model = batch.slots
    with pytest.raises(InvalidArgument, match="slot 4"):
        model.forward([SlotCall(4, [1], 1)])
    with pytest.raises(InvalidArgument, match="fed twice"):
        model.forward([SlotCall(0, [1], 1), SlotCall(0, [2], 1)])
    with pytest.raises(InvalidArgument, match="last_rows"):
        model.forward([SlotCall(1, [1, 2], 3)])


def test_batch_needs_a_batch_graph(tiny_artifacts, gens):
    with pytest.raises(InvalidArgument, match="max_batch"):
        gens("noisy-fused").batch(["hi"])
    with pytest.raises(InvalidArgument, match="max_batch"):
        load(tiny_artifacts["noisy-fused"], batch=True)


def _seq(alpha: float, proposed: float) -> BatchSequence:
    s = BatchSequence(0, [1], None, "ngram")  # type: ignore[arg-type]
    s._alpha, s._proposed = alpha, proposed
    return s


def _gamma() -> BatchGamma:
    """A BatchGamma whose record of the test sequences' proposer is long enough to stand on."""
    g = BatchGamma(gamma_max=8)
    g.evidence["ngram"] = EVIDENCE_ROUNDS
    return g


def test_batch_gamma_turns_down_when_rows_are_dear():
    g = _gamma()
    assert g.choose([_seq(0.9, 1.0)]) == PROBE_GAMMA  # no call with draft rows timed: a probe times one
    g.record(1, 1, 0.010)
    assert g.choose([_seq(0.9, 1.0)]) == PROBE_GAMMA
    g.record(1, 9, 0.012)  # rows nearly free: long drafts pay
    assert g.choose([_seq(0.9, 1.0)]) == 8
    assert g.choose([_seq(0.9, 1.0)] * 4) == 8  # one probe serves every batch size
    dear = _gamma()
    for rows, ms in ((8, 40.0), (72, 200.0)):  # eight sequences, each row costs 2.5 ms
        dear.record(8, rows, ms / 1e3)
    assert dear.choose([_seq(0.3, 1.0)] * 8) == 0
    assert dear.choose([_seq(0.99, 1.0)] * 8) > 0


def test_batch_gamma_probes_until_a_proposer_has_a_record():
    """Acceptance 0.3 says gamma 0, but while the proposer has drafted in fewer than
    EVIDENCE_ROUNDS rounds that alpha is only its prior: rounds probe with PROBE_GAMMA."""
    g = BatchGamma(gamma_max=8)
    for rows, ms in ((8, 40.0), (72, 200.0)):
        g.record(8, rows, ms / 1e3)
    low = [_seq(0.3, 1.0)] * 8
    for _ in range(EVIDENCE_ROUNDS - 1):
        assert g.choose(low) == PROBE_GAMMA
        g.learn("ngram", 0.3, 1.0)
    g.learn("ngram", None, 0.0)  # a round without a draft is no evidence of the acceptance
    assert g.choose(low) == PROBE_GAMMA
    g.learn("ngram", 0.3, 1.0)
    assert g.choose(low) == 0
    # running means (8 of 9 asked rounds drafted), and one sequence's acceptance leans on the prior
    shrunk = (0.3 + TRUST_SEQUENCES * PRIOR_ALPHA) / (1 + TRUST_SEQUENCES)
    assert g.prior("ngram") == pytest.approx((shrunk, 8 / 9))
    plain = _seq(0.3, 1.0)
    plain.proposer = "none"  # a sequence that does not speculate needs no record
    assert BatchGamma(gamma_max=8).choose([plain]) == PROBE_GAMMA  # the call-size probe still comes first
    futile = BatchGamma(gamma_max=8)
    for rows, ms in ((8, 40.0), (72, 360.0)):  # each row costs a whole row's share of a plain call
        futile.record(8, rows, ms / 1e3)
    assert futile.choose(low) == 0  # even drafts that were always accepted could not pay: no probe


def test_batch_gamma_prices_the_draft_backlog():
    """A draft model reads what it missed (a prompt, the tokens of plain rounds) in one call
    before it drafts, at its fitted cost per row, spread over the rounds the sequence may still
    draft (half its tokens left, at most SWITCH_ROUNDS): with rows nearly free and cheap steps a
    short backlog drafts, and so does a long one with many tokens left; a long one near the end
    does not, and a sequence without a draft model pays none."""
    g = _gamma()
    for rows, ms in ((2, 20.0), (18, 24.0)):  # two sequences: rows nearly free
        g.record(2, rows, ms / 1e3)
    g.record_draft(2, 2, 0.001)  # a step: 1 ms
    g.record_draft(2, 402, 0.401)  # a catch-up of 400 rows: 1 ms a row
    s = _seq(0.8, 1.0)
    s.drafts_with_model = True
    for unread, left, drafts in ((2, 8, True), (20, 8, True), (200, 1000, True), (200, 16, False)):
        s.draft_unread, s.tokens_left = unread, left
        assert (g.choose([s, s]) > 0) == drafts, (unread, left)
    assert g.switch_seconds([(200, 16)] * 2) == pytest.approx(2 * 198 * 0.001 / 8)
    assert g.switch_seconds([(200, 10_000)]) == pytest.approx(198 * 0.001 / SWITCH_ROUNDS)
    assert g.switch_seconds([(2, 1)] * 2) == 0.0  # a step's rows: no catch-up
    free = _seq(0.8, 1.0)
    free.draft_unread, free.tokens_left = 200, 16  # not read by a model: no catch-up to pay
    assert g.choose([free, free]) > 0


def test_batch_gamma_prices_a_draft_step_at_an_untimed_batch_size():
    """Steps timed at 1 sequence (10 ms) and a catch-up (the draft's line: 9 ms + 1 ms a row):
    a step of 8 sequences is the line at 8 rows (17 ms), not the 1-sequence step; a batch size
    with steps of its own takes theirs. With the target's rows nearly free and alpha 0.9, drafts
    pay at 8 sequences at the 1-sequence price and not at the line's."""
    g = _gamma()
    g.record_draft(1, 1, 0.010)
    g.record_draft(1, 101, 0.110)  # the line through both: 9 ms + 1 ms a row
    assert g.draft_seconds(1) == pytest.approx(0.010)
    assert g.draft_seconds(8) == pytest.approx(0.009 + 8 * 0.001)
    g.record_draft(8, 8, 0.030)
    assert g.draft_seconds(8) == pytest.approx(0.030)
    priced = _gamma()
    for rows, ms in ((8, 40.0), (40, 56.0)):  # eight sequences: 40 ms a call, 0.5 ms a row
        priced.record(8, rows, ms / 1e3)
    s = _seq(0.8, 1.0)
    s.drafts_with_model = True
    priced.record_draft(1, 1, 0.010)
    assert priced.choose([s] * 8) > 0  # at the 1-sequence step (10 ms) drafts would pay
    priced.record_draft(1, 201, 0.410)  # the line: 8 ms + 2 ms a row, so a step of 8 costs 24 ms
    assert priced.choose([s] * 8) == 0


def test_batch_gamma_guard_drafts_where_rounds_realize_more():
    """The model says 0 (each row costs 2.5 ms, alpha 0.3), but steady rounds with drafts of
    gamma 3 realized twice the plain rate: the batch drafts with gamma 3; at half the plain
    rate it stays at 0."""
    g = _gamma()
    for rows, ms in ((8, 40.0), (72, 200.0)):
        g.record(8, rows, ms / 1e3)
    seqs = [_seq(0.3, 1.0)] * 8
    assert g.choose(seqs) == 0
    for _ in range(GUARD_ROUNDS):
        g.observe(8, False, 8, 0.040)  # 200 tok/s
        g.observe(8, True, 24, 0.060, gamma=3)  # 400 tok/s
    assert g.choose(seqs) == 3
    slow = _gamma()
    for rows, ms in ((8, 40.0), (72, 200.0)):
        slow.record(8, rows, ms / 1e3)
    for _ in range(GUARD_ROUNDS):
        slow.observe(8, False, 8, 0.040)
        slow.observe(8, True, 8, 0.080, gamma=3)  # 100 tok/s
    assert slow.choose(seqs) == 0


def test_realized_drafting_overrules_a_zero_only_with_the_draft_catch_up_paid():
    """Steady rounds with drafts realized twice the plain rate and the model says 0 (rows cost
    2.5 ms, alpha 0.3). Sequences drafting with a draft model must first read their backlog
    (1 ms a row, spread over 32 rounds): with 2 unread tokens each the batch drafts with gamma 3
    as the rounds did; with 400 each (0.1 s a round) drafting would realize 24 tokens in 0.16 s,
    below plain's 200 tok/s, and the batch stays plain."""

    def pick(unread: int) -> int:
        g = _gamma()
        for rows, ms in ((8, 40.0), (72, 200.0)):
            g.record(8, rows, ms / 1e3)
        g.record_draft(8, 8, 0.008)  # a step: 8 ms
        g.record_draft(8, 808, 0.808)  # a catch-up: 1 ms a row
        for _ in range(GUARD_ROUNDS):
            g.observe(8, False, 8, 0.040)  # 200 tok/s
            g.observe(8, True, 24, 0.060, gamma=3)  # 400 tok/s, no catch-up in them
        s = _seq(0.3, 1.0)
        s.drafts_with_model, s.draft_unread, s.tokens_left = True, unread, 1000
        return g.choose([s] * 8)

    assert pick(2) == 3
    assert pick(400) == 0


def test_batch_cost_fits_rows_and_running_sequences():
    """Cells from seconds = 0.02 + 0.001 rows + 0.004 running (an independent line) come back."""
    cost = BatchCost(smoothing=1.0)
    for running, rows in ((1, 1), (2, 2), (4, 4), (8, 8)):
        cost.record(running, rows, 0.02 + 0.001 * rows + 0.004 * running)
    assert cost.fit() is None  # rows and running moved together: a draft row's cost is unknown
    cost.record(2, 10, 0.02 + 0.010 + 0.008)
    a, b, c = cost.fit()
    assert abs(a - 0.02) < 1e-9 and abs(b - 0.001) < 1e-9 and abs(c - 0.004) < 1e-9
    assert abs(cost.seconds(6, 30) - (0.02 + 0.030 + 0.024)) < 1e-9
    flat = BatchCost(smoothing=1.0)  # a call with more rows timed faster (noise): slope 0, not < 0
    flat.record(1, 1, 0.030)
    flat.record(1, 5, 0.020)
    assert flat.fit()[1] == 0.0 and abs(flat.seconds(1, 9) - 0.025) < 1e-9


def test_free_limit_adds_rows_while_they_bring_tokens_faster_than_plain_rounds():
    """Two sequences, a call costs 0.018 + 0.001 s per row: a plain round brings 2 tokens in
    0.020 s (100 tok/s), so a row (0.001 s) pays while it brings more than 0.1 tokens: the j-th
    row of a free draft brings alpha^j, so alpha 0.5 gives 3 rows (0.125 > 0.1 > 0.0625) and
    alpha 0.8 all 8 (0.8^8 = 0.17); before a record of EVIDENCE_ROUNDS the probe at least."""
    assert BatchGamma(gamma_max=8).free_limit(2) == 8  # no call with draft rows timed: free drafts time one

    def limit(alpha: float, rounds: int) -> int:
        g = BatchGamma(gamma_max=8)
        for rows in (2, 4, 10):
            g.record(2, rows, 0.018 + 0.001 * rows)
        for i in range(rounds):  # each round a sequence of its own: past SEQUENCES_KEPT the record stands
            g.learn(FREE, alpha, None, sequence=i)
        n = min(rounds, SEQUENCES_KEPT)
        shrunk = (n * alpha + TRUST_SEQUENCES * PRIOR_ALPHA) / (n + TRUST_SEQUENCES)
        assert g.prior(FREE)[0] == pytest.approx(shrunk) and g.prior("hybrid") == (0.5, 1.0)  # a record apart
        return g.free_limit(2)

    assert limit(0.05, EVIDENCE_ROUNDS - 1) == PROBE_GAMMA  # a record too short to stand on
    assert limit(0.05, 100) == 0  # 0.064 after the lean on the prior
    assert limit(0.5, 100) == 3
    assert limit(0.8, 100) == 8  # 0.79


def test_a_record_of_few_sequences_leans_on_the_prior():
    """One warm-up sequence that drafted well says little of the next prompt's text: a new
    sequence starts nearer PRIOR_ALPHA, and trusts the record more as sequences add to it."""
    g = BatchGamma(gamma_max=8)
    for _ in range(100):  # 100 rounds of one sequence
        g.learn("hybrid", 0.96, 1.0, sequence=7)
    one = g.prior("hybrid")[0]
    assert one == pytest.approx((0.96 + 2 * 0.5) / 3)
    for seq in range(8, 15):  # 7 more sequences, one round each
        g.learn("hybrid", 0.96, 1.0, sequence=seq)
    assert one < g.prior("hybrid")[0] == pytest.approx((8 * 0.96 + 2 * 0.5) / 10, abs=1e-6)
    for seq in range(100, 300):  # the count stops at SEQUENCES_KEPT
        g.learn("hybrid", 0.96, 1.0, sequence=seq)
    assert g.prior("hybrid")[0] == pytest.approx((64 * 0.96 + 2 * 0.5) / 66, abs=1e-6)
    assert len(g._sequences["hybrid"]) == SEQUENCES_KEPT


class _FreeOnly(BatchGamma):
    """The batch's model drafts are off (gamma 0); free retrieval drafts get `free` rows."""

    def __init__(self, free: int):
        super().__init__(gamma_max=8)
        self.free = free

    def choose(self, seqs) -> int:
        return 0

    def free_limit(self, running: int) -> int:
        return self.free


@pytest.mark.parametrize("free", [0, 6])
def test_free_drafts_run_while_the_batch_drafts_nothing(pair, solo_greedy, free):
    """hybrid in a batch whose model gamma is 0: where the text repeats its retrieval drafts
    still verify (up to the free limit), and no draft-model call is made; with a free limit of
    0 nothing is drafted at all. Greedy output equals solo target-only either way."""
    from specexport_runtime.batch import BatchScheduler

    _, batch = pair
    scheduler = BatchScheduler(batch, batch.slots, gamma=_FreeOnly(free), draft=batch.draft_slots)
    seqs = [scheduler.submit(p, max_new_tokens=40, proposer="hybrid") for p in PROMPTS]
    calls = _run_counting_draft_calls(batch, scheduler)
    for seq, ref in zip(seqs, solo_greedy):
        assert seq.tokens == ref
        assert all(k <= free for k, _ in seq.stats.round_sizes)
    assert (sum(s.stats.drafted for s in seqs) > 0) == (free > 0)
    assert sum(s.stats.lookup_rounds for s in seqs) == sum(len(s.stats.round_sizes) for s in seqs)  # all free
    assert calls == [] and not any(s.stats.by_source.get("draft") for s in seqs)


def test_batch_gamma_prices_the_draft_step():
    g = _gamma()
    for rows, ms in ((2, 20.0), (18, 24.0)):  # two sequences: rows nearly free
        g.record(2, rows, ms / 1e3)
    drafting = _seq(0.8, 1.0)
    drafting.drafts_with_model = True
    assert g.choose([drafting] * 2) == 8  # no draft step timed yet: its cost is not counted
    g.record_draft(2, 2, 0.030)  # each draft step costs more than the target call
    assert g.choose([drafting] * 2) == 0
    for _ in range(20):  # EMA: cheap steps bring it back
        g.record_draft(2, 2, 0.001)
    assert g.choose([drafting] * 2) > 0


def _runs(picks: list[int]) -> list[tuple[int, int]]:
    """(value, length) of each run of equal picks."""
    out: list[tuple[int, int]] = []
    for p in picks:
        out = out[:-1] + [(p, out[-1][1] + 1)] if out and out[-1][0] == p else out + [(p, 1)]
    return out


def test_batch_gamma_guard_follows_what_rounds_realize():
    """The model promises a gain (rows nearly free, alpha 0.9), but whole drafting rounds realize
    fewer tokens per second than plain ones: the guard turns drafting down, save rechecks of
    RECHECK_ROUNDS drafting rounds in a row (the rounds after the first are observed), each
    interval twice the last; where drafting realizes more, the model's gamma stands."""
    g = _gamma()
    g.record(2, 2, 0.010)
    g.record(2, 18, 0.012)
    seqs = [_seq(0.9, 1.0)] * 2
    assert g.choose(seqs) == 8  # nothing realized yet: the model's choice
    for _ in range(GUARD_ROUNDS):
        g.observe(2, True, 4, 0.100)  # 40 tok/s with drafts
    picks = [g.choose(seqs) for _ in range(2 * RECHECK_EVERY + RECHECK_ROUNDS)]
    # too few plain rounds to compare: a plain recheck of RECHECK_ROUNDS rounds every RECHECK_EVERY
    assert [r for r in _runs(picks) if r[0] == 0] == [(0, RECHECK_ROUNDS)] * 2
    for _ in range(GUARD_ROUNDS):
        g.observe(2, False, 2, 0.020)  # 100 tok/s without
    picks = [g.choose(seqs) for _ in range(16 * RECHECK_EVERY)]
    drafting = [i for i, p in enumerate(picks) if p == 8]
    runs = _runs(picks)
    assert {r for r in runs if r[0] == 8} == {(8, RECHECK_ROUNDS)}  # rechecks come as whole runs
    starts = [drafting[0]] + [b for a, b in zip(drafting, drafting[1:]) if b > a + 1]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 3 and all(b == 2 * a for a, b in zip(gaps, gaps[1:]))  # the interval doubles
    for _ in range(40):
        g.observe(2, True, 40, 0.100)  # drafting now realizes 400 tok/s
    assert [g.choose(seqs) for _ in range(RECHECK_EVERY)] == [8] * RECHECK_EVERY
    assert g.rate(3, True) is None  # per bucket of batch sizes (1, 2, 3-4, 5-8, ...)
    for _ in range(GUARD_ROUNDS):
        g.observe(3, False, 3, 0.030)
    assert g.rate(4, False) == 100.0 and g.rate(5, False) is None


def test_a_runtime_older_than_the_batch_graph_refuses_it_in_one_line(tiny_artifacts, monkeypatch):
    """A 1.5 runtime reads 1.4 artifacts (batch 1) but refuses a 1.6 one by its version."""
    from specexport_runtime import contract
    from specexport_runtime.errors import ArtifactError

    monkeypatch.setattr(contract, "CONTRACT_VERSION", "1.5")
    with pytest.raises(ArtifactError) as info:
        load(tiny_artifacts[KIND])
    assert "'1.6' is not supported" in str(info.value) and "\n" not in str(info.value)
    assert load(tiny_artifacts["noisy-fused"]).manifest.target.max_batch == 1


def test_a_recheck_waits_while_its_draft_catch_up_would_sink_it():
    """Drafting realized less than plain rounds, and a recheck is due. With a short backlog the
    recheck drafts; with a long one that the model spreads over many rounds (so it still says
    draft) but that the recheck's RECHECK_ROUNDS rounds alone would pay for, it waits another
    interval and the batch decodes plainly."""

    def guarded(unread: int) -> list[int]:
        g = _gamma()
        for rows, ms in ((2, 20.0), (18, 24.0)):  # two sequences: rows nearly free
            g.record(2, rows, ms / 1e3)
        g.record_draft(2, 2, 0.001)  # a step: 1 ms
        g.record_draft(2, 402, 0.401)  # a catch-up: 1 ms a row
        for _ in range(GUARD_ROUNDS):
            g.observe(2, True, 4, 0.100)  # 40 tok/s with drafts
            g.observe(2, False, 2, 0.020)  # 100 tok/s without
        s = _seq(0.8, 1.0)
        s.drafts_with_model, s.draft_unread, s.tokens_left = True, unread, 1000
        return [g.choose([s, s]) for _ in range(2 * RECHECK_EVERY)]  # one recheck is due in these

    short, long = guarded(4), guarded(400)
    assert max(long) == 0 < max(short)  # the model says draft for both; only the short recheck runs
    assert [r for r in _runs(short) if r[0] > 0] == [(max(short), RECHECK_ROUNDS)]
