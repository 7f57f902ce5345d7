"""The suffix proposer's draft limit (LimitTuner): which scale of the configured limit pays on
this target, from replays of probe rounds priced by the target's verify cost. The policy's
strategy for free suffix drafts (policy.DraftPolicy); its constants are pacing's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .drafts import SuffixConfig
from .pacing import LIMIT_HORIZON, LIMIT_PROBE_EVERY, LIMIT_SLOW, LIMIT_SLOW_PROBES, LIMIT_WARMUP, ProbeClock


@dataclass
class LimitTuner:
    """Which draft limit pays on this target. SuffixDecoding's limit min(max_spec, factor x match)
    was set for GPUs, where a verify call costs about the same for 2 rows or 30; on a CPU each row
    costs a share of a decode step that depends on the target (docs/performance.md, "Quantized
    targets"), and so does the best limit (docs/proposers.md, "Suffix draft length"). The configured limit is
    scaled by one of the config's limit_scales, chosen from paired what-ifs:

    - a probe round drafts at the largest scale (the first WARMUP rounds, then every
      PROBE_EVERY-th, or every LIMIT_SLOW_PROBES x PROBE_EVERY-th while the largest scale's
      replays cost more than LIMIT_SLOW times the best's; a pacing.ProbeClock aligned on those
      multiples): k tokens along one chain, n of them accepted, so n + 1 emitted;
    - each scale replays that stretch (`replay`): it drafts what its own limit allows of the same
      chain, emits what the target accepted of it plus one token, and goes on from there with
      the match grown by what it emitted, until it has the same n + 1 tokens; its cost is its
      calls and rows;
    - the target's verify cost line, seconds = a + b x rows (costs.VerifyCost, timed by the loop),
      prices them: other rounds draft at the scale with the least a x calls + b x rows over the
      probes.

    Every scale is judged on the same stretches of text, so the comparison needs far fewer rounds
    than timing each scale on rounds of its own, and a short limit is credited with the rounds
    that continue a fully accepted draft (judging it on the probe round alone would favour long
    drafts). Sums halve past HORIZON probes. Shared by the generator's requests (like
    SourceCalibration). The choice never changes an output, only its speed: drafts are verified."""

    WARMUP = LIMIT_WARMUP
    PROBE_EVERY = LIMIT_PROBE_EVERY
    HORIZON = LIMIT_HORIZON
    calls: dict[float, float] = field(default_factory=dict)  # scale -> target calls its replays took (shares of one)
    rows: dict[float, float] = field(default_factory=dict)  # scale -> rows its replays verified
    tokens: float = 0.0  # tokens emitted by the probes (the same for every scale)
    probes: float = 0.0
    _clock: ProbeClock = field(
        default_factory=lambda: ProbeClock(LIMIT_PROBE_EVERY, LIMIT_SLOW_PROBES * LIMIT_PROBE_EVERY)
    )

    def choose(self, scales: tuple[float, ...], line: tuple[float, float] | None) -> float:
        """The scale of the next round; line: the target's (a, b), None before it is fitted."""
        if len(scales) == 1:
            return scales[0]
        self._clock.tick()
        top = max(scales)
        if self.probes < self.WARMUP:
            return top
        costs = self.costs(scales, line)
        best = self._cheapest(scales, costs)
        # probes cost where the largest scale is slow: then LIMIT_SLOW_PROBES times rarer
        slow = costs is not None and costs[top] > LIMIT_SLOW * costs[best]
        self._clock.align(self._clock.cap if slow else self._clock.first)
        return top if self._clock.is_due else best

    def costs(self, scales, line: tuple[float, float] | None) -> dict[float, float] | None:
        """scale -> seconds its replays took by `line` (its intercept at least 1e-6); None without one."""
        if line is None:
            return None
        a, b = max(line[0], 1e-6), line[1]
        return {x: a * self.calls.get(x, 0.0) + b * self.rows.get(x, 0.0) for x in scales}

    def best(self, scales: tuple[float, ...], line: tuple[float, float] | None) -> float:
        """The scale whose replays took the least time (ties: the larger); the smallest while the
        line is not fitted (its rounds time another size, which the line needs)."""
        return self._cheapest(scales, self.costs(scales, line))

    @staticmethod
    def _cheapest(scales: tuple[float, ...], costs: dict[float, float] | None) -> float:
        return min(scales) if costs is None else min(sorted(scales, reverse=True), key=costs.__getitem__)

    @staticmethod
    def replay(limit, match: int, drafted: int, accepted: int, open_end: bool) -> tuple[float, int]:
        """(calls, rows) a draft limit `limit(match)` needs to emit the accepted + 1 tokens a
        probe round emitted from `drafted` tokens of one chain (the chain is known that far).
        open_end: the probe's draft was cut by its own limit and fully accepted, so the chain
        goes on; a round that would draft past the known end then counts only for the share of
        its tokens that falls inside the stretch (the rest starts the next stretch, whose cost
        the next probe sees), so short limits are not charged a whole call for one token."""
        calls, rows, pos = 0.0, 0, 0  # pos: tokens emitted so far
        while pos <= accepted:
            want = max(0, limit(match + pos))
            j = min(want, drafted - pos)  # this round's draft, within the known chain
            if open_end and j < want:
                return calls + (j + 1) / (want + 1), rows + j + 1
            calls, rows = calls + 1, rows + j + 1
            pos += min(j, accepted - pos) + 1  # accepted drafted tokens, then the target's own
        return calls, rows

    def record(self, scale: float, drafted: int, accepted: int, match: int, configs: dict[float, SuffixConfig]) -> None:
        """A verified round: `drafted` tokens at `scale` after a match of `match` tokens,
        `accepted` of them. configs: scale -> its SuffixConfig. A probe round (drafted at the
        largest scale) is replayed for every scale; other rounds teach nothing here."""
        if scale != max(configs):
            return
        open_end = accepted == drafted == configs[scale].limit(match)
        for x, config in configs.items():
            calls, rows = self.replay(
                lambda m, c=config: c.limit(min(m, c.max_depth)), match, drafted, accepted, open_end
            )
            self.calls[x] = self.calls.get(x, 0.0) + calls
            self.rows[x] = self.rows.get(x, 0.0) + rows
        self.tokens += accepted + 1
        self.probes += 1
        if self.probes > self.HORIZON:
            self.probes, self.tokens = self.probes / 2, self.tokens / 2
            for sums in (self.calls, self.rows):
                for x in sums:
                    sums[x] /= 2

    def describe(self, line: tuple[float, float] | None) -> dict:
        a, b = line or (math.nan, math.nan)
        costs = self.costs(sorted(self.calls), line or (1.0, 0.0))  # no line yet: calls alone
        return {
            "probes": round(self.probes),
            "seconds_per_call": round(a, 6),
            "seconds_per_row": round(b, 6),
            "tokens_per_second": {str(x): round(self.tokens / max(c, 1e-12), 1) for x, c in costs.items()},
        }
