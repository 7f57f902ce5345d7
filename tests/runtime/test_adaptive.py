"""Adaptive gamma controller: the speedup model, the on/off policy, probes and feedback."""

from __future__ import annotations

import math

import pytest

from specexport_runtime.adaptive import GammaController
from specexport_runtime.costs import VerifyCost
from specexport_runtime.errors import InvalidArgument


def closed_form_speedup(alpha, gamma, c_draft, c_verify, c_decode):
    tokens = gamma + 1 if alpha == 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)
    return tokens * c_decode / (gamma * c_draft + c_verify)


def calibrated(**kw) -> GammaController:
    """A controller whose costs are already known (no warm-up rounds)."""
    base = dict(cost_draft=0.002, cost_decode=0.02, verify_costs={5: 0.024})
    base.update(kw)
    return GammaController(**base)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.7, 0.95, 1.0])
@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_expected_speedup_matches_formula(alpha, gamma):
    ctl = calibrated(alpha=alpha)
    # the verify line goes through (1, 0.02) and (5, 0.024): 0.019 + 0.001 s
    c_verify = 0.019 + 0.001 * (gamma + 1)
    want = closed_form_speedup(alpha, gamma, 0.002, c_verify, 0.02)
    assert ctl.expected_speedup(gamma) == pytest.approx(want, rel=1e-12)
    assert ctl.expected_speedup(0) == 1.0


def test_expected_tokens_near_one():
    ctl = GammaController(alpha=1.0 - 1e-13)
    assert ctl.expected_tokens(8) == pytest.approx(9.0, rel=1e-11)
    ctl.alpha = 1.0
    assert ctl.expected_tokens(8) == 9.0
    ctl.alpha = 0.0
    assert ctl.expected_tokens(8) == 1.0


def test_cost_verify_linear_fit():
    ctl = GammaController(cost_decode=0.01, verify_costs={3: 0.03, 5: 0.05})
    assert ctl.cost_verify(9) == pytest.approx(0.09)
    assert ctl.cost_verify(1) == pytest.approx(0.01)
    flat = GammaController(verify_costs={4: 0.02})
    assert flat.cost_verify(9) == 0.02  # one timed size: flat
    noisy = GammaController(cost_decode=0.03, verify_costs={5: 0.02})  # negative slope
    assert noisy.cost_verify(9) == pytest.approx(0.025)  # clamped slope 0: the mean
    assert noisy.cost_verify(2) == pytest.approx(0.025)
    assert math.isnan(GammaController().cost_verify(3))
    assert math.isnan(GammaController().expected_speedup(3))


def test_high_acceptance_and_cheap_draft_picks_gamma_max():
    ctl = calibrated(alpha=0.98, cost_draft=1e-5, verify_costs={5: 0.021})
    assert ctl.choose() == ctl.gamma_max == 8
    assert ctl.gamma == 8
    assert ctl.best()[0] == 8


def test_moderate_acceptance_and_costly_draft_picks_a_middle_gamma():
    ctl = calibrated(alpha=0.7, cost_draft=0.004, gamma_tolerance=0.0)
    g = ctl.choose()
    assert 1 < g < 8
    speedups = [ctl.expected_speedup(k) for k in range(1, 9)]
    assert g == 1 + max(range(8), key=speedups.__getitem__)


def test_low_acceptance_turns_off_then_probes_with_backoff():
    # probe_budget 1: the back-off alone spaces the probes (their budget is tested below)
    ctl = calibrated(
        alpha=0.01, cost_draft=0.005, verify_costs={5: 0.022}, probe_every=4, probe_max=8, probe_budget=1.0
    )
    assert ctl.best()[1] < 1.0
    assert [ctl.choose() for _ in range(4)] == [0, 0, 0, 0]
    assert not ctl.speculating
    assert ctl.choose() == ctl.probe_gamma == 2  # a short probe round
    ctl.cost.record(2 + 1, 0.021)
    ctl.record_round(2, 0, 0.01)  # failed probe: interval doubles
    assert [ctl.choose() for _ in range(8)] == [0] * 8
    assert ctl.choose() == 2
    ctl.cost.record(2 + 1, 0.021)
    ctl.record_round(2, 0, 0.01)
    assert [ctl.choose() for _ in range(8)] == [0] * 8  # capped at probe_max
    assert ctl.choose() == 2
    assert calibrated(alpha=0.01, probe_every=1, probe_gamma=20).choose() in (0, 8)  # clamped to gamma_max


