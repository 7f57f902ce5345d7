"""The draft length of a batch's rounds (BatchGamma), from what its calls and rounds cost.

One model over every batch size: a call of the target's batch graph costs
a + b * rows + c * running seconds (BatchCost), a batched draft step costs what it cost at the
nearest batch size timed, and each running sequence expects 1 + p * sum_{j=1..g} alpha^j tokens
from a draft of g (its acceptance alpha, how often its proposer drafts at all p). A guard then
checks the model against whole rounds: tokens per second realized with drafts and without, per
batch-size bucket (1, 2, 3-4, 5-8, ...).

Free retrieval drafts (hybrid's offers where the text repeats, the suffix proposer's) cost rows
but no draft call, so they have a limit of their own (free_limit): a row is worth adding while
the tokens it is expected to bring (alpha^j for the j-th, alpha learned over every free draft)
come faster than plain decoding brings them, at the fitted cost per row.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from .costs import ema
from .registry import NONE

PROBE_GAMMA = 2  # the draft length of the rounds that time a call with draft rows
GUARD_ROUNDS = 4  # rounds of each kind (drafted, plain) a bucket needs before the guard compares them
RECHECK_EVERY = 64  # the guard lets one of this many blocked drafts through, and forces one plain round
SWITCH_ROUNDS = 8  # rounds a switch from plain rounds to drafting is priced over (its catch-up step)
EVIDENCE_ROUNDS = 8  # drafted rounds (over its sequences) a proposer's acceptance needs before gamma 0 stands
FREE = "retrieval"  # the record of free retrieval drafts (hybrid's offers, suffix), apart from their proposers'


def bucket(running: int) -> int:
    """The guard's batch-size bucket: the power of two at or above `running` (1, 2, 4, 8, ...)."""
    return 1 << max(0, running - 1).bit_length()


@dataclass
class BatchCost:
    """Seconds of one batch call: a + b * rows + c * running, fitted by least squares to the EMA
    of each (running, rows) cell timed, with b, c >= 0 (rows only while one batch size is seen).
    No fit until a call with draft rows (rows > running) is timed."""

    smoothing: float = 0.2
    cells: dict[tuple[int, int], float] = field(default_factory=dict)  # (running, rows) -> seconds EMA
    counts: dict[tuple[int, int], int] = field(default_factory=dict)
    _fit: tuple[float, float, float] | None = None

    def record(self, running: int, rows: int, seconds: float) -> None:
        if seconds <= 0 or rows < running:
            return
        key = (running, rows)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.cells[key] = ema(self.cells.get(key), seconds, self.counts[key], self.smoothing)
        self._fit = self._solve()

    def fit(self) -> tuple[float, float, float] | None:
        return self._fit

    def seconds(self, running: int, rows: float) -> float:
        a, b, c = self._fit  # callers check fit() first
        return a + b * rows + c * running

    def _solve(self) -> tuple[float, float, float] | None:
        keys = list(self.cells)
        if not any(rows > running for running, rows in keys):
            return None  # plain rounds only: rows and running move together
        X = np.array([[1.0, rows, running] for running, rows in keys])  # [m, 3]
        y = np.array([self.cells[k] for k in keys])  # [m]
        use = [0, 1, 2] if len({r for r, _ in keys}) > 1 else [0, 1]
        while True:
            coef, *_ = np.linalg.lstsq(X[:, use], y, rcond=None)
            negative = [j for j, v in zip(use[1:], coef[1:]) if v < 0]
            if not negative:
                break
            use.remove(negative[0])  # a slope below 0 is noise: drop it and refit
        out = dict(zip(use, coef))
        return float(out[0]), float(out.get(1, 0.0)), float(out.get(2, 0.0))

    def describe(self) -> dict:
        names = ("a", "per_row", "per_running")
        fit = None if self._fit is None else {k: round(v, 6) for k, v in zip(names, self._fit)}
        return {"cells": {f"{r}x{n}": round(s, 6) for (r, n), s in sorted(self.cells.items())}, "fit": fit}


