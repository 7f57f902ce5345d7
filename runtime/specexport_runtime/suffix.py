"""Suffix speculation (SuffixDecoding, chain mode): draft what followed the longest earlier match
of the recent tokens, in the current request and in past responses, choosing at each step the
continuation seen most often.

A suffix tree over a sequence answers "which substrings occur, how often, and what follows
them". The same answers come from the occurrence positions themselves, which is what this module
keeps (memory: a few bytes per token instead of tree nodes per token):

    match   the longest suffix s = context[-m:] (m <= max_depth) that occurred earlier: the set C
            of positions where an occurrence of s ends, found by extending the occurrences of
            context[-1] backwards one token at a time while any remain (`longest_match`)
    draft   along the tree path below s: the next token is the most frequent seq[c + 1] over
            c in C (= the child with the largest count); its probability count / |C| multiplies
            into the path probability; C becomes the occurrences that continued with it. Stop
            when the path probability falls below `min_prob` or after
            min(max_spec, floor(factor * m + offset)) tokens (`draft_chain`), a limit that
            `LimitTuner` scales to what pays on the target
    score   the sum of the path probabilities of the drafted tokens (the expected number of
            accepted tokens if each were accepted with its path probability); the better-scoring
            source wins (`SuffixProposer.propose`)

Sequences:
  RequestSuffix   prompt + accepted tokens of the current request (discarded at its end)
  Datastore       (datastore.py) the artifact's static corpus, memory-mapped, when it has one
  SuffixStore     previous responses (accepted text only), separated by SEP, bounded by a token
                  budget with FIFO eviction of whole responses; lives in the SpecGenerator so it
                  serves later calls. Occurrence lists are indexed by the last two tokens.

Drafts are deterministic (q one-hot): the verifier's rejection sampling keeps the target's
distribution exactly, and greedy output equals target-only output.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .errors import InvalidArgument
from .proposers import Proposal, Proposer, ProposerContext

SEP = -1  # between responses in a SuffixStore: no match or draft crosses it
MAX_CANDIDATES = 512  # most recent occurrences considered per match (bounds the cost per round)


@dataclass(frozen=True)
class SuffixConfig:
    """SuffixDecoding's knobs (ArcticInference's names and defaults where they exist)."""

    max_depth: int = 24  # longest suffix matched
    max_spec: int = 16  # most tokens per draft (the loop verifies at most OrtModel.max_rows - 1 of them)
    factor: float = 1.0  # draft length limit: floor(factor * match_length + offset)
    offset: float = 0.0
    min_prob: float = 0.1  # stop drafting when the path probability falls below this
    global_tokens: int = 200_000  # budget of the store of past responses (0: no store)
    hybrid_min_score: float = 1.0  # in `hybrid`: a suffix draft is used when its score reaches this
    # the draft limit is scaled per round by one of these, the scale with the best measured
    # throughput winning (LimitTuner); (1.0,): the limit exactly as configured
    limit_scales: tuple[float, ...] = (0.5, 1.0, 2.0)

    def __post_init__(self) -> None:
        for name, lo, hi in (("max_depth", 1, 4096), ("max_spec", 1, 256), ("global_tokens", 0, 1 << 31)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise InvalidArgument(f"suffix {name} must be an integer in {lo}..{hi}, got {value!r}")
        for name, lo, hi in (("factor", 0.0, 64.0), ("offset", -64.0, 64.0), ("min_prob", 0.0, 1.0),
                             ("hybrid_min_score", 0.0, 256.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise InvalidArgument(f"suffix {name} must be a number in [{lo}, {hi}], got {value!r}")
        scales = self.limit_scales
        if (not isinstance(scales, tuple) or not scales or len(set(scales)) != len(scales)
                or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.125 <= x <= 8.0 for x in scales)):
            raise InvalidArgument(f"suffix limit_scales must be a tuple of distinct numbers in [0.125, 8], got {scales!r}")

    def limit(self, match_length: int) -> int:
        return max(0, min(self.max_spec, math.floor(self.factor * match_length + self.offset)))

    @classmethod
    def fixed_limit(cls, factor: float | None = None, max_spec: int | None = None) -> "SuffixConfig | None":
        """The settings for a draft limit a user gave (--suffix-factor / --suffix-max-spec): the
        defaults with those values, kept as given (no tuning); None when neither was given."""
        given = {k: v for k, v in (("factor", factor), ("max_spec", max_spec)) if v is not None}
        return cls(**given, limit_scales=(1.0,)) if given else None

    def scaled(self, scale: float) -> "SuffixConfig":
        """The same settings with the draft limit (factor, offset, max_spec) times `scale`."""
        return replace(self, factor=min(64.0, self.factor * scale), offset=max(-64.0, min(64.0, self.offset * scale)),
                       max_spec=max(1, min(256, round(self.max_spec * scale))), limit_scales=(1.0,))


def longest_match(seq: np.ndarray, ends: np.ndarray, context: Sequence[int], max_depth: int) -> tuple[int, np.ndarray]:
    """(m, C): the longest m <= max_depth such that context[-m:] == seq[c - m + 1 : c + 1] for
    some c in `ends` (candidate end positions whose token is context[-1], possibly with more
    already known to match), and C those c. (0, empty) when `ends` is empty.
    seq: int32 [N]; a candidate never matches across SEP (context holds no SEP)."""
    if ends.size == 0 or not context:
        return 0, ends[:0]
    m = 1
    limit = min(max_depth, len(context))
    while m < limit:
        back = ends - m
        ok = back >= 0
        keep = ends[ok][seq[back[ok]] == context[-1 - m]]
        if keep.size == 0:
            break
        ends, m = keep, m + 1
    return m, ends


def draft_chain(seq: np.ndarray, ends: np.ndarray, stop: int, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
    """(tokens, score): the most frequent continuation path after occurrences ending at `ends`
    (positions < stop are readable; SEP ends a path), while the path probability stays >= min_prob."""
    tokens: list[int] = []
    p, score = 1.0, 0.0
    while len(tokens) < max_tokens and ends.size:
        if ends.size == 1:  # one occurrence: its continuation up to SEP, at probability p throughout
            start = int(ends[0]) + 1
            run = seq[start : min(stop, start + max_tokens - len(tokens))].tolist()
            run = run[: run.index(SEP)] if SEP in run else run
            return tokens + run, score + p * len(run)
        nxt = ends + 1
        nxt = nxt[nxt < stop]
        values = seq[nxt]
        live = values != SEP
        nxt, values = nxt[live], values[live]
        if values.size == 0:
            break
        token, count = _mode(values)
        p *= count / ends.size  # occurrences that end here count in the parent, as in the tree
        if p < min_prob:
            break
        tokens.append(token)
        score += p
        ends = nxt[values == token]
    return tokens, score


def _mode(values: np.ndarray) -> tuple[int, int]:
    """(the most frequent value, its count); ties: the smallest value (deterministic)."""
    if values.size <= 64:  # a dict count beats numpy's sort at the sizes most rounds see
        counts: dict[int, int] = {}
        for v in values.tolist():
            counts[v] = counts.get(v, 0) + 1
        best = max(counts.values())
        return min(v for v, c in counts.items() if c == best), best
    ids, counts = np.unique(values, return_counts=True)
    best = int(counts.argmax())  # the first maximum: the smallest id
    return int(ids[best]), int(counts[best])


class RequestSuffix:
    """The current request's tokens (prompt + accepted), searchable for earlier matches."""

    def __init__(self, capacity: int = 1024):
        self.seq = np.empty(max(16, capacity), np.int32)
        self.length = 0

    def reset(self, tokens: Sequence[int]) -> None:
        self.length = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        n = len(tokens)
        if self.length + n > self.seq.size:
            grown = np.empty(max(2 * self.seq.size, self.length + n), np.int32)
            grown[: self.length] = self.seq[: self.length]
            self.seq = grown
        self.seq[self.length : self.length + n] = tokens
        self.length += n

    def propose(self, config: SuffixConfig, room: int) -> tuple[list[int], float, int]:
        """(tokens, score, match length) for the request's last tokens; earlier occurrences only."""
        L = self.length
        if L < 2:
            return [], 0.0, 0
        seq = self.seq[:L]
        ends = np.flatnonzero(seq[: L - 1] == seq[L - 1])[-MAX_CANDIDATES:]  # earlier occurrences of the last token
        context = seq[max(0, L - config.max_depth) :].tolist()
        m, ends = longest_match(seq, ends, context, config.max_depth)
        tokens, score = draft_chain(seq, ends, L, min(config.limit(m), room), config.min_prob)
        return tokens, score, m