def test_successful_probe_turns_speculation_back_on():
    ctl = calibrated(alpha=0.01, cost_draft=0.005, verify_costs={5: 0.022}, probe_every=2, probe_budget=1.0)
    assert [ctl.choose() for _ in range(2)] == [0, 0]
    assert ctl.choose() == 2
    ctl.cost.record(2 + 1, 0.021)
    ctl.record_round(2, 2, 0.01)  # all accepted: probe tokens weigh probe_smoothing
    assert ctl.alpha == pytest.approx(1 - 0.75**2 * 0.99)
    g = ctl.choose()
    assert g > 0 and ctl.speculating
    # back on: the probe interval is reset to probe_every for the next time it turns off
    ctl.alpha = 0.0
    assert [ctl.choose() for _ in range(2)] == [0, 0]
    assert ctl.choose() == 2


def _speedups(alpha, c_draft=0.004):
    """Closed-form expected speedups for gamma 1..8 with calibrated()'s costs."""
    return {g: closed_form_speedup(alpha, g, c_draft, 0.019 + 0.001 * (g + 1), 0.02) for g in range(1, 9)}


@pytest.mark.parametrize("alpha", [0.9, 0.75, 0.6])
def test_longest_gamma_within_tolerance_of_the_best(alpha):
    """Near its top the expected speedup is flat: the controller takes the longest gamma whose
    expected speedup is within gamma_tolerance of the best (fewer rounds, fewer per-round costs
    the model leaves out); with tolerance 0 it takes the best."""
    speedups = _speedups(alpha)
    best = max(speedups.values())
    want = max(g for g, v in speedups.items() if v >= 0.95 * best)
    ctl = calibrated(alpha=alpha, cost_draft=0.004, gamma=1, gamma_tolerance=0.05)
    assert ctl.choose() == want == ctl.gamma
    strict = calibrated(alpha=alpha, cost_draft=0.004, gamma=1, gamma_tolerance=0.0)
    assert strict.choose() == max(speedups, key=speedups.get)


def test_tolerance_prefers_long_drafts_only_near_the_top():
    flat = _speedups(0.9)
    assert max(flat, key=flat.get) < 8 and flat[8] >= 0.97 * max(flat.values())  # the case it is for
    assert calibrated(alpha=0.9, cost_draft=0.004, gamma_tolerance=0.03).choose() == 8
    steep = _speedups(0.5)
    assert steep[8] < 0.9 * max(steep.values())
    assert calibrated(alpha=0.5, cost_draft=0.004, gamma_tolerance=0.03).choose() < 8


def test_hysteresis_prevents_flapping():
    # gamma fixed at 1, flat costs: expected_speedup(1) = (1 + alpha) / 1.5
    ctl = GammaController(
        gamma_min=1, gamma_max=1, gamma=1, hysteresis=0.05, cost_draft=0.5, cost_decode=1.0, verify_costs={2: 1.0}
    )
    seen = []
    for alpha in (0.53, 0.47, 0.53, 0.55, 0.53, 0.65, 0.53, 0.49):
        ctl.alpha = alpha
        seen.append(ctl.choose())
    # speedups: 1.02 on, 0.98 off, 1.02 and 1.033 stay off (< 1.05), 1.02 off, 1.10 on,
    # 1.02 stays on, 0.993 off
    assert seen == [1, 0, 0, 0, 0, 1, 1, 0]