class BatchGamma:
    """Each round's draft length for the whole batch: the gamma in 0..gamma_max that maximizes
    expected tokens per second (module docstring). A draft model that sat out the last round
    first catches up (one more draft step), which a gamma > 0 then pays for (spread over
    SWITCH_ROUNDS rounds: it is paid once per switch), and a gamma > 0 must
    promise `margin` more than gamma 0. Until a call with draft rows is timed the gamma is
    PROBE_GAMMA (one probe serves every batch size), and so it is instead of 0 while a running
    proposer has drafted in fewer than EVIDENCE_ROUNDS rounds (its acceptance is still the prior).

    The model leaves out host work and misjudges what it cannot see, so a guard checks it against
    what rounds realize (observe()): where rounds with drafts realize fewer tokens per second than
    rounds without, in the same bucket of batch sizes, the gamma is 0, with one drafting round in
    RECHECK_EVERY to keep the comparison current; while plain rounds are too few to compare, one
    round in RECHECK_EVERY is plain. Where rounds with drafts realize `margin` more than plain
    ones and the model says 0, the batch drafts with the gamma those rounds drafted with."""

    def __init__(self, gamma_max: int, margin: float = 0.1):
        """margin: a draft must promise this much more than plain decoding (0.1: 10%)."""
        self.gamma_max, self.margin = gamma_max, margin
        self.cost = BatchCost()
        self._last: int | None = None  # the last gamma chosen
        self.draft_step: dict[int, float] = {}  # running sequences -> seconds of one batched draft call (EMA)
        # per proposer, over every sequence that ran it: (alpha, p) EMAs, a new sequence's start
        self.learned: dict[str, tuple[float | None, float | None]] = {}
        self.evidence: dict[str, int] = {}  # proposer -> sequence rounds in which it drafted
        self._asked: dict[str, int] = {}  # proposer -> sequence rounds asked to draft
        # (bucket, drafted) -> [rounds, tokens EMA, seconds EMA] of whole rounds (observe)
        self.realized: dict[tuple[int, bool], list[float]] = {}
        self._decisions: dict[int, int] = {}  # bucket -> rounds the guard has judged
        self._drafted_with: dict[int, int] = {}  # bucket -> the gamma of its last observed drafting round

    @property
    def probe(self) -> int:
        """The draft length of probe rounds: PROBE_GAMMA, within gamma_max."""
        return min(PROBE_GAMMA, self.gamma_max)

    def prior(self, proposer: str) -> tuple[float, float]:
        """(alpha, p) a new sequence of `proposer` starts from: what its earlier sequences showed
        (0.5 and 1.0 before any)."""
        a, p = self.learned.get(proposer, (None, None))
        return 0.5 if a is None else a, 1.0 if p is None else p

    def learn(self, proposer: str, alpha: float | None, proposed: float | None) -> None:
        """One round of a sequence running `proposer`: the share of its drafted tokens accepted
        (None: it drafted nothing) and of the asked gamma it drafted (None: none was asked)."""
        a, p = self.learned.get(proposer, (None, None))
        if alpha is not None:
            n = self.evidence[proposer] = self.evidence.get(proposer, 0) + 1
            a = ema(a, alpha, n, 0.05)
        if proposed is not None:
            self._asked[proposer] = self._asked.get(proposer, 0) + 1
            p = ema(p, proposed, self._asked[proposer], 0.05)
        self.learned[proposer] = (a, p)

    def record(self, running: int, rows: int, seconds: float) -> None:
        """One target call of `running` sequences over `rows` rows took `seconds`."""
        self.cost.record(running, rows, seconds)

    def record_draft(self, running: int, seconds: float) -> None:
        """One batched draft-model call of a round with `running` sequences took `seconds`."""
        old = self.draft_step.get(running)
        self.draft_step[running] = seconds if old is None else old + 0.2 * (seconds - old)

    def draft_seconds(self, running: int) -> float:
        """One draft step at `running` sequences: as timed at the nearest batch size (0 before any)."""
        if not self.draft_step:
            return 0.0
        near = min(self.draft_step, key=lambda r: (abs(r - running), -r))
        return self.draft_step[near]

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

    def rate(self, running: int, drafted: bool) -> float | None:
        """Realized tokens per second of rounds of this kind in running's bucket, once
        GUARD_ROUNDS were seen."""
        rounds, tokens, seconds = self.realized.get((bucket(running), drafted), (0, 0.0, 0.0))
        return tokens / seconds if rounds >= GUARD_ROUNDS else None

    def guard(self, running: int, gamma: int) -> int:
        """The model's gamma, or 0 where rounds with drafts realize less than rounds without; where
        they realize `margin` more, at least the gamma they drafted with, whatever the model says."""
        key = bucket(running)
        plain, drafted = self.rate(running, False), self.rate(running, True)
        if gamma == 0:
            if plain is not None and drafted is not None and drafted > plain * (1 + self.margin):
                return self._drafted_with.get(key, self.probe)
            return 0
        n = self._decisions[key] = self._decisions.get(key, 0) + 1
        if plain is None:
            return 0 if n % RECHECK_EVERY == 0 else gamma  # a plain round now and then, to compare with
        if drafted is not None and drafted < plain and n % RECHECK_EVERY:
            return 0
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

    def choose(self, seqs: Sequence) -> int:
        """seqs: the running sequences (batch.BatchSequence: _alpha, _proposed,
        drafts_with_model); those drafting with a model add gamma batched draft calls."""
        if not seqs or self.gamma_max == 0:
            return 0
        if self.cost.fit() is None:  # no call with draft rows timed yet: a short draft times one
            self._last = self.probe
            return self._last
        n = len(seqs)
        step = self.draft_seconds(n) if any(s.drafts_with_model for s in seqs) else 0.0
        # a draft model idle last round first feeds what it missed: one step, paid once when drafting
        # starts, so it is spread over the rounds a switch lasts at the least
        catchup = 1 / SWITCH_ROUNDS if self._last == 0 else 0.0
        best, best_rate, plain = 0, -1.0, 0.0
        for g in range(self.gamma_max + 1):
            tokens = sum(1 + s._proposed * sum(s._alpha**j for j in range(1, g + 1)) for s in seqs)
            rows = sum(1 + s._proposed * g for s in seqs)
            rate = tokens / (self.cost.seconds(n, math.ceil(rows)) + (g + (catchup if g else 0)) * step)
            plain = plain or rate  # g = 0
            if rate > best_rate * 1.0001:  # ties go to the shorter draft
                best, best_rate = g, rate
        if best_rate < plain * (1 + self.margin):  # what the model leaves out (catch-ups, host work) eats small gains
            best = 0
        if best == 0 and any(self.evidence.get(s.proposer, 0) < EVIDENCE_ROUNDS for s in seqs if s.proposer != NONE):
            best = self.probe  # its acceptance is still the prior: learn it
        self._last = self.guard(n, best)
        return self._last
