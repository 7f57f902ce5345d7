"""Helpers of the exactness tests (no tests here): the prompts they share, their `gens` fixture and
the statistics of the sampling-law checks: the exact law of the first two tokens from a model's
logits, chi-square goodness of fit over binned cells and a rigorous two-sample total-variation
bound. Used by test_exactness.py, test_rollback.py and test_sampling_law.py (which import the
fixture as `fixture_gens`), and by test_structured.py and test_suffix.py (the statistics).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from specexport_runtime.engine import OrtModel
from specexport_runtime.sampling import SamplingParams, probabilities

ADAPTIVE_GAMMA_MAX = 8  # the tiny recipes' max_gamma (checked against the manifest in `gens`)
PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog.",
    "for i in range(10):\n    print(i * i)\nfor i in range(10):\n    print(i * i)\n",  # repetitive text
    [40, 41, 42, 43, 44] * 4,  # raw, repetitive token ids (the n-gram proposer matches at once)
    [7, 150, 33, 299, 12, 260, 5],  # raw token ids, incl. merged tokens and the last vocabulary id
]
PROMPT_IDS = ["code", "prose", "repeat-text", "repeat-ids", "raw-ids"]


@pytest.fixture(scope="module", name="gens")
def fixture_gens(gens):
    """conftest's generators, checked for the gamma bound these tests rely on."""

    def get(kind: str):
        gen = gens(kind)
        m = gen.manifest
        # adaptive gamma never exceeds max(generation.max_gamma, speculation.gamma)
        assert max(int(m.generation.get("max_gamma", 8)), m.speculation.gamma) == ADAPTIVE_GAMMA_MAX
        return gen

    return get