def test_without_hysteresis_it_would_flap():
    ctl = GammaController(
        gamma_min=1, gamma_max=1, gamma=1, hysteresis=0.0, cost_draft=0.5, cost_decode=1.0, verify_costs={2: 1.0}
    )
    seen = []
    for alpha in (0.53, 0.47, 0.53, 0.47):
        ctl.alpha = alpha
        seen.append(ctl.choose())
    assert seen == [1, 0, 1, 0]


def test_warm_up_times_decode_then_one_round():
    ctl = GammaController(gamma=3, gamma_tolerance=0.0)
    assert ctl.choose() == 0
    ctl.cost.record(1, 0.02)  # the loop times the plain step into the shared cost
    assert ctl.cost.by_rows == {1: 0.02}
    assert ctl.choose() == 3
    ctl.cost.record(4, 0.023)
    ctl.record_round(3, 2, draft_seconds=0.006)
    assert ctl.cost_draft == pytest.approx(0.002)
    assert ctl.cost.by_rows == {1: 0.02, 4: 0.023}
    assert ctl.choose() == ctl.best()[0]


def test_record_round_updates_alpha_and_costs():
    ctl = GammaController(alpha=0.6, alpha_smoothing=0.1, cost_smoothing=0.5, cost=VerifyCost(0.5))
    ctl.cost.record(4 + 1, 0.03)
    ctl.record_round(4, 4, 0.004)  # 4 successes
    a1 = 1 - 0.9**4 * 0.4
    assert ctl.alpha == pytest.approx(a1)
    ctl.cost.record(4 + 1, 0.05)
    ctl.record_round(4, 1, 0.008)  # 1 success then a rejection
    a2 = (1 - 0.9 * (1 - a1)) * 0.9
    assert ctl.alpha == pytest.approx(a2)
    assert ctl.alpha < a1
    ctl.cost.record(2 + 1, 0.02)
    ctl.record_round(2, 0, 0.002)  # rejected at once
    assert ctl.alpha == pytest.approx(a2 * 0.9)
    # costs: first timing taken as is, then a running mean while 1/count > smoothing, then EMA
    assert ctl.cost_draft == pytest.approx(((0.001 + 0.002) / 2 + 0.001) / 2)
    assert ctl.cost.by_rows[5] == pytest.approx(0.04)
    assert ctl.cost.by_rows[3] == pytest.approx(0.02)
    for seconds in (0.01, 0.02, 0.04):
        ctl.cost.record(1, seconds)
    assert ctl.cost.by_rows[1] == pytest.approx(0.015 + 0.5 * (0.04 - 0.015))


def test_stop_drafting():
    assert not GammaController().stop_drafting(0.01)
    ctl = GammaController(min_draft_prob=0.3)
    assert ctl.stop_drafting(0.29)
    assert not ctl.stop_drafting(0.3)


@pytest.mark.parametrize(
    "kwargs, shown",
    [
        ({"gamma_min": 0}, "gamma_min"),
        ({"gamma_max": 0}, "gamma_max"),
        ({"gamma": 9}, "gamma must"),
        ({"alpha": 1.5}, "1.5"),
        ({"alpha_smoothing": 0.0}, "alpha_smoothing"),
        ({"cost_draft": -1.0}, "cost_draft"),
        ({"verify_costs": {0: 1.0}}, "rows"),
        ({"hysteresis": -0.1}, "hysteresis"),
        ({"probe_every": 0}, "probe_every"),
        ({"probe_max": 2}, "probe_max"),
        ({"min_draft_prob": 1.0}, "min_draft_prob"),
        ({"gamma_tolerance": 1.0}, "gamma_tolerance"),
        ({"gamma_tolerance": -0.01}, "gamma_tolerance"),
    ],
)
def test_validation(kwargs, shown):
    with pytest.raises(InvalidArgument, match=shown):
        GammaController(**kwargs)


