"""Sampling and verification: validation, filters against a slow reference, exactness."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specexport_runtime.errors import InvalidArgument
from specexport_runtime.sampling import (
    SamplingParams,
    accept_probability,
    one_hot,
    pad_vocab,
    probabilities,
    residual,
    sample,
    verify_greedy,
    verify_sampled,
)

# ------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs, name, shown",
    [
        ({"temperature": -0.5}, "temperature", "-0.5"),
        ({"temperature": float("nan")}, "temperature", "nan"),
        ({"temperature": float("inf")}, "temperature", "inf"),
        ({"temperature": "1"}, "temperature", "'1'"),
        ({"top_k": -1}, "top_k", "-1"),
        ({"top_k": 2.5}, "top_k", "2.5"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_p": float("nan")}, "top_p", "nan"),
        ({"seed": -3}, "seed", "-3"),
        ({"seed": 1.0}, "seed", "1.0"),
    ],
)
def test_params_reject_bad_values(kwargs, name, shown):
    with pytest.raises(InvalidArgument) as e:
        SamplingParams(**kwargs)
    msg = str(e.value)
    assert name in msg and shown in msg


def test_params_defaults_and_greedy():
    assert SamplingParams().greedy
    p = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, seed=3)
    assert not p.greedy
    assert p.rng().random() == np.random.default_rng(3).random()


# ---------------------------------------------------------------------- probabilities


def reference_probabilities(logits, temperature, top_k, top_p):
    """Slow per-row reference: plain Python over sorted lists, ties at a cut are kept."""
    out = []
    for row in np.asarray(logits, dtype=np.float64).tolist():
        x = [v / temperature for v in row]
        if 0 < top_k < len(x):
            kth = sorted(x, reverse=True)[top_k - 1]
            x = [v if v >= kth else -math.inf for v in x]
        m = max(x)
        e = [math.exp(v - m) if v != -math.inf else 0.0 for v in x]
        z = sum(e)
        pr = [v / z for v in e]
        if top_p < 1.0:
            acc, threshold = 0.0, None
            for v in sorted(pr, reverse=True):
                acc += v
                threshold = v
                if acc >= top_p:
                    break
            pr = [v if v >= threshold else 0.0 for v in pr]
            z = sum(pr)
            pr = [v / z for v in pr]
        out.append(pr)
    return np.array(out)


@pytest.mark.parametrize("top_k", [0, 1, 5, 37, 200])
@pytest.mark.parametrize("top_p", [1.0, 0.9, 0.5, 0.05])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.5])
def test_probabilities_match_reference(temperature, top_k, top_p):
    rng = np.random.default_rng(1000 * top_k + int(100 * top_p) + int(10 * temperature))
    logits = (rng.standard_normal((3, 200)) * 3).astype(np.float32)
    got = probabilities(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    want = reference_probabilities(logits, temperature, top_k, top_p)
    assert got.dtype == np.float64 and got.shape == (3, 200)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=1e-12)
    assert (got > 0).sum(axis=1).min() >= 1


def test_probabilities_keep_ties_at_the_cuts():
    logits = np.array([[3, 1, 2, 2, 2, 0]], dtype=np.float32)
    got = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_array_equal(got[0] > 0, [True, False, True, True, True, False])
    np.testing.assert_allclose(got, reference_probabilities(logits, 1.0, 2, 1.0), atol=1e-15)
    # top-p: the threshold lands inside the tie group, the whole group stays
    got = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.6))
    np.testing.assert_allclose(got, reference_probabilities(logits, 1.0, 0, 0.6), atol=1e-15)
    np.testing.assert_array_equal(got[0] > 0, [True, False, True, True, True, False])


def test_probabilities_wide_nucleus_falls_back_to_full_sort():
    # nearly flat rows: the nucleus is wider than the 1024 pre-selected candidates, the
    # candidates widen to 8192 (V = 20000) or to the whole row (V = 5000)
    rng = np.random.default_rng(7)
    for v, top_p in ((5000, 0.95), (20000, 0.3)):
        logits = (rng.standard_normal((2, v)) * 0.01).astype(np.float32)
        got = probabilities(logits, SamplingParams(temperature=1.0, top_p=top_p))
        np.testing.assert_allclose(got, reference_probabilities(logits, 1.0, 0, top_p), atol=1e-14)
        assert (got[0] > 0).sum() > 1024


def test_probabilities_ties_at_top_k_cut_with_top_p():
    logits = np.array([[3, 1, 2, 2, 2, 0], [0, 5, 5, 1, 4, 4]], dtype=np.float32)
    for top_p in (0.3, 0.7, 0.95):
        params = SamplingParams(temperature=0.7, top_k=2, top_p=top_p)
        got = probabilities(logits, params)
        np.testing.assert_allclose(got, reference_probabilities(logits, 0.7, 2, top_p), atol=1e-15)


def test_probabilities_top_p_with_top_k_and_neg_inf_logits():
    logits = np.array([[0.0, -np.inf, 1.0, 2.0, -np.inf]], dtype=np.float32)
    got = probabilities(logits, SamplingParams(temperature=1.0, top_k=4, top_p=0.99))
    np.testing.assert_allclose(got, reference_probabilities(logits, 1.0, 4, 0.99), atol=1e-15)
    assert got[0, 1] == 0 and got[0, 4] == 0


def test_probabilities_errors():
    with pytest.raises(InvalidArgument, match="greedy"):
        probabilities(np.zeros((1, 4), np.float32), SamplingParams())
    with pytest.raises(InvalidArgument, match="shape"):
        probabilities(np.zeros(4, np.float32), SamplingParams(temperature=1.0))
    with pytest.raises(InvalidArgument, match="finite"):
        probabilities(np.full((1, 4), -np.inf, np.float32), SamplingParams(temperature=1.0))
    with pytest.raises(InvalidArgument, match="finite"):
        probabilities(np.array([[0.0, np.nan]], np.float32), SamplingParams(temperature=1.0))


def test_probabilities_does_not_modify_logits():
    logits = np.array([[1.0, 2.0, 3.0]], dtype=np.float32)
    before = logits.copy()
    probabilities(logits, SamplingParams(temperature=0.5, top_k=2, top_p=0.5))
    np.testing.assert_array_equal(logits, before)


# ------------------------------------------------------------------- small helpers


def test_pad_vocab():
    q = np.array([[0.5, 0.5], [1.0, 0.0]])
    out = pad_vocab(q, 4)
    np.testing.assert_array_equal(out, [[0.5, 0.5, 0, 0], [1.0, 0, 0, 0]])
    assert pad_vocab(q, 2) is q
    with pytest.raises(InvalidArgument, match="larger"):
        pad_vocab(q, 1)


def test_one_hot():
    np.testing.assert_array_equal(one_hot([2, 0], 3), [[0, 0, 1], [1, 0, 0]])
    assert one_hot([], 3).shape == (0, 3)
    with pytest.raises(InvalidArgument):
        one_hot([3], 3)


def test_accept_probability():
    assert accept_probability(0.2, 0.4) == 0.5
    assert accept_probability(0.4, 0.2) == 1.0
    assert accept_probability(0.3, 0.0) == 1.0  # guard: limit of min(1, p/q) as q -> 0+
    assert accept_probability(0.0, 0.0) == 0.0  # never accept what the target cannot emit
    assert accept_probability(0.0, 0.5) == 0.0


def test_residual():
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.2, 0.3, 0.5])
    np.testing.assert_allclose(residual(p, q), [1.0, 0.0, 0.0])
    r = residual(np.array([0.4, 0.4, 0.2]), np.array([0.2, 0.2, 0.6]))
    np.testing.assert_allclose(r, [0.5, 0.5, 0.0])
    # guard: p == q has no positive part, p itself comes back
    np.testing.assert_array_equal(residual(p, p.copy()), p)
    # inputs untouched
    np.testing.assert_array_equal(p, [0.5, 0.3, 0.2])


def test_sample_never_picks_zero_mass():
    class Top:  # a generator whose uniform draw is the largest double below 1
        def random(self):
            return np.nextafter(1.0, 0.0)

    class Bottom:
        def random(self):
            return 0.0

    probs = np.array([0.0, 0.3, 0.7, 0.0, 0.0])
    assert sample(probs, Top()) == 2
    assert sample(probs, Bottom()) == 1
    with pytest.raises(InvalidArgument):
        sample(np.zeros(3), np.random.default_rng(0))


def test_sample_distribution():
    rng = np.random.default_rng(11)
    probs = np.array([0.1, 0.0, 0.6, 0.3])
    n = 20000
    counts = np.bincount([sample(probs, rng) for _ in range(n)], minlength=4)
    sigma = np.sqrt(n * probs * (1 - probs))
    assert np.all(np.abs(counts - n * probs) <= 5 * sigma)
    assert counts[1] == 0


# ------------------------------------------------------------------ verify_greedy


@pytest.mark.parametrize(
    "argmax, draft, want",
    [
        ([5, 6, 7, 8], [5, 6, 7], (3, 8)),  # all accepted: bonus token
        ([5, 6, 7, 8], [1, 6, 7], (0, 5)),  # first rejected
        ([5, 6, 7, 8], [5, 9, 7], (1, 6)),  # middle rejected (later match does not count)
        ([5, 6, 7, 8], [5, 6, 0], (2, 7)),  # last rejected
        ([4], [], (0, 4)),  # nothing drafted
    ],
)
def test_verify_greedy(argmax, draft, want):
    assert verify_greedy(np.array(argmax), np.array(draft, dtype=np.int64)) == want


def test_verify_greedy_shape_error():
    with pytest.raises(InvalidArgument, match="gamma"):
        verify_greedy([1, 2], [1, 2])


# ------------------------------------------------------------- exactness (analytic)


def one_step_output(p, q):
    """Exact distribution of the token emitted at a drafted position, from the package's
    functions: accept d ~ q with min(1, p/q), otherwise sample the residual."""
    a = np.array([accept_probability(px, qx) for px, qx in zip(p, q)])
    accepted = q * a
    return accepted + (1.0 - accepted.sum()) * residual(p, q)


weight = st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=1.0))


def weights(min_size=2, max_size=8):
    """Unnormalised distributions with exact zeros; at least one positive entry."""
    return st.lists(weight, min_size=min_size, max_size=max_size).filter(lambda w: sum(w) > 0)


def normalise(w):
    w = np.array(w, dtype=np.float64)
    return w / w.sum()


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_one_step_is_exact(data):
    p = normalise(data.draw(weights(), label="p"))
    v = p.size
    kind = data.draw(st.sampled_from(["random", "equal", "one_hot"]), label="q kind")
    if kind == "random":
        q = normalise(data.draw(weights(v, v), label="q"))
    elif kind == "equal":
        q = p.copy()
    else:
        q = one_hot([data.draw(st.integers(0, v - 1), label="token")], v)[0]
    out = one_step_output(p, q)
    np.testing.assert_allclose(out, p, rtol=0, atol=1e-9)


@pytest.mark.parametrize(
    "p, q",
    [
        ([0.5, 0.5, 0.0], [0.0, 0.0, 1.0]),  # disjoint supports: always rejected
        ([0.2, 0.0, 0.8], [0.5, 0.5, 0.0]),  # zeros in both
        ([1.0, 0.0], [0.0, 1.0]),
        ([0.3, 0.7], [0.3, 0.7]),
        ([0.0, 1.0, 0.0], [0.0, 1.0, 0.0]),  # one-hot q equal to a one-hot p
    ],
)
def test_one_step_is_exact_edge_cases(p, q):
    p, q = np.array(p), np.array(q)
    np.testing.assert_allclose(one_step_output(p, q), p, rtol=0, atol=1e-12)


def test_a_wrong_residual_would_be_caught():
    """The analytic check can fail: sampling the correction from p instead is not exact."""
    p, q = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.3, 0.5])
    a = np.array([accept_probability(px, qx) for px, qx in zip(p, q)])
    wrong = q * a + (1 - (q * a).sum()) * p
    assert np.abs(wrong - p).max() > 0.05


# ---------------------------------------------------------- exactness (Monte Carlo)


def test_verify_sampled_monte_carlo_gamma_2():
    """Rounds of gamma = 2 over fixed rows p0, p1, p2 (a context-free target), completed to
    3 tokens by plain sampling, must give 3-token sequences distributed as p0 x p1 x p2.
    Each of the 27 cells and each per-position marginal is checked at 5 binomial standard
    deviations (seeded, so deterministic)."""
    p = np.array([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7], [0.25, 0.25, 0.5]])
    q = np.array([[0.2, 0.3, 0.5], [0.0, 0.5, 0.5]])  # q1 cannot propose token 0
    rng = np.random.default_rng(1234)
    n = 30000
    counts = np.zeros((3, 3, 3))
    accepted = np.zeros(3)
    for _ in range(n):
        d = [int(rng.choice(3, p=q[0])), int(rng.choice(3, p=q[1]))]
        k, nxt = verify_sampled(p, q, d, rng)
        seq = d[:k] + [nxt]
        accepted[k] += 1
        while len(seq) < 3:
            seq.append(sample(p[len(seq)], rng))
        counts[tuple(seq)] += 1
    want = np.einsum("i,j,k->ijk", p[0], p[1], p[2])
    sigma = np.sqrt(n * want * (1 - want))
    assert np.all(np.abs(counts - n * want) <= 5 * sigma), np.abs(counts - n * want) / sigma
    # per-position marginals: fewer, fuller cells, more power against small biases
    for axis, row in enumerate(p):
        other = tuple(a for a in range(3) if a != axis)
        got = counts.sum(axis=other)
        sigma = np.sqrt(n * row * (1 - row))
        assert np.all(np.abs(got - n * row) <= 5 * sigma), (axis, np.abs(got - n * row) / sigma)
    # every outcome of a round happened (rejections at 0 and 1, all accepted)
    assert np.all(accepted > 0)


def test_verify_sampled_one_hot_q_and_edges():
    rng = np.random.default_rng(0)
    p = np.array([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    # deterministic target: a one-hot draft that agrees is always accepted, bonus from p[2]
    assert verify_sampled(p, one_hot([1, 2], 3), [1, 2], rng) == (2, 0)
    # disagreeing draft: rejected at position 1, correction is the only token p allows
    assert verify_sampled(p, one_hot([1, 0], 3), [1, 0], rng) == (1, 2)
    # gamma = 0: plain sampling from the single row
    assert verify_sampled(p[:1], np.zeros((0, 3)), [], rng) == (0, 1)


def test_verify_sampled_shape_errors():
    rng = np.random.default_rng(0)
    p = np.full((3, 4), 0.25)
    with pytest.raises(InvalidArgument, match="p must"):
        verify_sampled(p, np.full((3, 4), 0.25), [0, 1, 2], rng)
    with pytest.raises(InvalidArgument, match="q must"):
        verify_sampled(p, np.full((2, 3), 1 / 3), [0, 1], rng)
    with pytest.raises(InvalidArgument, match="draft tokens"):
        verify_sampled(p, np.full((2, 4), 0.25), [0, 4], rng)


@pytest.mark.parametrize("seed", range(40))
def test_deterministic_drafts_verify_by_index_as_with_one_hot_rows(seed):
    """verify_deterministic (by index) returns what verify_sampled returns with one-hot q rows,
    from the same generator state, and leaves the generator in the same state: draft tokens the
    target likes, dislikes and forbids, with and without a grammar's cut_q."""
    from specexport_runtime.sampling import one_hot, verify_deterministic

    rng = np.random.default_rng(seed)
    V, gamma = 50, int(rng.integers(0, 6))
    p = rng.dirichlet(np.full(V, 0.3), size=gamma + 1)  # [gamma+1, V], peaked
    p[:, rng.integers(0, V, 5)] = 0.0  # tokens the target forbids
    p /= p.sum(-1, keepdims=True)
    likely = p.argmax(-1)[:gamma]
    draft = [int(likely[i]) if rng.random() < 0.6 else int(rng.integers(0, V)) for i in range(gamma)]
    cut_q = rng.dirichlet(np.ones(V)) if seed % 3 == 0 else None
    a, b = np.random.default_rng(1000 + seed), np.random.default_rng(1000 + seed)
    assert verify_deterministic(p, draft, a, cut_q) == verify_sampled(p, one_hot(draft, V), draft, b, cut_q)
    assert a.random() == b.random()