# ------------------------------------------------------------------ sampling-law statistics


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for X ~ chi-square(df): the regularized upper incomplete gamma Q(df/2, x/2)
    (series for x < a + 1, Lentz continued fraction otherwise; no scipy in this venv)."""
    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    log_front = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:
        term = total = 1.0 / a
        ap = a
        for _ in range(10000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = d if abs(d) > tiny else tiny
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_front) * h


ALPHA = 1e-4  # per chi-square assertion; the suite makes fewer than 100: < 1e-2 false failures in all
DELTA = 1e-6  # per two-sample TV bound (rigorous, no asymptotics)


def exact_pair_distribution(model: OrtModel, ids: list[int], params: SamplingParams, eos: int) -> np.ndarray:
    """P(t1, t2) = p(t1 | ids) p(t2 | ids, t1) over [V, V] from a model's logits. Generation
    ends at EOS, so a first token EOS is the cell (eos, eos) (see `sample_pairs`)."""
    model.reset()
    p1 = probabilities(model.forward(ids)[:1], params)[0]  # [V]
    V = p1.shape[0]
    joint = np.zeros((V, V))
    for t1 in np.flatnonzero(p1 > 0):
        if t1 == eos:
            joint[t1, t1] = p1[t1]
            continue
        model.truncate(len(ids))
        joint[t1] = p1[t1] * probabilities(model.forward([int(t1)])[:1], params)[0]
    model.reset()
    return joint


def make_bins(p: np.ndarray, n: int, min_expected: float = 5.0) -> np.ndarray:
    """Bin index per cell of p: one bin per cell with expected count >= min_expected, the rest
    pooled in one last bin (merged into the smallest kept bin if it is too small itself)."""
    flat = p.reshape(-1)
    big = flat * n >= min_expected
    bins = np.full(flat.shape, -1, dtype=np.int64)
    bins[big] = np.arange(int(big.sum()))
    rest = int(big.sum())
    bins[~big] = rest
    if flat[~big].sum() * n < min_expected:
        bins[~big] = int(np.argmin(np.where(big, flat, np.inf)[big.nonzero()[0]]))
    return bins.reshape(p.shape)


def make_pair_bins(joint: np.ndarray, n: int, min_expected: float = 5.0) -> np.ndarray:
    """Bins of the pair law that keep the conditional structure: per first token t1 (of
    expected count >= 2 min_expected) one bin per (t1, t2) with expected count >= min_expected
    plus one bin for the rest of the row when that rest reaches min_expected (else it joins the
    row's smallest kept cell); every other cell goes to one global bin."""
    V = joint.shape[0]
    bins = np.full(joint.shape, -1, dtype=np.int64)
    nxt = 0
    for t1 in range(V):
        row = joint[t1]
        if row.sum() * n < 2 * min_expected:
            continue
        big = row * n >= min_expected
        if not big.any():
            bins[t1] = nxt
            nxt += 1
            continue
        kept = np.flatnonzero(big)
        bins[t1, kept] = nxt + np.arange(kept.size)
        if row[~big].sum() * n >= min_expected:
            bins[t1, ~big] = nxt + kept.size
            nxt += kept.size + 1
        else:
            bins[t1, ~big] = nxt + int(np.argmin(row[kept]))
            nxt += kept.size
    rest = bins < 0
    if joint[rest].sum() * n >= min_expected:
        bins[rest] = nxt
    else:  # fold into the smallest bin
        sizes = np.bincount(bins[~rest], weights=joint[~rest], minlength=nxt)
        bins[rest] = int(np.argmin(sizes))
    return bins


def binned(p: np.ndarray, bins: np.ndarray) -> np.ndarray:
    return np.bincount(bins.reshape(-1), weights=p.reshape(-1), minlength=int(bins.max()) + 1)


def counts_of(samples: list[tuple[int, int]], bins: np.ndarray, marginal: bool = False) -> np.ndarray:
    out = np.zeros(int(bins.max()) + 1)
    for t1, t2 in samples:
        out[bins[t1] if marginal else bins[t1, t2]] += 1
    return out


def chi2_stat(counts: np.ndarray, expected_p: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    e = n * expected_p
    return float(((counts - e) ** 2 / e).sum()), len(expected_p) - 1


def tv_bound(p_bins: np.ndarray, n: int, delta: float) -> float:
    """With prob >= 1 - delta, TV(empirical_1, empirical_2) <= this for two independent samples of
    size n from p: E[TV(P^, P)] <= 1/2 sum sqrt(p(1-p)/n) (Jensen) and, TV changing by <= 1/n per
    sample, McDiarmid gives P(TV > E + t) <= exp(-2 n t^2); union bound over the two samples."""
    mean = 0.5 * np.sqrt(p_bins * (1 - p_bins) / n).sum()
    t = math.sqrt(math.log(2 / delta) / (2 * n))
    return 2 * (mean + t)


def first_pair(result, eos: int) -> tuple[int, int]:
    """The first two generated tokens of a max_new_tokens=2 result; EOS (dropped from token_ids)
    is put back."""
    tokens = list(result.token_ids)
    if result.finish_reason == "eos":
        tokens += [eos] * (2 - len(tokens))
    else:
        assert result.finish_reason == "length"
    assert len(tokens) == 2
    return tokens[0], tokens[1]


def sample_pairs(gen, ids, seeds, speculative: bool, **kw) -> list[tuple[int, int]]:
    """First two generated tokens per seed (first_pair)."""
    (eos,) = gen.eos
    return [
        first_pair(gen.generate(ids, max_new_tokens=2, seed=seed, speculative=speculative, **kw), eos) for seed in seeds
    ]


def check_pairs_follow_target(target, ids, spec, base, eos: int, label: str = "") -> None:
    """spec: N speculative first pairs; base: N target-only ones (temperature 1). Chi-square of spec
    against the exact law from `target`'s logits (first token and pair, ALPHA) and the two-sample
    TV bound against base (DELTA)."""
    N = len(spec)
    joint = exact_pair_distribution(target, ids, SamplingParams(temperature=1.0), eos)
    first = joint.sum(axis=1)
    pair_bins = make_pair_bins(joint, N)
    for name, bins, p, marg in (("first token", make_bins(first, N), first, True), ("pair", pair_bins, joint, False)):
        stat, df = chi2_stat(counts_of(spec, bins, marg), binned(p, bins))
        assert chi2_sf(stat, df) > ALPHA, f"{label} {name}: chi2 {stat:.1f} on {df} df"
    tv = 0.5 * np.abs(counts_of(spec, pair_bins) - counts_of(base, pair_bins)).sum() / N
    assert tv <= tv_bound(binned(joint, pair_bins), N, DELTA), tv


def check_first_two_tokens_follow_target(gen, ids, proposer: str, N: int = 2000) -> None:
    """Temperature 1, gamma 3, `proposer`: the first two tokens of N speculative samples against
    the exact target law (chi-square, ALPHA) and against N target-only samples (TV bound, DELTA)."""
    spec = sample_pairs(
        gen, ids, range(N), True, temperature=1.0, top_k=0, gamma=3, proposer=proposer, seeded_noise=False
    )
    base = sample_pairs(gen, ids, range(N, 2 * N), False, temperature=1.0, top_k=0)
    check_pairs_follow_target(gen.target, ids, spec, base, min(gen.eos), proposer)
