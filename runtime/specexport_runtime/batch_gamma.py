"""The draft length of a batch's rounds (BatchGamma), from what its calls and rounds cost.

One model over every batch size: a call of the target's batch graph costs
a + b * rows + c * running seconds (BatchCost), a batched draft step costs what steps cost at
that batch size (the draft's own fitted call where none was timed), and each running sequence
expects 1 + p * sum_{j=1..g} alpha^j tokens from a draft of g (its acceptance alpha, how often
its proposer drafts at all p). A guard then checks the model against whole rounds: tokens per
second realized with drafts and without, per batch-size bucket (1, 2, 3-4, 5-8, ...).

A draft model reads lazily: a sequence's prompt, and the tokens of rounds it sat out, wait
unread until it next drafts, and then it reads them in one batched call. So the price of
drafting includes that backlog, at the draft's fitted cost per row (a call of the draft's batch
graph costs a + b * rows + c * running too), spread over the rounds the sequence may still
draft (half the tokens it may still emit, at most SWITCH_ROUNDS); where the backlog is long
(many plain rounds, or prompts not yet read) drafting must promise more before it starts.

Free retrieval drafts (hybrid's offers where the text repeats, the suffix proposer's) cost rows
but no draft call, so they have a limit of their own (free_limit): a row is worth adding while
the tokens it is expected to bring (alpha^j for the j-th, alpha learned over every free draft)
come faster than plain decoding brings them, at the fitted cost per row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .costs import BatchCost, VerifyCost, ema
from .pacing import (
    EVIDENCE_ROUNDS,
    FREE,
    GUARD_ROUNDS,
    MARGIN,
    PRIOR_ALPHA,
    PROBE_GAMMA,
    RECHECK_BACKOFF,
    RECHECK_EVERY,
    RECHECK_ROUNDS,
    SEQUENCES_KEPT,
    SWITCH_ROUNDS,
    TRUST_SEQUENCES,
    ProbeClock,
)
from .registry import NONE

__all__ = [  # the pacing constants this strategy reads, re-exported under the names it has always had
    "EVIDENCE_ROUNDS",
    "FREE",
    "GUARD_ROUNDS",
    "PRIOR_ALPHA",
    "PROBE_GAMMA",
    "RECHECK_BACKOFF",
    "RECHECK_EVERY",
    "RECHECK_ROUNDS",
    "SEQUENCES_KEPT",
    "SWITCH_ROUNDS",
    "TRUST_SEQUENCES",
    "BatchCost",
    "BatchGamma",
    "bucket",
]


def bucket(running: int) -> int:
    """The guard's batch-size bucket: the power of two at or above `running` (1, 2, 4, 8, ...)."""
    return 1 << max(0, running - 1).bit_length()


