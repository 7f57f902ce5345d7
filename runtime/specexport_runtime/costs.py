"""The target's verify cost: seconds of one target call of `rows` rows, learned from the loop's
own timings (every plain step and verify call of the generator's requests) and read by
everything that prices a round: the draft-length policy's strategies (policy.py: the gamma
controller, the batch's gamma, the suffix draft-limit tuner). One per generator (the policy's),
since the cost belongs to the target.

    seconds(rows) ~= a + b * rows                          batch-1 graph (VerifyCost)
    seconds(running, rows) ~= a + b * rows + c * running   batch graph (VerifyCost.batch, BatchCost)

Each call size keeps an EMA of its timings (a running mean over its first 1 / smoothing
observations, so early timings are not dwarfed by a prior); the line is the least-squares fit
through the sizes seen, one point per size (a size timed 1000 times counts as much as one timed
twice: the line describes the sizes, not the traffic), its slope clamped at >= 0 and its value
never below the cheapest size's.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidArgument


def ema(old: float | None, obs: float, count: int, weight: float) -> float:
    """EMA that starts as a running mean: the first observations are not dwarfed by `old`."""
    if old is None:
        return obs
    w = max(weight, 1.0 / count)
    return old + w * (obs - old)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


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


@dataclass
class VerifyCost:
    smoothing: float = 0.2  # EMA weight of one timing
    by_rows: dict[int, float] = field(default_factory=dict)  # rows -> seconds (EMA)
    counts: dict[int, int] = field(default_factory=dict)  # rows -> timings seen
    batch: BatchCost = field(default_factory=BatchCost)  # the target's batch-graph calls (batch.py)

    def __post_init__(self) -> None:
        if not _is_real(self.smoothing) or not 0.0 < self.smoothing <= 1.0:
            raise InvalidArgument(f"cost smoothing must be a number in (0, 1], got {self.smoothing!r}")
        for rows, seconds in self.by_rows.items():
            self._check(rows, seconds)
            self.counts.setdefault(rows, 1)

    @staticmethod
    def _check(rows, seconds) -> None:
        if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows < 1:
            raise InvalidArgument(f"verify cost rows must be an integer >= 1, got {rows!r}")
        if not _is_real(seconds) or seconds <= 0:
            raise InvalidArgument(f"verify cost seconds must be a finite number > 0, got {seconds!r}")

    def record(self, rows: int, seconds: float) -> None:
        """One target call over `rows` input rows took `seconds` (its host work included)."""
        self._check(rows, seconds)
        self.counts[rows] = self.counts.get(rows, 0) + 1
        self.by_rows[rows] = ema(self.by_rows.get(rows), seconds, self.counts[rows], self.smoothing)

    def timed(self, rows: int) -> bool:
        return rows in self.by_rows

    @property
    def multi_row_timed(self) -> bool:
        """Whether a call of two or more rows has been timed (a verify call)."""
        return any(rows > 1 for rows in self.by_rows)

    def line(self) -> tuple[float, float] | None:
        """(a, b) of seconds = a + b * rows through the sizes seen (slope >= 0); None before two sizes."""
        if len(self.by_rows) < 2:
            return None
        xs = np.fromiter(self.by_rows.keys(), dtype=np.float64)  # [m] sizes
        cs = np.fromiter(self.by_rows.values(), dtype=np.float64)  # [m] seconds
        dx = xs - xs.mean()
        b = max(0.0, float(dx @ (cs - cs.mean()) / (dx @ dx)))
        return float(cs.mean()) - b * float(xs.mean()), b

    def seconds(self, rows: int) -> float:
        """The line at `rows`, never below the cheapest timing; one size timed: that size's
        seconds (flat); nan before any timing."""
        if not self.by_rows:
            return math.nan
        fit = self.line()
        if fit is None:
            return next(iter(self.by_rows.values()))
        a, b = fit
        return max(a + b * rows, min(self.by_rows.values()))

    def describe(self) -> dict:
        fit = self.line()
        return {
            "seconds_by_rows": {str(r): round(s, 6) for r, s in sorted(self.by_rows.items())},
            "seconds_per_call": None if fit is None else round(fit[0], 6),
            "seconds_per_row": None if fit is None else round(fit[1], 6),
        }
