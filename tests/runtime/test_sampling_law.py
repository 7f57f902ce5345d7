"""The sampling law of speculative decoding on the tiny artifacts: the distribution of the
emitted tokens is the target's, checked against the exact distribution computed from the
target's logits with the runtime's own `probabilities` (chi-square goodness of fit, a two-sample
total-variation bound, power against the classic bugs), for draft models, top-k / top-p filters
and EAGLE-3 heads; seeded sampling is reproducible. The statistics are in exactness_support.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from exactness_support import (
    ALPHA,
    DELTA,
    binned,
    check_first_two_tokens_follow_target,
    chi2_sf,
    chi2_stat,
    counts_of,
    exact_pair_distribution,
    fixture_gens,  # noqa: F401 (this module's `gens` fixture)
    make_bins,
    make_pair_bins,
    sample_pairs,
    tv_bound,
)

from specexport_runtime.adaptive import GammaController
from specexport_runtime.sampling import SamplingParams


def test_chi2_sf_reference_values():
    # textbook critical values: P(chi2_df >= x) = 0.05 / 0.01 / 1e-4
    assert chi2_sf(3.841459, 1) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(18.307038, 10) == pytest.approx(0.05, rel=1e-5)
    assert chi2_sf(6.634897, 1) == pytest.approx(0.01, rel=1e-5)
    # even df have a closed form: exp(-x/2) sum_{k < df/2} (x/2)^k / k!  (both branches of chi2_sf)
    for df in (2, 4, 10, 30):
        for x in (0.5, 3.0, 17.0, 44.0, 90.0):
            closed = math.exp(-x / 2) * sum((x / 2) ** k / math.factorial(k) for k in range(df // 2))
            assert chi2_sf(x, df) == pytest.approx(closed, rel=1e-9, abs=1e-300)


@pytest.mark.parametrize("kind", ["noisy", pytest.param("noisy-fused", marks=pytest.mark.slow)])
def test_sampling_first_two_tokens_follow_target(gens, kind):
    """End to end on 'noisy' and 'noisy-fused' (gamma 3, temperature 1, top_k 0): token 1 comes from the prefill,
    token 2 from the first speculative round (accepted draft or correction, or bonus).

    Checks (N = 2000 samples each; speculative on seeds 0..N-1, target-only on N..2N-1):
      * chi-square goodness of fit of both samples against the exact distribution (first token
        p(t1) and pair p(t1) p(t2|t1) from the target's logits via the runtime's
        `probabilities`), cells with expected count >= 5 kept, the rest pooled; fails when the
        p-value < ALPHA = 1e-4 (asymptotic chi-square; 6 such tests here, so the chance that a
        correct runtime fails is < 1e-3 for a random choice of seeds);
      * two-sample total variation spec vs target-only on the same bins, against the rigorous
        bound `tv_bound` with DELTA = 1e-6;
      * power: the pair distribution the test would see if every draft were accepted
        (p(t1) q(t2|t1)) is far outside the acceptance region (expected statistic > 5x the
        critical value), so the check can fail.
    """
    gen = gens(kind)
    ids = gen.codec.encode("The quick brown fox")
    params = SamplingParams(temperature=1.0)
    N = 2000
    spec = sample_pairs(gen, ids, range(N), True, temperature=1.0, top_k=0, gamma=3, seeded_noise=False)
    base = sample_pairs(gen, ids, range(N, 2 * N), False, temperature=1.0, top_k=0)
    joint = exact_pair_distribution(gen.target, ids, params, min(gen.eos))
    assert joint.sum() == pytest.approx(1.0)
    first = joint.sum(axis=1)
    pair_bins = make_pair_bins(joint, N)
    first_bins = make_bins(first, N)
    assert pair_bins.max() >= 10 and first_bins.max() >= 10  # enough cells for a meaningful test
    for name, samples in (("speculative", spec), ("target-only", base)):
        for label, bins, p, marg in (("first token", first_bins, first, True), ("pair", pair_bins, joint, False)):
            stat, df = chi2_stat(counts_of(samples, bins, marg), binned(p, bins))
            assert chi2_sf(stat, df) > ALPHA, f"{name} {label}: chi2 {stat:.1f} on {df} df"
    # two-sample TV on the pair bins
    pb = binned(joint, pair_bins)
    tv = 0.5 * np.abs(counts_of(spec, pair_bins) - counts_of(base, pair_bins)).sum() / N
    assert tv <= tv_bound(pb, N, DELTA), tv
    # the second token alone (marginal over t1), speculative only: the token of the round
    second = joint.sum(axis=0)
    sb = make_bins(second, N)
    c = np.zeros(int(sb.max()) + 1)
    for _, t2 in spec:
        c[sb[t2]] += 1
    stat, df = chi2_stat(c, binned(second, sb))
    assert chi2_sf(stat, df) > ALPHA, f"second token: chi2 {stat:.1f} on {df} df"
    # Scheffe-set checks: a rigorous test aimed at the two classic bugs. With q the draft's
    # conditional law of t2, the pair law would be
    #   "every draft accepted"       p(t1) q(t2|t1)
    #   "correction drawn from p"    p(t1) [min(p, q) + (1 - sum min(p, q)) p](t2|t1)
    # For each alternative a, A = {cells where the exact law exceeds a}; the sample frequency of
    # A is within Hoeffding's sqrt(ln(2/DELTA) / 2N) of its exact probability with prob
    # >= 1 - DELTA, and the alternative's probability of A is more than twice that away.
    q_joint = exact_pair_distribution(gen.draft, ids, params, min(gen.eos))
    p_cond = np.divide(joint, first[:, None], out=np.zeros_like(joint), where=first[:, None] > 0)
    q_cond = np.divide(q_joint, q_joint.sum(axis=1, keepdims=True))
    eos = min(gen.eos)
    q_cond[eos] = p_cond[eos]  # generation ends at a first-token EOS: nothing is drafted
    overlap = np.minimum(p_cond, q_cond)
    alternatives = {
        "accept every draft": first[:, None] * q_cond,
        "correction from p": first[:, None] * (overlap + (1 - overlap.sum(axis=1, keepdims=True)) * p_cond),
    }
    half = math.sqrt(math.log(2 / DELTA) / (2 * N))
    for name, alt in alternatives.items():
        assert alt.sum() == pytest.approx(1.0)
        region = joint > alt
        exact_mass = joint[region].sum()
        assert exact_mass - alt[region].sum() > 2 * half, f"no power against {name!r}"
        for label, samples in (("speculative", spec), ("target-only", base)):
            freq = np.mean([region[t1, t2] for t1, t2 in samples])
            assert abs(freq - exact_mass) <= half, (name, label, freq, exact_mass)


def test_seeded_sampling_reproducible_with_fixed_gamma(gens):
    gen = gens("noisy")
    kw = dict(max_new_tokens=40, temperature=1.0, seed=11, gamma=3)
    outs = {tuple(gen.generate("def add(a, b):", **kw).token_ids) for _ in range(3)}
    assert len(outs) == 1
    assert tuple(gen.generate("def add(a, b):", **{**kw, "seed": 12}).token_ids) not in outs


def test_seeded_sampling_reproducible_with_adaptive_gamma(gens):
    """Same seed, same arguments, default (adaptive) gamma: the output should not depend on how
    fast the previous calls ran. Timing is simulated deterministically by the cost estimates the
    generator carries between calls: drafting looks free, then prohibitively slow."""
    gen = gens("noisy")
    kw = dict(max_new_tokens=40, temperature=1.0, seed=11)
    outs = []
    for cost_draft in (1e-6, 1.0):
        gen.policy.controllers[("draft", None, gen.config.controller_key)] = GammaController(
            cost_draft=cost_draft, cost_decode=1e-3, verify_costs={2: 1.1e-3, 5: 1.2e-3, 9: 1.4e-3}
        )
        outs.append(gen.generate("def add(a, b):", **kw).token_ids)
    gen.policy.controllers.clear()
    assert outs[0] == outs[1]


def test_sampling_with_top_k_top_p_follows_target(gens):
    """temperature 0.8, top_k 20, top_p 0.9 on 'noisy' with gamma 3: no sampled pair lies outside
    the support of the filtered target distribution, and the pairs fit it (chi-square as above)."""
    gen = gens("noisy")
    ids = gen.codec.encode("def add(a, b):")
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9)
    N = 1200
    spec = sample_pairs(gen, ids, range(N), True, temperature=0.8, top_k=20, top_p=0.9, gamma=3, seeded_noise=False)
    joint = exact_pair_distribution(gen.target, ids, params, min(gen.eos))
    support = joint > 0
    assert support.sum(axis=1).max() <= 20  # the filters did cut
    assert all(support[t1, t2] for t1, t2 in spec), "sampled a token outside the top-k/top-p set"
    bins = make_pair_bins(joint, N)
    stat, df = chi2_stat(counts_of(spec, bins), binned(joint, bins))
    assert df >= 5
    assert chi2_sf(stat, df) > ALPHA, f"chi2 {stat:.1f} on {df} df"


@pytest.mark.parametrize("kind", ["eagle3", pytest.param("eagle3-portable", marks=pytest.mark.slow)])
def test_sampling_with_an_eagle_head_follows_the_target(gens, kind):
    """The `eagle` proposer (a random EAGLE-3 head, draft vocabulary half the target's, so
    q = 0 outside it; fused and portable graph forms) at temperature 1, gamma 3: the first two
    tokens against the exact target law (chi-square, ALPHA as above) and against target-only
    samples (TV bound)."""
    gen = gens(kind)
    ids = gen.codec.encode("The quick brown fox")
    check_first_two_tokens_follow_target(gen, ids, "eagle")
    run = gen.events(ids, proposer="eagle", gamma=3, max_new_tokens=4)
    assert run.collect().stats is run.stats and run.stats.prompt_tokens == len(ids)
