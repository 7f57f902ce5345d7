"""seeded.py alone (no model): the SplitMix64 uniforms, the law of a seeded pick per seed stream
(chi-square against p, with power against a wrong law), independence of positions, and seeded
verification of chains and trees against step-by-step picks."""

from __future__ import annotations

import numpy as np
import pytest
from exactness_support import ALPHA, chi2_sf, chi2_stat

from specexport_runtime.errors import InvalidArgument
from specexport_runtime.seeded import (
    SeededNoise,
    draw,
    position_key,
    seeded_pick,
    stream_for,
    tree_picks,
    uniforms,
    verify_seeded,
)
from specexport_runtime.tree import DraftTree, verify_tree_greedy

# a law with a wide range of masses, zeros (a top-k / top-p cut) and one tiny entry
P = np.array([0.30, 0.0, 0.20, 0.15, 0.12, 0.0, 0.10, 0.06, 0.04, 0.025, 0.005])
P = P / P.sum()


def test_splitmix64_reference_values():
    """position_key is SplitMix64's mix of known inputs: mix(GOLDEN) of state 0 is the first output
    of SplitMix64 seeded with 0, 0xE220A8397B1DCDAF (the published reference value)."""
    from specexport_runtime.seeded import _GOLDEN, _mix

    assert _mix(_GOLDEN) == 0xE220A8397B1DCDAF
    assert _mix((_GOLDEN * 2) & ((1 << 64) - 1)) == 0x6E789E6AA1B965F4  # its second output
    # element i of the stream at key k is mix(k + (i + 1) * GOLDEN): uniforms reads that stream
    k = position_key(3, 17)
    z = _mix((k + 5 * _GOLDEN) & ((1 << 64) - 1))
    assert uniforms(3, 17, np.array([4]))[0] == ((z >> 11) + 0.5) / 2.0**53


def test_uniforms_are_deterministic_open_interval_and_keyed():
    ids = np.arange(50_000)
    u = uniforms(7, 12, ids)
    assert u.dtype == np.float64 and u.shape == ids.shape
    assert np.all((u > 0) & (u < 1))
    np.testing.assert_array_equal(u, uniforms(7, 12, ids))
    np.testing.assert_array_equal(u[[5, 40_000]], uniforms(7, 12, np.array([5, 40_000])))  # random access
    for other in (uniforms(8, 12, ids), uniforms(7, 13, ids)):  # another seed, another position
        assert np.mean(u == other) < 1e-3
    # uniform on 20 equal bins (chi-square), and no linear correlation between neighbouring ids
    counts = np.bincount((u * 20).astype(int), minlength=20)
    stat, df = chi2_stat(counts.astype(float), np.full(20, 1 / 20))
    assert chi2_sf(stat, df) > ALPHA
    assert abs(np.corrcoef(u[:-1], u[1:])[0, 1]) < 0.02


def _chi2_p(samples: list[int], p: np.ndarray) -> float:
    keep = p > 0
    counts = np.bincount(samples, minlength=p.size).astype(float)
    assert counts[~keep].sum() == 0, "a zero-probability token was picked"
    stat, df = chi2_stat(counts[keep], p[keep])
    return chi2_sf(stat, df)


@pytest.mark.parametrize("over", ["seeds", "positions"])
def test_seeded_pick_follows_p(over):
    """N = 20,000 picks of P: over seeds at one position, and along one seed's stream over
    positions. Chi-square p-value > ALPHA = 1e-4 (cells: P's support, expected counts >= 100)."""
    N = 20_000
    if over == "seeds":
        samples = [seeded_pick(P, s, 42) for s in range(N)]
    else:
        samples = [seeded_pick(P, 5, t) for t in range(N)]
    assert _chi2_p(samples, P) > ALPHA
    # power: the same counts against a wrong law (P squared, renormalized) are far off
    wrong = P**2 / (P**2).sum()
    assert _chi2_p(samples, wrong) < 1e-12


def test_neighbouring_positions_are_independent():
    """Pairs (pick at t, pick at t + 1) over seeds follow the product law P x P (chi-square over
    cells with expected count >= 5; the rest pooled away by dropping them from both sides)."""
    N = 20_000
    pairs = [(seeded_pick(P, s, 9), seeded_pick(P, s, 10)) for s in range(N)]
    joint = np.outer(P, P).ravel()
    counts = np.bincount([a * P.size + b for a, b in pairs], minlength=joint.size).astype(float)
    keep = joint * N >= 5
    rest = ~keep & (joint > 0)
    c = np.append(counts[keep], counts[rest].sum())
    e = np.append(joint[keep], joint[rest].sum())
    stat, df = chi2_stat(c, e)
    assert chi2_sf(stat, df) > ALPHA