class SuffixStore:
    """Past responses, separated by SEP, at most `max_tokens` of them (FIFO: the oldest whole
    responses leave first). Absolute positions grow forever; the buffer holds positions
    base .. base + len - 1 and is compacted when the evicted prefix exceeds the budget, so its
    size stays below 2 * max_tokens + the longest response."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.buf = np.empty(0, np.int32)
        self.size = 0  # valid entries in buf
        self.base = 0  # absolute position of buf[0]
        self.start = 0  # absolute position of the oldest live token
        self.index: dict[tuple[int, int], list[int]] = {}  # (a, b) -> absolute positions of b (after a)
        self.responses: deque[tuple[int, int]] = deque()  # (absolute start, length incl. SEP)
        self.tokens = 0  # live tokens (SEPs excluded)
        self.added = 0  # responses ever added

    def add(self, tokens: Sequence[int]) -> None:
        """Append one finished response (accepted tokens only)."""
        if self.max_tokens == 0 or len(tokens) < 2:
            return
        tokens = list(tokens)[-self.max_tokens :]
        n = len(tokens) + 1
        if self.size + n > self.buf.size:
            grown = np.empty(max(2 * self.buf.size, self.size + n, 1024), np.int32)
            grown[: self.size] = self.buf[: self.size]
            self.buf = grown
        first = self.base + self.size
        self.buf[self.size : self.size + n - 1] = tokens
        self.buf[self.size + n - 1] = SEP
        self.size += n
        for i in range(1, len(tokens)):
            self.index.setdefault((tokens[i - 1], tokens[i]), []).append(first + i)
        self.responses.append((first, n))
        self.tokens += n - 1
        self.added += 1
        while self.tokens > self.max_tokens:
            start, length = self.responses.popleft()
            self.tokens -= length - 1
            self.start = start + length
        if self.start - self.base > self.max_tokens:
            self._compact()

    def _compact(self) -> None:
        """Drop the evicted prefix from the buffer and the index."""
        cut = self.start - self.base
        self.buf = self.buf[cut : self.size].copy()
        self.size -= cut
        self.base = self.start
        index = {}
        for key, positions in self.index.items():
            live = [p for p in positions if p >= self.start]
            if live:
                index[key] = live
        self.index = index

    def memory_bytes(self) -> int:
        """Bytes held: the token buffer and the index (list slots, keys, small-int objects)."""
        entries = sum(len(v) for v in self.index.values())
        return int(self.buf.nbytes + entries * 8 + len(self.index) * (64 + 56 + 72))

    def propose(self, context: Sequence[int], config: SuffixConfig, room: int) -> tuple[list[int], float, int]:
        if len(context) < 2 or not self.index:
            return [], 0.0, 0
        positions = self.index.get((int(context[-2]), int(context[-1])))
        if not positions:
            return [], 0.0, 0
        ends = np.asarray(positions[-MAX_CANDIDATES:], np.int64)
        ends = ends[ends >= self.start] - self.base  # buffer positions of live occurrences
        seq = self.buf[: self.size]
        # the bigram matched: extend from m = 2 (longest_match re-checks one token: cheap)
        m, ends = longest_match(seq, ends, list(context[-config.max_depth :]), config.max_depth)
        tokens, score = draft_chain(seq, ends, self.size, min(config.limit(m), room), config.min_prob)
        return tokens, score, m

    def describe(self) -> dict:
        return {"responses": len(self.responses), "tokens": self.tokens, "max_tokens": self.max_tokens,
                "responses_added": self.added, "memory_bytes": self.memory_bytes()}


@dataclass
class SourceCalibration:
    """How far each source's score (its expected accepted tokens) is borne out: accepted / scored
    tokens per source, starting from a prior of PRIOR tokens at ratio 1 and halving both sums past
    HORIZON scored tokens, so the factor follows the recent rounds. Shared by the generator's
    requests on purpose (like the gamma controller's learned acceptance): a corpus whose matches
    the target keeps rejecting is trusted less from then on."""

    PRIOR = 8.0
    HORIZON = 2000.0
    scored: dict[str, float] = field(default_factory=dict)
    accepted: dict[str, float] = field(default_factory=dict)

    def factor(self, source: str) -> float:
        return (self.accepted.get(source, 0.0) + self.PRIOR) / (self.scored.get(source, 0.0) + self.PRIOR)

    def record(self, source: str, score: float, accepted: int) -> None:
        scored = self.scored.get(source, 0.0) + score
        got = self.accepted.get(source, 0.0) + accepted
        if scored > self.HORIZON:
            scored, got = scored / 2, got / 2
        self.scored[source], self.accepted[source] = scored, got


@dataclass
class LimitTuner:
    """Which draft limit pays on this target. SuffixDecoding's limit min(max_spec, factor x match)
    was set for GPUs, where a verify call costs about the same for 2 rows or 30; on a CPU each row
    costs a share of a decode step that depends on the target (about 5% for an fp32 135M model,
    19% for its int4 build: docs/proposers.md), and so does the best limit. The configured limit
    is scaled by one of the config's limit_scales, chosen from paired what-ifs:

    - a probe round drafts at the largest scale (the first WARMUP rounds, then every
      PROBE_EVERY-th, or every 4 x PROBE_EVERY-th while the largest scale's replays are more
      than 5% slower than the best's): k tokens along one chain, n of them accepted, so n + 1
      emitted;
    - each scale replays that stretch (`replay`): it drafts what its own limit allows of the same
      chain, emits what the target accepted of it plus one token, and goes on from there with
      the match grown by what it emitted, until it has the same n + 1 tokens; its cost is its
      calls and rows;
    - every verified round adds (rows, seconds from its verified draft to the next commit: the
      verify call and its host work) to a least-squares line seconds = a + b x rows;
    - other rounds draft at the scale with the least a x calls + b x rows over the probes.

    Every scale is judged on the same stretches of text, so the comparison needs far fewer rounds
    than timing each scale on rounds of its own, and a short limit is credited with the rounds
    that continue a fully accepted draft (judging it on the probe round alone would favour long
    drafts). Sums halve past HORIZON probes (the line: rounds). Shared by the generator's
    requests (like SourceCalibration). The choice never changes an output, only its speed:
    drafts are verified."""

    WARMUP = 16
    PROBE_EVERY = 8
    HORIZON = 1000.0
    calls: dict[float, float] = field(default_factory=dict)  # scale -> target calls its replays took (shares of one)
    rows: dict[float, float] = field(default_factory=dict)  # scale -> rows its replays verified
    tokens: float = 0.0  # tokens emitted by the probes (the same for every scale)
    probes: float = 0.0
    fit: list[float] = field(default_factory=lambda: [0.0] * 5)  # n, sum rows, sum rows^2, sum s, sum rows * s
    _asked: int = 0

    def choose(self, scales: tuple[float, ...]) -> float:
        if len(scales) == 1:
            return scales[0]
        self._asked += 1
        top = max(scales)
        if self.probes < self.WARMUP:
            return top
        costs = self.costs(scales)  # one fit per round
        best = self._cheapest(scales, costs)
        # probes cost where the largest scale is slow: then a quarter as often
        slow = costs is not None and costs[top] > 1.05 * costs[best]
        return top if self._asked % (4 * self.PROBE_EVERY if slow else self.PROBE_EVERY) == 0 else best

    def line(self) -> tuple[float, float] | None:
        """(a, b) of seconds = a + b x rows (slope >= 0, intercept > 0); None until two call sizes are timed."""
        n, sx, sxx, sy, sxy = self.fit
        var = sxx - sx * sx / n if n else 0.0
        if var <= 1e-9 * max(n, 1.0):
            return None
        b = max(0.0, (sxy - sx * sy / n) / var)
        return max((sy - b * sx) / n, 1e-6), b

    def costs(self, scales, line: tuple[float, float] | None = None) -> dict[float, float] | None:
        """scale -> seconds its replays took by the fitted line (or `line`); None until it is fitted."""
        a, b = line or self.line() or (None, None)
        if a is None:
            return None
        return {x: a * self.calls.get(x, 0.0) + b * self.rows.get(x, 0.0) for x in scales}

    def best(self, scales: tuple[float, ...]) -> float:
        """The scale whose replays took the least time (ties: the larger); the smallest while only
        one call size is timed (its round times another size, which the line needs)."""
        return self._cheapest(scales, self.costs(scales))

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

    def record(self, scale: float, drafted: int, accepted: int, seconds: float, match: int,
               configs: dict[float, SuffixConfig]) -> None:
        """A verified round: `drafted` tokens at `scale` after a match of `match` tokens,
        `accepted` of them, `seconds` of verify. configs: scale -> its SuffixConfig. A probe
        round (drafted at the largest scale) is replayed for every scale; others only time."""
        rows = drafted + 1
        for i, v in enumerate((1.0, rows, rows * rows, seconds, rows * seconds)):
            self.fit[i] += v
        if self.fit[0] > self.HORIZON:
            self.fit = [v / 2 for v in self.fit]
        if scale != max(configs):
            return
        open_end = accepted == drafted == configs[scale].limit(match)
        for x, config in configs.items():
            calls, rows = self.replay(lambda m, c=config: c.limit(min(m, c.max_depth)), match, drafted, accepted, open_end)
            self.calls[x] = self.calls.get(x, 0.0) + calls
            self.rows[x] = self.rows.get(x, 0.0) + rows
        self.tokens += accepted + 1
        self.probes += 1
        if self.probes > self.HORIZON:
            self.probes, self.tokens = self.probes / 2, self.tokens / 2
            for sums in (self.calls, self.rows):
                for x in sums:
                    sums[x] /= 2

    def describe(self) -> dict:
        line = self.line()
        a, b = line or (math.nan, math.nan)
        costs = self.costs(sorted(self.calls), line or (1.0, 0.0))  # no line yet: calls alone
        return {"probes": round(self.probes), "seconds_per_call": round(a, 6), "seconds_per_row": round(b, 6),
                "tokens_per_second": {str(x): round(self.tokens / max(c, 1e-12), 1) for x, c in costs.items()}}


class SuffixProposer(Proposer):
    """Suffix speculation over the request so far and the store of past responses: each round
    both are matched and the proposal with the higher score is used. Proposals cost no model
    call, so they are made up to the proposer's own limit even when the gamma controller has
    speculation off (like prompt lookup in `hybrid`). That limit is the config's, scaled each
    round by the tuner's choice among config.limit_scales (LimitTuner); the tuner, like the
    score calibration, is the generator's and learns across requests."""

    name = "suffix"
    proposes_when_off = True

    def __init__(self, store: SuffixStore | None, config: SuffixConfig, max_context: int, datastore=None,
                 calibration: SourceCalibration | None = None, tuner: LimitTuner | None = None):
        """datastore: a datastore.Datastore (the artifact's corpus) or None."""
        self.store, self.config, self.max_context, self.datastore = store, config, max_context, datastore
        self.calibration = calibration if calibration is not None else SourceCalibration()
        self.tuner = tuner if tuner is not None else LimitTuner()
        self._scaled = {x: config.scaled(x) for x in config.limit_scales}
        self.request = RequestSuffix()
        self.prompt_length = 0
        self._last: tuple | None = None  # (source, raw score, tokens, scale, match length) of the last retrieve
        self._tokens: list[int] = []  # the last retrieve's draft
        self._pending: tuple | None = None  # the same, once its draft is verified
        self._verify_start = 0.0

    def start(self, prompt: Sequence[int]) -> None:
        self.request.reset(prompt)
        self.prompt_length = len(prompt)

    def retrieve(self, committed: Sequence[int]) -> tuple[list[int], float, str]:
        """(tokens, score, source) of the best source, 'request', 'store' or 'datastore' (ties: in
        that order); the score is the source's own times its calibration factor."""
        room = max(0, self.max_context - len(committed))  # rows left after feeding `last`
        tail = committed[-self.config.max_depth :]
        scale = self.tuner.choose(self.config.limit_scales)
        config = self._scaled[scale]
        best: tuple[list[int], float, str, float, int] = ([], 0.0, "request", 0.0, 0)  # (tokens, score, source, raw, m)
        for name, source in (("request", self.request), ("store", self.store), ("datastore", self.datastore)):
            if source is None:
                continue
            tokens, raw, m = source.propose(config, room) if name == "request" else source.propose(tail, config, room)
            score = raw * self.calibration.factor(name)
            if tokens and score > best[1]:
                best = (tokens, score, name, raw, m)
        self._last, self._tokens = (best[2], best[3], len(best[0]), scale, best[4]), best[0]
        return best[0], best[1], best[2]

    def use_last(self) -> Proposal:
        """The last retrieved draft is verified this round: its acceptance updates the calibration,
        and the time until commit (the verify call) the limit tuner. Deterministic: q one-hot; no
        evidence on a draft model's acceptance or cost (lookup=True)."""
        self._pending = self._last
        self._verify_start = time.perf_counter()
        return Proposal(self._tokens, None, lookup=True, source=f"suffix-{self._pending[0]}")

    def offer(self, committed) -> Proposal | None:
        """The best source's draft when its score reaches config.hybrid_min_score, else None."""
        tokens, score, _ = self.retrieve(committed)
        return self.use_last() if tokens and score >= self.config.hybrid_min_score else None

    def propose(self, committed, gamma, params, rng) -> Proposal:
        self.retrieve(committed)
        return self.use_last()

    def commit(self, committed, n_new) -> None:
        if self._pending is not None and self._pending[2] > 0:  # a verified suffix draft: n_new - 1 accepted
            source, raw, k, scale, match = self._pending
            self.calibration.record(source, raw, min(n_new - 1, k))
            self.tuner.record(scale, k, min(n_new - 1, k), time.perf_counter() - self._verify_start, match, self._scaled)
        self._pending = None
        self.request.extend(committed[len(committed) - n_new :])

    def finish(self, output: Sequence[int]) -> None:
        """A request ended normally: its accepted output joins the store (never rejected drafts)."""
        if self.store is not None:
            self.store.add(output)


@dataclass
class SuffixHistory:
    """What the suffix proposer learns across a generator's requests (registry: `learns`): the
    store of past answers, the per-source score calibration and the draft-limit tuner."""

    store: SuffixStore
    calibration: SourceCalibration = field(default_factory=SourceCalibration)
    tuner: LimitTuner = field(default_factory=LimitTuner)

    @classmethod
    def create(cls, config) -> SuffixHistory:
        """An empty history sized by a GeneratorConfig's suffix.global_tokens."""
        return cls(SuffixStore(config.suffix.global_tokens))

    def forget(self) -> None:
        """Empty the store of past answers (calibration and tuner describe the target: kept)."""
        self.store = SuffixStore(self.store.max_tokens)


def build_suffix(ctx: ProposerContext) -> SuffixProposer:
    history = ctx.learned("suffix")
    return SuffixProposer(history.store, ctx.config.suffix, ctx.manifest.max_context, ctx.datastore(),
                          history.calibration, history.tuner)


__all__ = ["MAX_CANDIDATES", "SEP", "LimitTuner", "RequestSuffix", "SourceCalibration", "SuffixConfig", "SuffixHistory",
           "SuffixProposer", "SuffixStore", "build_suffix", "draft_chain", "longest_match"]
