"""Rollback and the KV cursor under speculative decoding on the tiny artifacts, driving
SpeculativeLoop directly: random accept/reject patterns from a custom proposer keep greedy output
exact (a rejected draft token's K/V row never leaks), the verifier accepts exactly the correct
prefix of every proposal, the cursor rule holds after every round, no stale cache rows remain,
and the loop's counts are exact without truncation.
"""

from __future__ import annotations

import numpy as np
import pytest
from exactness_support import (
    PROMPTS,
    fixture_gens,  # noqa: F401 (this module's `gens` fixture)
)

from specexport_runtime.adaptive import GammaController
from specexport_runtime.config import GeneratorConfig
from specexport_runtime.engine import OrtModel, SessionConfig
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.generator import GenerationStats, LoopSetup, SpeculativeLoop
from specexport_runtime.policy import RoundDraft
from specexport_runtime.proposers import DraftModelProposer, NgramLookupProposer, Proposal, Proposer
from specexport_runtime.sampling import SamplingParams

GREEDY = SamplingParams()  # run_loop's default: greedy


class RandomProposer(Proposer):
    """Proposes random-length drafts: a random number of correct tokens (the target's greedy
    continuation, known from a target-only reference) followed by random wrong tokens, so
    every accept/reject pattern occurs; checks the cache cursor rule on every call."""

    name = "random"

    def __init__(self, reference: list[int], target: OrtModel, vocab: int, seed: int):
        self.reference, self.target, self.vocab = reference, target, vocab
        self.rng = np.random.default_rng(seed)
        self.expected: list[tuple[int, int]] = []  # (k, n_accepted expected) per non-empty proposal
        self.cursor_errors: list[tuple[int, int]] = []
        self.commits = 0

    def start(self, prompt):
        self.prompt_len = len(prompt)

    def propose(self, committed, gamma, params, rng) -> Proposal:
        if self.target.length != len(committed) - 1:
            self.cursor_errors.append((self.target.length, len(committed)))
        pos = len(committed) - self.prompt_len  # index of the next token in the reference
        k = int(self.rng.integers(0, gamma + 1))  # 0 = nothing drafted (plain step)
        good = int(self.rng.integers(0, k + 1))
        tokens = self.reference[pos : pos + good]
        if good < k:
            wrong = int(self.rng.integers(0, self.vocab - 1))
            if wrong >= self.reference[pos + good]:
                wrong += 1  # uniform over the tokens that are not the target's choice
            tokens = tokens + [wrong] + self.rng.integers(0, self.vocab, size=k - good - 1).tolist()
        if k:
            self.expected.append((k, good))
        return Proposal([int(t) for t in tokens], None)

    def commit(self, committed, n_new):
        self.commits += 1
        if self.target.length != len(committed) - 1:
            self.cursor_errors.append((self.target.length, len(committed)))


def record_rounds(stats: GenerationStats) -> list[tuple[int, int]]:
    """Wrap stats.record_round to log (k, n) of every round (k: drafted tokens, forced ones
    included; no grammar here, so none are forced)."""
    log: list[tuple[int, int]] = []
    original = stats.record_round

    def record(k, n, forced=0):
        assert forced == 0
        log.append((k, n))
        original(k, n, forced)

    stats.record_round = record
    return log


def run_loop(
    gen,
    proposer,
    prompt: list[int],
    n_tokens: int,
    gamma: int | None,
    controller=None,
    params: SamplingParams = GREEDY,
    seed: int = 0,
):
    """Drive SpeculativeLoop directly (no truncation): returns (generated, stats, per-round (k, n)
    log, cursor after every round)."""
    config = GeneratorConfig(
        max_new_tokens=n_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        gamma=gamma,
    )
    stats = GenerationStats()
    log = record_rounds(stats)
    policy = RoundDraft.of(config, controller)
    loop = SpeculativeLoop(
        LoopSetup(gen.target, proposer, config, np.random.default_rng(seed), policy=policy, stats=stats)
    )
    out: list[int] = []
    cursors: list[tuple[int, int]] = []
    for new in loop.rounds(prompt, gen.manifest.max_context):
        out += new
        cursors.append((gen.target.length, len(prompt) + len(out)))
        if len(out) >= n_tokens:
            break
    return out, stats, log, cursors


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", ["ngram", "int8", "int8-fused"])
def test_random_accept_reject_rollback_is_exact(gens, kind, seed):
    gen = gens(kind)
    prompt = gen.codec.encode(PROMPTS[1]) if seed % 2 else list(PROMPTS[4])
    n = 120
    reference = gen.generate(prompt, max_new_tokens=n + 40, speculative=False).token_ids
    proposer = RandomProposer(reference, gen.target, gen.manifest.target.vocab_size, seed)
    out, stats, log, cursors = run_loop(gen, proposer, prompt, n, gamma=6)
    assert out[:n] == reference[:n], "a rejected draft token's K/V row leaked into later rounds"
    # the verifier accepted exactly the correct prefix of every proposal
    assert log == proposer.expected
    ks = {k for k, _ in log}
    ns = {n_acc for _, n_acc in log}
    assert len(ks) >= 4 and len(ns) >= 4, "the random proposer did not cover enough patterns"
    assert stats.corrections > 0 and stats.bonus > 0 and stats.plain_steps > 0
    assert proposer.cursor_errors == []
    assert all(cursor == committed - 1 for cursor, committed in cursors)
    assert len(out) == 1 + stats.accepted + stats.corrections + stats.bonus + stats.plain_steps


def fresh_rows(path, spec, max_context, ids: list[int]) -> list[np.ndarray]:
    model = OrtModel(path, spec, max_context, SessionConfig())
    model.forward(ids)
    return [r.copy() for r in model.kv_rows(0, len(ids))]