@pytest.mark.parametrize("vocab", [50, 5000, 20000])
def test_seeded_pick_is_the_argmax_of_the_whole_race(vocab):
    """Against the race written out over the whole support (no blocks, no pruning), on peaked and
    flat rows, full and filtered (zeros): seeded_pick's blocks and its bound change nothing."""
    from specexport_runtime.sampling import SamplingParams, probabilities

    rng = np.random.default_rng(vocab)
    for trial in range(30):
        logits = rng.normal(size=(1, vocab)) * rng.choice([0.1, 1.0, 4.0])
        kw = {"temperature": 1.0} if trial % 2 else {"temperature": 0.8, "top_p": 0.9}
        p = probabilities(logits, SamplingParams(**kw))[0]
        ids = np.flatnonzero(p > 0)
        for seed in range(3):
            race = p[ids] / -np.log(uniforms(seed, trial, ids))
            assert seeded_pick(p, seed, trial) == ids[race.argmax()]


def test_seeded_pick_scales_and_dtype_do_not_matter_and_bad_rows_fail():
    for s in range(50):
        t = seeded_pick(P, s, 3)
        assert t == seeded_pick(P * 7.5, s, 3) == seeded_pick(P.astype(np.float32), s, 3)
    onehot = np.zeros(11)
    onehot[4] = 1.0
    assert {seeded_pick(onehot, s, 0) for s in range(30)} == {4}
    with pytest.raises(InvalidArgument, match="positive, finite mass"):
        seeded_pick(np.zeros(5), 0, 0)
    for bad in ([0.5, np.inf], [0.5, np.nan], [np.nan] * 3):
        with pytest.raises(InvalidArgument, match="positive, finite mass"):
            seeded_pick(np.array(bad), 0, 0)
    with pytest.raises(InvalidArgument, match="seed must be an integer >= 0, got -1"):
        SeededNoise(-1)


def test_a_draft_under_the_same_noise_agrees_when_its_law_is_the_targets():
    """draw() with SeededNoise is the seeded pick; a draft q == p is always accepted, and a close
    q mostly (the Gumbel coupling: P(agree) >= (1 - TV) / (1 + TV))."""
    noise = SeededNoise(11)
    assert all(draw(P, noise, t) == noise.pick(P, t) for t in range(100))
    q = 0.8 * P + 0.2 * np.roll(P, 1)
    tv = 0.5 * np.abs(P - q).sum()
    agree = np.mean([draw(q, SeededNoise(s), 0) == seeded_pick(P, s, 0) for s in range(4000)])
    assert agree >= (1 - tv) / (1 + tv) - 0.03
    rng = np.random.default_rng(0)
    assert draw(P, rng, 0) in np.flatnonzero(P)  # a numpy Generator: an ordinary sample


def test_stream_for_picks_noise_only_for_seeded_sampling():
    assert isinstance(stream_for(3, 0.7), SeededNoise)
    for args in ((None, 0.7), (3, 0.0), (3, 0.7, False)):
        assert isinstance(stream_for(*args), np.random.Generator)


def _rows(k: int, seed: int) -> np.ndarray:
    r = np.random.default_rng(seed).dirichlet(np.full(12, 0.3), size=k + 1)  # [k+1, 12]
    return r


@pytest.mark.parametrize("case", range(40))
def test_verify_seeded_equals_step_by_step_picks(case):
    """Draft tokens from a mix of the picks themselves and random ones: verification accepts
    exactly the prefix equal to the step-by-step picks and returns the next pick."""
    rng = np.random.default_rng(case)
    k, start, noise = int(rng.integers(0, 6)), int(rng.integers(0, 100)), SeededNoise(case)
    p = _rows(k, case)
    picks = [noise.pick(p[j], start + j) for j in range(k + 1)]
    draft = [picks[j] if rng.random() < 0.7 else int(rng.integers(0, 12)) for j in range(k)]
    n, token = verify_seeded(p, draft, noise, start)
    expect = next((j for j in range(k) if draft[j] != picks[j]), k)
    assert (n, token) == (expect, picks[expect])
    with pytest.raises(InvalidArgument, match="gamma\\+1"):
        verify_seeded(p[:k], draft, noise, start)


def test_tree_picks_verify_a_tree_like_its_chains():
    """A tree's rows pick at start + depth; verify_tree_greedy on the picks accepts the path
    that a chain of the same tokens would, and ends with the same pick."""
    noise, start = SeededNoise(4), 30
    #   root -> a (row 1) -> c (row 3); root -> b (row 2)
    p = _rows(3, 1)
    a = noise.pick(p[0], start)
    c = noise.pick(p[1], start + 1)
    tokens = np.array([0, a, (a + 1) % 12, c])
    tree = DraftTree(tokens, [-1, 0, 0, 1])
    picks = tree_picks(p, tree.depths(), noise, start)
    assert list(picks[:2]) == [a, c] and picks[3] == noise.pick(p[3], start + 2)
    rows, token = verify_tree_greedy(tree, picks)
    assert list(rows) == [1, 3]
    chain = np.stack([p[0], p[1], p[3]])
    assert verify_seeded(chain, [a, c], noise, start) == (2, int(token))
