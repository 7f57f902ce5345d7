"""Adaptive gamma: pick how many tokens to draft per round from measured acceptance and costs.

Model (Leviathan et al. 2023, section 3): each drafted token is accepted independently with
probability alpha, so a round drafting gamma tokens emits on average
    E[tokens per round] = sum_{i=0..gamma} alpha^i = (1 - alpha^(gamma+1)) / (1 - alpha)
tokens (gamma + 1 when alpha = 1) and costs gamma·cost_draft + cost_verify(gamma + 1) seconds,
against cost_decode seconds per token of plain decoding:
    expected_speedup(gamma) = E[tokens per round] · cost_decode
                              / (gamma·cost_draft + max(cost_verify(gamma + 1), cost_decode))

Protocol with the generator, once per round:
    g = ctl.choose()
    g == 0: one plain decode step, timed into ctl.cost (rows 1)
    g  > 0: draft up to g tokens (the proposer may return fewer, and a draft model may stop
            early when ctl.stop_drafting(q_max)); when d >= 1 tokens were drafted, verify
            them, time the call into ctl.cost (rows d + 1) and call
            ctl.record_round(d, n_accepted, draft_seconds); when none were, do a plain step.
The target's costs live in a costs.VerifyCost that the generator shares between its controllers
and the suffix proposer's tuner; the loop times every target call into it (verify seconds and
decode seconds both include the per-step host work: sampling, cache cursor moves; the first,
cold, target call is not timed).

Warm-up: choose() first returns 0 until a plain decode step has been timed, then the initial
gamma until one speculative round has been timed. After that it returns the gamma with the
best expected speedup, or 0 (speculation off) when that is not above 1; more exactly, the longest
gamma whose expected speedup is within gamma_tolerance of the best. Near its top the curve is flat
and its inputs are noisy EMAs, and what the model leaves out (per-round host work, the draft's
catch-up call) favours fewer, longer rounds; the default tolerance, 0.03, is what measured best
(docs/performance.md, "Adaptive gamma and draft length"). Switching back on needs
1 + hysteresis, so a borderline pair does not flap. While off, every `interval` decode steps
one probe round with probe_gamma (short: a probe is usually wasted) re-measures acceptance (its tokens weigh
probe_smoothing in the alpha EMA); the interval starts at probe_every and doubles after each
probe that does not switch speculation back on, up to probe_max, unless a probe is cheap (at
most CHEAP_PROBE decode steps, e.g. n-gram lookup): then it stays at probe_every. Whatever the
interval, a probe comes at least (c - 1) / probe_budget plain steps after the last one, c its
round's cost in decode steps, so a rejected probe loses at most probe_budget of the decode time
while off (a hybrid target's 3-row call costs ~1.3 steps: a probe every 30 or more). The interval
is a pacing.ProbeClock, the policy's one probe mechanism, and the defaults are pacing's constants.
This is the policy's strategy for one sequence (policy.DraftPolicy).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import InitVar, dataclass, field

from .costs import VerifyCost, ema
from .errors import InvalidArgument
from .pacing import (
    CHEAP_PROBE,
    GAMMA_TOLERANCE,
    HYSTERESIS,
    PROBE_BUDGET,
    PROBE_EVERY,
    PROBE_GAMMA,
    PROBE_MAX,
    ProbeClock,
)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class GammaController:
    gamma_min: int = 1
    gamma_max: int = 8
    gamma: int = 4  # initial gamma (warm-up round and probes); afterwards the last one chosen
    alpha: float = 0.6  # per-token acceptance estimate; the initial value is the prior
    alpha_smoothing: float = 0.05  # EMA weight of one drafted-token observation
    probe_smoothing: float = 0.25  # the same, for the tokens of a probe round
    cost_smoothing: float = 0.2  # EMA weight of one timing
    cost_draft: float | None = None  # seconds per draft token
    cost: VerifyCost | None = None  # the target's call costs (shared with the generator); None: its own
    # seeds of a controller's own cost (tests, benchmarks): a plain step's seconds, s -> an s-row call's
    cost_decode: InitVar[float | None] = None
    verify_costs: InitVar[dict[int, float] | None] = None
    hysteresis: float = HYSTERESIS  # off -> on needs best expected speedup >= 1 + hysteresis
    probe_every: int = PROBE_EVERY  # decode steps while off before the first probe
    probe_max: int = PROBE_MAX  # cap of the doubling probe interval
    probe_gamma: int = PROBE_GAMMA  # draft length of a probe round (clamped to [gamma_min, gamma_max])
    probe_budget: float = PROBE_BUDGET  # most share of decode time rejected probes may lose while off
    min_draft_prob: float = 0.0  # stop_drafting threshold on the draft's top probability; 0 = off
    gamma_tolerance: float = GAMMA_TOLERANCE  # take the longest gamma whose expected speedup is within this of the best

    speculating: bool = field(default=True, init=False)
    _initial_gamma: int = field(default=0, init=False, repr=False)
    _probes: ProbeClock | None = field(default=None, init=False, repr=False)  # counts decode steps while off
    _probing: bool = field(default=False, init=False, repr=False)
    _last_probe: int | None = field(default=None, init=False, repr=False)  # _probes.count at the last probe
    _n_draft: int = field(default=0, init=False, repr=False)

    def __post_init__(self, cost_decode: float | None, verify_costs: dict[int, float] | None) -> None:
        if not _is_int(self.gamma_min) or self.gamma_min < 1:
            raise InvalidArgument(f"gamma_min must be an integer >= 1, got {self.gamma_min!r}")
        if not _is_int(self.gamma_max) or self.gamma_max < self.gamma_min:
            raise InvalidArgument(
                f"gamma_max must be an integer >= gamma_min = {self.gamma_min}, got {self.gamma_max!r}"
            )
        if not _is_int(self.gamma) or not self.gamma_min <= self.gamma <= self.gamma_max:
            raise InvalidArgument(
                f"gamma must be an integer in [{self.gamma_min}, {self.gamma_max}], got {self.gamma!r}"
            )
        if not _is_real(self.alpha) or not 0.0 <= self.alpha <= 1.0:
            raise InvalidArgument(f"alpha must be a number in [0, 1], got {self.alpha!r}")
        for name in ("alpha_smoothing", "probe_smoothing", "cost_smoothing"):
            v = getattr(self, name)
            if not _is_real(v) or not 0.0 < v <= 1.0:
                raise InvalidArgument(f"{name} must be a number in (0, 1], got {v!r}")
        if self.cost_draft is not None and (not _is_real(self.cost_draft) or self.cost_draft < 0):
            raise InvalidArgument(f"cost_draft must be None or a finite number >= 0, got {self.cost_draft!r}")
        if self.cost is None:
            self.cost = VerifyCost(self.cost_smoothing)
        for rows, seconds in {**(verify_costs or {}), **({1: cost_decode} if cost_decode is not None else {})}.items():
            self.cost.record(rows, seconds)
        if not _is_real(self.hysteresis) or self.hysteresis < 0:
            raise InvalidArgument(f"hysteresis must be a finite number >= 0, got {self.hysteresis!r}")
        if not _is_int(self.probe_every) or self.probe_every < 1:
            raise InvalidArgument(f"probe_every must be an integer >= 1, got {self.probe_every!r}")
        if not _is_int(self.probe_gamma) or self.probe_gamma < 1:
            raise InvalidArgument(f"probe_gamma must be an integer >= 1, got {self.probe_gamma!r}")
        if not _is_int(self.probe_max) or self.probe_max < self.probe_every:
            raise InvalidArgument(
                f"probe_max must be an integer >= probe_every = {self.probe_every}, got {self.probe_max!r}"
            )
        if not _is_real(self.probe_budget) or not 0.0 < self.probe_budget <= 1.0:
            raise InvalidArgument(f"probe_budget must be a number in (0, 1], got {self.probe_budget!r}")
        if not _is_real(self.gamma_tolerance) or not 0.0 <= self.gamma_tolerance < 1.0:
            raise InvalidArgument(f"gamma_tolerance must be a number in [0, 1), got {self.gamma_tolerance!r}")
        if not _is_real(self.min_draft_prob) or not 0.0 <= self.min_draft_prob < 1.0:
            raise InvalidArgument(f"min_draft_prob must be a number in [0, 1), got {self.min_draft_prob!r}")
        self._initial_gamma = self.gamma
        self._probes = ProbeClock(self.probe_every, self.probe_max)
        self._n_draft = 0 if self.cost_draft is None else 1

    # ----------------------------------------------------------------------------- model

    def expected_tokens(self, gamma: int) -> float:
        """E[tokens per round] = sum_{i=0..gamma} alpha^i (= (1 - alpha^(gamma+1)) / (1 - alpha)).

        Summed term by term: exact at alpha = 1 (gamma + 1) and free of the cancellation
        the closed form suffers near it.
        """
        return float(sum(self.alpha**i for i in range(gamma + 1)))

    def cost_verify(self, s: int) -> float:
        """Seconds of a target call over s tokens (self.cost's line; nan before any timing)."""
        return self.cost.seconds(s)

    def expected_speedup(self, gamma: int) -> float:
        """E[tokens per round] · cost_decode / (gamma·cost_draft + max(cost_verify(gamma+1), cost_decode)).

        1.0 for gamma = 0 (plain decoding); nan until the draft and verify costs are timed.
        The decode cost is cost_verify(1) (the timed plain steps, or the fit without them).
        """
        if not _is_int(gamma) or gamma < 0:
            raise InvalidArgument(f"gamma must be an integer >= 0, got {gamma!r}")
        if gamma == 0:
            return 1.0
        if self.cost_draft is None:
            return math.nan
        decode = self.cost.by_rows.get(1, self.cost_verify(1))
        # a call of more rows never costs less than a plain step: noisy timings can put the
        # line's 2-row value under the 1-row EMA, which would price a rejected draft as a gain
        round_cost = gamma * self.cost_draft + max(self.cost_verify(gamma + 1), decode)
        if not round_cost > 0:
            return math.nan
        return self.expected_tokens(gamma) * decode / round_cost

    def best(self) -> tuple[int, float]:
        """(gamma, expected_speedup(gamma)) maximising the speedup over gamma_min..gamma_max
        (the smallest such gamma on ties)."""
        best_g, best_s = self.gamma_min, -math.inf
        for g in range(self.gamma_min, self.gamma_max + 1):
            s = self.expected_speedup(g)
            if s > best_s:
                best_g, best_s = g, s
        return best_g, best_s

    # ----------------------------------------------------------------------------- policy

    def choose(self) -> int:
        """Gamma for the next round; 0 means a plain decode step (see the module docstring)."""
        self._probing = False
        if not self.cost.timed(1):
            return 0  # warm-up: time a plain decode step first
        if self.cost_draft is None or not self.cost.multi_row_timed:
            return self._initial_gamma  # warm-up: time one speculative round
        g, speedup = self.best()
        if self.speculating:
            if not speedup > 1.0:  # also nan; at 1.0 drafting gains nothing
                self.speculating = False
                self._probes.wait()
                self._probes.tick()  # this call's decode step is the first of the interval
                return 0
            self.gamma = self._longest_near(speedup)
            return self.gamma
        if speedup >= 1.0 + self.hysteresis:
            self.speculating = True
            self._probes.reset()
            self.gamma = g
            return g
        if self._probes.is_due and self._probe_affordable():
            if not self._probe_is_cheap():  # back off (kept if the probe fails); cheap probes stay frequent
                self._probes.back_off()
            self._probes.wait()
            self._probing, self._last_probe = True, self._probes.count
            return min(max(self.probe_gamma, self.gamma_min), self.gamma_max)
        self._probes.tick()
        return 0

    def _longest_near(self, best_speedup: float) -> int:
        """The longest gamma whose expected speedup is within gamma_tolerance of the best."""
        floor = (1.0 - self.gamma_tolerance) * best_speedup
        return max(g for g in range(self.gamma_min, self.gamma_max + 1) if self.expected_speedup(g) >= floor)

    def start_sequence(self) -> None:
        """A new prompt begins. Acceptance and costs carry over, but when speculation is off and a
        probe is cheap (an n-gram probe costs about one verify call; a draft-model probe several
        draft steps), probe at once: how well lookup works depends on the prompt."""
        if not self.speculating and self._probe_is_cheap():
            self._probes.reset()
            self._probes.due_now()

    def probe_steps(self) -> float:
        """A probe round's cost in plain decode steps (nan before its costs are timed)."""
        if not self.cost.timed(1) or self.cost_draft is None:
            return math.nan
        g = min(max(self.probe_gamma, self.gamma_min), self.gamma_max)
        return g * self.cost_draft / self.cost.by_rows[1] + max(self.cost_verify(g + 1) / self.cost.by_rows[1], 1.0)

    def _probe_is_cheap(self) -> bool:
        return self.probe_steps() <= CHEAP_PROBE  # False while nan

    def _probe_affordable(self) -> bool:
        """Enough plain steps since the last probe that a rejected one stays within probe_budget."""
        if self._last_probe is None:
            return True
        loss = self.probe_steps() - 1.0  # a rejected probe emits one token, as the plain step would
        return not loss > self.probe_budget * (self._probes.count - self._last_probe)  # nan: affordable

    def stop_drafting(self, q_max: float) -> bool:
        """True when a draft model should stop drafting this round: its own top probability
        q_max fell below min_draft_prob (never when min_draft_prob is 0)."""
        return self.min_draft_prob > 0.0 and q_max < self.min_draft_prob

    # ----------------------------------------------------------------------------- feedback

    def record_round(self, gamma: int, n_accepted: int, draft_seconds: float) -> None:
        """A round drafted `gamma` tokens (the number actually drafted, >= 1), accepted
        n_accepted of them and spent draft_seconds drafting (0 is a real timing: n-gram lookup);
        its verify call is timed into self.cost by the loop."""
        if not _is_int(gamma) or gamma < 1:
            raise InvalidArgument(f"gamma must be an integer >= 1 (tokens drafted), got {gamma!r}")
        if not _is_int(n_accepted) or not 0 <= n_accepted <= gamma:
            raise InvalidArgument(f"n_accepted must be an integer in [0, {gamma}], got {n_accepted!r}")
        if not _is_real(draft_seconds) or draft_seconds < 0:
            raise InvalidArgument(f"draft_seconds must be a finite number >= 0, got {draft_seconds!r}")
        # alpha: per-token Bernoulli EMA over the examined tokens, n successes then one
        # failure when a token was rejected (the MLE view of a truncated geometric).
        w = self.probe_smoothing if self._probing else self.alpha_smoothing
        self._probing = False
        keep = (1.0 - w) ** n_accepted
        alpha = 1.0 - keep * (1.0 - self.alpha)
        if n_accepted < gamma:
            alpha *= 1.0 - w
        self.alpha = min(1.0, max(0.0, alpha))
        self._n_draft += 1
        self.cost_draft = ema(self.cost_draft, draft_seconds / gamma, self._n_draft, self.cost_smoothing)