@pytest.mark.parametrize("kind", ["noisy", "noisy-fused"])
@pytest.mark.parametrize("gamma", [3, None])
def test_kv_cursor_after_every_round_and_no_stale_rows(gens, tiny_artifacts, gamma, kind):
    """After every round the target cursor is len(committed) - 1 and the draft's is at most
    that; at the end the valid cache rows equal those of a fresh prefill of the committed
    tokens (rows of rejected tokens were overwritten before being read, or never read)."""
    gen = gens(kind)
    root, m = tiny_artifacts[kind], gen.manifest
    prompt = gen.codec.encode(PROMPTS[0])
    draft = DraftModelProposer(gen.draft, m.target.embedding_rows)
    draft_cursors: list[tuple[int, int]] = []
    commit = draft.commit

    def checked_commit(committed, n_new):
        commit(committed, n_new)
        draft_cursors.append((gen.draft.length, len(committed)))

    draft.commit = checked_commit
    ctl = GammaController(gamma_max=8, gamma=4) if gamma is None else None
    out, stats, log, cursors = run_loop(gen, draft, prompt, 90, gamma=gamma, controller=ctl)
    assert stats.corrections > 0
    assert all(cursor == committed - 1 for cursor, committed in cursors)
    assert all(cursor <= committed - 1 for cursor, committed in draft_cursors)
    committed = prompt + out
    for model, entry in ((gen.target, m.target), (gen.draft, m.draft)):
        n = model.length
        expected = fresh_rows(root / entry.graph, entry.graph_spec(), m.max_context, committed[:n])
        for rows, ref in zip(model.kv_rows(0, n), expected):
            np.testing.assert_allclose(rows, ref, atol=1e-4, rtol=1e-4)


def test_loop_counts_exact_without_truncation(gens):
    """Driving the loop directly (no max_new_tokens cut): emitted == 1 + accepted + rounds + plain."""
    gen = gens("noisy")
    prompt = gen.codec.encode(PROMPTS[2])
    for gamma, ctl in ((4, None), (None, GammaController(gamma_max=8, gamma=4))):
        proposer = DraftModelProposer(gen.draft, gen.manifest.target.embedding_rows)
        out, stats, log, _ = run_loop(gen, proposer, prompt, 60, gamma=gamma, controller=ctl)
        assert len(out) == 1 + stats.accepted + stats.corrections + stats.bonus + stats.plain_steps
        assert len(log) == stats.rounds
        assert sum(k for k, _ in log) == stats.drafted and sum(n for _, n in log) == stats.accepted
        assert stats.bonus == sum(n == k for k, n in log)
        for i in range(len(stats.drafted_at)):
            assert stats.drafted_at[i] == sum(k > i for k, _ in log)
            assert stats.accepted_at[i] == sum(n > i for _, n in log)
    proposer = NgramLookupProposer((3, 2, 1))
    out, stats, log, _ = run_loop(gen, proposer, list(PROMPTS[3]), 60, gamma=5)
    assert len(out) == 1 + stats.accepted + stats.rounds + stats.plain_steps
    assert stats.rounds > 0


def test_move_rows_against_a_hand_built_cache():
    """Rows 5, 7, 8 of a [1, T, H, D] and a [1, H, T, D] buffer land at rows 3, 4, 5; every other
    row stays; bad paths are refused in one line."""
    from specexport_runtime.model import move_rows

    T, H, D = 12, 2, 3
    for time_axis in (1, 2):
        rows = np.arange(T, dtype=np.float32)[:, None, None] * 100 + np.arange(H * D).reshape(1, H, D)  # [T, H, D]
        buf = np.ascontiguousarray(np.moveaxis(rows[None], 1, time_axis))  # row t holds 100 t + (h, d)
        expected = rows.copy()
        expected[3:6] = rows[[5, 7, 8]]
        move_rows([buf], time_axis, [5, 7, 8], 3)
        assert np.array_equal(np.moveaxis(buf[0], time_axis - 1, 0), expected)
        for src, dst in (([4, 3], 3), ([2], 3), ([5, 12], 3)):
            with pytest.raises(InvalidArgument):
                move_rows([buf], time_axis, src, dst)


@pytest.mark.parametrize("kind", ["noisy", "noisy-fused"])
def test_keep_path_leaves_the_rows_a_chain_call_wrote(gens, tiny_artifacts, kind):
    """A 6-row call after a prefix stands in for a tree call (row r at cache row P + r); keeping
    rows 2 and 4 gives the cursor P + 3 and cache rows P + 1, P + 2 equal to the call's rows 2 and
    4 (their K/V as that call wrote them), the prefix untouched. Both cache layouts."""
    gen = gens(kind)
    model = OrtModel(
        tiny_artifacts[kind] / gen.manifest.target.graph, gen.manifest.target.graph_spec(), 64, SessionConfig()
    )
    prompt = gen.codec.encode(PROMPTS[0])[:10]
    model.forward(prompt)
    P = model.length - 1  # the tree's root is the last prompt token, re-fed: rows P .. P + 5
    model.truncate(P)
    model.forward([prompt[-1], 11, 12, 13, 14, 15], last_rows=6)
    before = [r.copy() for r in model.kv_rows(0, P + 6)]
    model.keep_path(P, [2, 4])
    assert model.length == P + 3
    after = model.kv_rows(0, P + 3)
    for b, a in zip(before, after):
        assert np.array_equal(a[: P + 1], b[: P + 1]) and np.array_equal(a[P + 1 : P + 3], b[[P + 2, P + 4]])
    with pytest.raises(InvalidArgument):
        model.keep_path(P, [3])  # row 3 is past the kept rows now