class BatchGamma:
    """The policy's strategy for a batch (policy.DraftPolicy): each round's draft length for the
    whole batch, the gamma in 0..gamma_max that maximizes expected tokens per second (module
    docstring). Drafting pays for the draft model's unread backlog (switch_seconds), and a
    gamma > 0 must promise `margin` more than gamma 0. Until a call with draft rows is timed the
    gamma is PROBE_GAMMA (one probe serves every batch size), and so it is instead of 0 while a
    running proposer has drafted in fewer than EVIDENCE_ROUNDS rounds, unless drafts could not pay
    here even if every drafted token were accepted (then its acceptance is not worth learning at
    this batch size). The guard (guard) then checks the model against what whole rounds realize.

    The guard's rules are written out in pacing.py, next to its constants (and in
    docs/batching.md); guard() follows them line by line."""

    def __init__(self, gamma_max: int, margin: float = MARGIN, cost: VerifyCost | None = None):
        """margin: a draft must promise this much more than plain decoding (0.1: 10%); cost: the
        target's cost model (the policy's; default a fresh one), whose batch plane this reads."""
        self.gamma_max, self.margin = gamma_max, margin
        self.cost = (cost if cost is not None else VerifyCost()).batch  # the target's batch-graph calls
        self.draft_cost = BatchCost()  # the draft model's batch-graph calls: steps and backlog catch-ups
        # per proposer, over every sequence that ran it: (alpha, p) EMAs, a new sequence's start
        self.learned: dict[str, tuple[float | None, float | None]] = {}
        # proposer -> ids of the sequences whose drafts it learned from (at most SEQUENCES_KEPT)
        self._sequences: dict[str, set[int]] = {}
        self.evidence: dict[str, int] = {}  # proposer -> sequence rounds in which it drafted
        self._asked: dict[str, int] = {}  # proposer -> sequence rounds asked to draft
        # (bucket, drafted) -> [rounds, tokens EMA, seconds EMA] of whole rounds (observe)
        self.realized: dict[tuple[int, bool], list[float]] = {}
        self._rechecks: dict[int, ProbeClock] = {}  # bucket -> its judged rounds and rechecks
        self._drafted_with: dict[int, int] = {}  # bucket -> the gamma of its last observed drafting round

    @property
    def probe(self) -> int:
        """The draft length of probe rounds: PROBE_GAMMA, within gamma_max."""
        return min(PROBE_GAMMA, self.gamma_max)

    def prior(self, proposer: str) -> tuple[float, float]:
        """(alpha, p) a new sequence of `proposer` starts from: what its earlier sequences showed
        (PRIOR_ALPHA and 1.0 before any). The acceptance leans towards PRIOR_ALPHA while few
        sequences showed it: one sequence's text (a warm-up prompt) says little of the next's."""
        a, p = self.learned.get(proposer, (None, None))
        if a is not None:
            n = len(self._sequences.get(proposer, ()))
            a = (n * a + TRUST_SEQUENCES * PRIOR_ALPHA) / (n + TRUST_SEQUENCES)
        return PRIOR_ALPHA if a is None else a, 1.0 if p is None else p

    def learn(self, proposer: str, alpha: float | None, proposed: float | None, sequence: int = 0) -> None:
        """One round of sequence `sequence` running `proposer`: the share of its drafted tokens
        accepted (None: it drafted nothing) and of the asked gamma it drafted (None: none was asked)."""
        a, p = self.learned.get(proposer, (None, None))
        if alpha is not None:
            n = self.evidence[proposer] = self.evidence.get(proposer, 0) + 1
            a = ema(a, alpha, n, 0.05)
            seen = self._sequences.setdefault(proposer, set())
            if len(seen) < SEQUENCES_KEPT:
                seen.add(sequence)
        if proposed is not None:
            self._asked[proposer] = self._asked.get(proposer, 0) + 1
            p = ema(p, proposed, self._asked[proposer], 0.05)
        self.learned[proposer] = (a, p)

    def record(self, running: int, rows: int, seconds: float) -> None:
        """One target call of `running` sequences over `rows` rows took `seconds`."""
        self.cost.record(running, rows, seconds)

    def record_draft(self, running: int, rows: int, seconds: float) -> None:
        """One batched draft-model call for `running` sequences over `rows` rows took `seconds`
        (a draft step feeds each one or two rows; a backlog's catch-up more)."""
        self.draft_cost.record(running, rows, seconds)

    def draft_seconds(self, running: int) -> float:
        """One draft step of `running` sequences: the steps timed at that number of sequences
        (their cells' mean); where none were, the draft's fitted call of one row each (a step at
        another batch size says little about this one: a batched step grows with its rows), or
        before a fit the steps timed at the nearest number; 0 before any draft call."""
        steps: dict[int, list[float]] = {}
        for (r, rows), seconds in self.draft_cost.cells.items():
            if rows <= 2 * r:  # one or two rows each: a step
                steps.setdefault(r, []).append(seconds)
        if running in steps:
            return sum(steps[running]) / len(steps[running])
        if self.draft_cost.fit() is not None:
            return self.draft_cost.seconds(running, running)
        if not steps:
            return 0.0
        near = min(steps, key=lambda r: (abs(r - running), -r))
        return sum(steps[near]) / len(steps[near])

    def switch_seconds(self, backlog: Sequence[tuple[int, int]], horizon: float = SWITCH_ROUNDS) -> float:
        """Seconds a round with drafts adds for the draft model's catch-up call. backlog: per
        sequence drafting with it, (unread, left): the tokens it has not read and the most tokens
        the sequence may still emit. Its rows beyond a step's two cost the fitted cost of a row
        (a step's per sequence before a catch-up is timed; 0 before any draft call), spread over
        the rounds it may still draft: left / 2 (a drafting round emits about two tokens at
        least), at most `horizon` (SWITCH_ROUNDS; a recheck's RECHECK_ROUNDS)."""
        extra = [(u - 2, left) for u, left in backlog if u > 2]
        if not extra:
            return 0.0
        fit = self.draft_cost.fit()
        per_row = fit[1] if fit is not None and fit[1] > 0 else self.draft_seconds(len(backlog)) / len(backlog)
        return per_row * sum(rows / min(horizon, max(1.0, left / 2)) for rows, left in extra)

    def observe(self, running: int, drafted: bool, tokens: int, seconds: float, gamma: int = 0) -> None:
        """A whole round of `running` sequences (with or without draft rows) emitted `tokens`
        in `seconds`. The scheduler reports steady rounds only: a drafting round after a
        drafting round, a plain one after a plain one (a switch's catch-up is not the rate);
        gamma: the batch's gamma the round drafted with."""
        if seconds <= 0:
            return
        if drafted and gamma:
            self._drafted_with[bucket(running)] = gamma
        rec = self.realized.setdefault((bucket(running), drafted), [0, 0.0, 0.0])
        rec[0] += 1
        rec[1], rec[2] = (ema(old, new, rec[0], 0.1) for old, new in ((rec[1], tokens), (rec[2], seconds)))

    def rate(self, running: int, drafted: bool, extra: float = 0.0) -> float | None:
        """Realized tokens per second of rounds of this kind in running's bucket, once
        GUARD_ROUNDS were seen; extra: seconds added to each round (a catch-up's share)."""
        rounds, tokens, seconds = self.realized.get((bucket(running), drafted), (0, 0.0, 0.0))
        return tokens / (seconds + extra) if rounds >= GUARD_ROUNDS else None

    def guard(self, running: int, gamma: int, worth: Callable[[], bool] | None = None, switch: float = 0.0) -> int:
        """The model's gamma, or what the guard's rules (class docstring) make of it. worth():
        whether a drafting recheck that is due would pay for itself (choose: its draft catch-up
        spread over the recheck's own rounds). switch: seconds a drafting round adds now for the
        draft model's catch-up (switch_seconds): the steady rounds observed never paid it."""
        key = bucket(running)
        plain, drafted = self.rate(running, False), self.rate(running, True)
        if gamma == 0:
            paid = self.rate(running, True, switch)  # what drafting from here realizes, its catch-up paid
            if plain is not None and paid is not None and paid > plain * (1 + self.margin):
                return self._drafted_with.get(key, self.probe)
            return 0
        clock = self._rechecks.setdefault(key, ProbeClock(RECHECK_EVERY, RECHECK_EVERY * RECHECK_BACKOFF))
        clock.tick()
        if clock.in_probe():  # a recheck under way: its rounds come in a row
            return gamma if clock.drafting else 0
        if plain is None:  # too few plain rounds to compare with: a plain recheck now and then
            if not clock.is_due:
                return gamma
            clock.begin(RECHECK_ROUNDS - 1, drafting=False)
            clock.wait()
            return 0
        if drafted is not None and drafted < plain:
            if not clock.is_due:
                return 0
            if worth is not None and not worth():  # the catch-up alone would sink it: later
                clock.wait()
                return 0
            clock.back_off()
            clock.begin(RECHECK_ROUNDS - 1, drafting=True)
            clock.wait()
            return gamma
        clock.reset()  # drafting holds its own: rechecks at the first interval again
        clock.due_within(RECHECK_EVERY)
        return gamma

    def free_limit(self, running: int) -> int:
        """Most tokens a free retrieval draft of one of `running` sequences may verify in a round
        (module docstring): gamma_max until a call with draft rows is timed; at least the probe
        while free drafts have fewer than EVIDENCE_ROUNDS rounds of record."""
        fit = self.cost.fit()
        if fit is None or fit[1] <= 0:
            return self.gamma_max
        alpha = self.prior(FREE)[0]
        plain = running / self.cost.seconds(running, running)  # tokens per second of a plain round
        g = 0
        while g < self.gamma_max and alpha ** (g + 1) > fit[1] * plain:  # row g+1 brings alpha^(g+1) tokens
            g += 1
        return max(g, self.probe) if self.evidence.get(FREE, 0) < EVIDENCE_ROUNDS else g

    def rates(self, figures: Sequence[tuple[float, float]], step: float, switch: float) -> list[float]:
        """Expected tokens per second of a round at each gamma 0..gamma_max. figures: each running
        sequence's (alpha, p); step: seconds of one batched draft step; switch: seconds a round
        with drafts adds to pay for the draft model's backlog."""
        n, out = len(figures), []
        for g in range(self.gamma_max + 1):
            tokens = sum(1 + p * sum(alpha**j for j in range(1, g + 1)) for alpha, p in figures)
            rows = sum(1 + p * g for _, p in figures)
            out.append(tokens / (self.cost.seconds(n, math.ceil(rows)) + (g * step + switch if g else 0.0)))
        return out

    def choose(self, seqs: Sequence) -> int:
        """seqs: the running sequences (batch.BatchSequence: _alpha, _proposed, drafts_with_model,
        draft_unread, tokens_left); those drafting with a model add gamma batched draft steps,
        and their draft's catch-up (switch_seconds)."""
        if not seqs or self.gamma_max == 0:
            return 0
        if self.cost.fit() is None:  # no call with draft rows timed yet: a short draft times one
            return self.probe
        model = [s for s in seqs if s.drafts_with_model]
        step = self.draft_seconds(len(model)) if model else 0.0
        backlog = [(s.draft_unread, s.tokens_left) for s in model]
        figures = [(s._alpha, s._proposed) for s in seqs]
        switch = self.switch_seconds(backlog)
        rates = self.rates(figures, step, switch)
        best = 0
        for g in range(1, len(rates)):
            if rates[g] > rates[best] * 1.0001:  # ties go to the shorter draft
                best = g
        if rates[best] < rates[0] * (1 + self.margin):  # what the model leaves out (host work) eats small gains
            best = 0
        unproven = any(self.evidence.get(s.proposer, 0) < EVIDENCE_ROUNDS for s in seqs if s.proposer != NONE)
        if best == 0 and unproven:  # its acceptance is still the prior: learn it where drafts could pay
            perfect = self.rates([(1.0, 1.0)] * len(seqs), step, switch)
            if perfect[self.probe] > rates[0] * (1 + self.margin):
                best = self.probe

        def worth() -> bool:  # a recheck drafts RECHECK_ROUNDS rounds, then stops: its catch-up is theirs alone
            rechecked = self.rates(figures, step, self.switch_seconds(backlog, RECHECK_ROUNDS))
            return rechecked[best] > rechecked[0]

        return self.guard(len(seqs), best, worth, switch)