def test_record_validation():
    ctl = GammaController()
    with pytest.raises(InvalidArgument, match="gamma"):
        ctl.record_round(0, 0, 0.0)
    with pytest.raises(InvalidArgument, match="n_accepted"):
        ctl.record_round(3, 4, 0.0)
    with pytest.raises(InvalidArgument, match="draft_seconds"):
        ctl.record_round(3, 1, float("nan"))
    with pytest.raises(InvalidArgument, match="seconds"):
        ctl.cost.record(1, -1.0)
    with pytest.raises(InvalidArgument, match="rows"):
        ctl.cost.record(0, 1.0)
    with pytest.raises(InvalidArgument, match="gamma"):
        ctl.expected_speedup(-1)


def test_new_sequence_probes_at_once_only_when_a_probe_is_cheap():
    # n-gram-like: drafting is free, a 3-token verify costs 1.1 decodes -> probe at the next prompt
    cheap = calibrated(alpha=0.0, cost_draft=0.0, cost_decode=0.02, verify_costs={3: 0.022, 5: 0.024})
    assert cheap.choose() == 0 and not cheap.speculating
    cheap.start_sequence()
    assert cheap.choose() == cheap.probe_gamma
    # draft-model-like: a probe costs 2 draft steps of 0.5 decode + a verify -> keep the back-off
    costly = calibrated(alpha=0.0, cost_draft=0.01, cost_decode=0.02, verify_costs={3: 0.022, 5: 0.024})
    assert costly.choose() == 0
    costly.start_sequence()
    assert costly.choose() == 0
    # while speculating, a new sequence changes nothing
    on = calibrated(alpha=0.98)
    g = on.choose()
    on.start_sequence()
    assert on.choose() == g > 0


def test_cheap_probes_do_not_back_off():
    ctl = calibrated(
        alpha=0.0, cost_draft=0.0, cost_decode=0.02, verify_costs={3: 0.022, 5: 0.024}, probe_every=4, probe_budget=0.05
    )
    for _ in range(3):  # every probe fails, the interval stays at probe_every
        assert [ctl.choose() for _ in range(5)] == [0, 0, 0, 0, 2]
        ctl.cost.record(2 + 1, 0.022)
        ctl.record_round(2, 0, 0.0)


@pytest.mark.parametrize("verify3, budget, gap", [(0.026, 0.01, 30), (0.026, 0.02, 15), (0.021, 0.01, 16)])
def test_rejected_probes_lose_at_most_the_budget(verify3, budget, gap):
    # a cheap-drafting proposer on a target whose 3-row call costs verify3 / 0.02 decode steps
    # (a hybrid's step recurrence: 1.3): probes come at least (c - 1) / budget plain steps apart
    # (30 at 1.3 and 1 %), never closer than probe_every (16), also across new sequences
    ctl = calibrated(
        alpha=0.0, cost_draft=0.0, cost_decode=0.02, verify_costs={3: verify3, 9: 0.04}, probe_budget=budget
    )
    steps, probes = 0, []
    for n in range(400):
        if n % 64 == 0:
            ctl.start_sequence()  # a new request: cheap probes would come at once
        g = ctl.choose()
        if g:
            probes.append(steps)
            ctl.cost.record(g + 1, verify3 if g == 2 else 0.04)
            ctl.record_round(g, 0, 0.0)
        else:
            steps += 1
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(probes) >= 3 and min(gaps) >= gap
    c = verify3 / 0.02
    assert (c - 1) * len(probes) <= budget * steps + (c - 1)  # the first probe is free of the budget


def test_noise_low_verify_timings_never_make_rejected_drafts_pay():
    # the fitted line's 2-row value under the 1-row EMA (a noisy 1-row timing and a lucky 3-row
    # one, as a contended host gives): at acceptance 0 no gamma may look like a gain
    ctl = calibrated(alpha=0.0, cost_draft=0.0, cost_decode=0.030, verify_costs={3: 0.012, 9: 0.040})
    assert ctl.cost.seconds(2) < ctl.cost.by_rows[1]
    assert all(ctl.expected_speedup(g) <= 1.0 for g in range(1, 9))
    assert [ctl.choose() for _ in range(8)] == [0] * 8 and not ctl.speculating
    assert ctl.probe_steps() >= 1.0
