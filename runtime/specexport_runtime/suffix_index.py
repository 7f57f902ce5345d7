"""Suffix matching over token sequences, the data side of suffix speculation (suffix.py is the
policy): the occurrence positions of what was said before, matched against the recent tokens
and followed along the most frequent continuation.

    match   the longest suffix s = context[-m:] (m <= max_depth) that occurred earlier: the set C
            of positions where an occurrence of s ends, found by extending the occurrences of
            context[-1] backwards one token at a time while any remain (`longest_match`)
    draft   along the suffix-tree path below s: the next token is the most frequent seq[c + 1]
            over c in C (= the child with the largest count); its probability count / |C|
            multiplies into the path probability; C becomes the occurrences that continued with
            it. Stop when the path probability falls below `min_prob` or after the draft limit
            (`draft_chain`)
    score   the sum of the path probabilities of the drafted tokens (the expected number of
            accepted tokens if each were accepted with its path probability)

A suffix tree answers the same questions; the positions themselves cost a few bytes per token
instead of tree nodes per token. Sources, each with `propose(context, config, room) -> (tokens,
score, match length)`:
  RequestSuffix   prompt + accepted tokens of the current request (discarded at its end)
  SuffixStore     previous responses (accepted text only), separated by SEP, bounded by a token
                  budget with FIFO eviction of whole responses. Occurrence lists are indexed by
                  the last two tokens.
  Datastore       (datastore.py) the artifact's static corpus, memory-mapped, when it has one
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .tree import tree_parents_or_none

if TYPE_CHECKING:
    from .drafts import SuffixConfig

SEP = -1  # between responses in a SuffixStore: no match or draft crosses it
MAX_CANDIDATES = 512  # most recent occurrences considered per match (bounds the cost per round)


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


class Occurrences(NamedTuple):
    """Where the longest match of the recent tokens ended in a source: seq[c] for c in ends is its
    last token (positions < stop readable), after m tokens of context matched."""

    m: int
    seq: np.ndarray  # int32 [N], SEP between responses
    ends: np.ndarray  # int64 [C]
    stop: int


def draft(
    occ: Occurrences | None,
    config: SuffixConfig,
    room: int,
    tree_nodes: int = 0,
    line: tuple[float, float] | None = None,
    factor: float = 1.0,
) -> Draft:
    """A source's draft after its occurrences: a chain (draft_chain) of at most the configured
    limit for the match (and `room`), or with tree_nodes > 0 a tree (draft_tree) of at most that
    many tokens (at least its first path's) whose paths are at most that limit deep, its
    branches priced by the target's verify-cost line (a, b) when given, with the source's
    calibration `factor`. A tree without a branch is returned as a chain (parents None)."""
    if occ is None or occ.m == 0:
        return Draft([], 0.0, 0, None)
    limit = min(config.limit(occ.m), room)
    if tree_nodes:
        tokens, parents, score = draft_tree(
            occ.seq, occ.ends, occ.stop, tree_nodes, limit, config.min_prob, line, factor
        )
        return Draft(tokens, score, occ.m, tree_parents_or_none(parents))
    tokens, score = draft_chain(occ.seq, occ.ends, occ.stop, limit, config.min_prob)
    return Draft(tokens, score, occ.m, None)


class Draft(NamedTuple):
    tokens: list[int]
    score: float  # the sum of the drafted tokens' path probabilities
    match: int  # tokens of context matched
    parents: tuple[int, ...] | None  # a tree's: token i's parent row (0 the root, j + 1 token j); None: a chain


TREE_BRANCHES = 4  # most children a tree node gets (its most frequent continuations)


def draft_tree(
    seq: np.ndarray,
    ends: np.ndarray,
    stop: int,
    nodes: int,
    depth: int,
    min_prob: float,
    line: tuple[float, float] | None = None,
    factor: float = 1.0,
) -> tuple[list[int], list[int], float]:
    """(tokens, parents, score): the suffix tree below the occurrences `ends` (SuffixDecoding's
    tree mode): each node's children are its TREE_BRANCHES most frequent continuations, a
    child's path probability q is its parent's times its count over the parent's occurrences,
    and only children with q >= min_prob count; no path is deeper than `depth`. parents[i]: the
    tree row of token i's parent (0 the root, j + 1 for token j), so tokens come in topological
    order; the score is the sum of the path probabilities (the expected accepted tokens if each
    is accepted with its own).

    The tree holds the chain a chain draft would verify first: the most frequent child at each
    depth (the first path), unpriced, so a tree never drafts less than its chain. Branches then
    join best first (the most probable open node next) up to `nodes` tokens in all (at least
    the first path's), each only while it raises the round's expected tokens per second under
    the target's verify cost `line` (seconds = a + b rows): for a tree of R rows so far,
    (1 + score + q) / (a + b (R + 1)) > (1 + score) / (a + b R), i.e. q > b (1 + score) / (a + b R),
    with q and score scaled by `factor` (how far the source's scores have been borne out,
    at most 1 per node). Where rows are dear the tree is its chain."""
    tokens: list[int] = []
    parents: list[int] = []
    score = priced = 0.0  # the sum of the path probabilities: raw, and calibrated (the pricing's)
    heap: list[tuple[float, int, int, int, np.ndarray]] = []  # (-p, order, parent row, depth, occurrences)
    order = 0

    def children(occ: np.ndarray, p: float, level: int) -> list[tuple[float, np.ndarray]]:
        """(q, occurrences) of a node's children, most frequent first (ties: the smaller id)."""
        if level >= depth or occ.size == 0:
            return []
        nxt, values = _continuations(seq, occ, stop)
        if values.size == 0:
            return []
        ids, counts = np.unique(values, return_counts=True)
        top = np.argsort(-counts, kind="stable")[:TREE_BRANCHES]
        out = [(p * int(counts[k]) / occ.size, k) for k in top]
        return [(q, nxt[values == ids[k]]) for q, k in out if q >= min_prob]

    def add(q: float, occ: np.ndarray, parent: int) -> None:
        nonlocal score, priced
        tokens.append(int(seq[occ[0]]))
        parents.append(parent)
        score, priced = score + q, priced + min(1.0, q * factor)

    def push(kids: list[tuple[float, np.ndarray]], row: int, level: int) -> None:
        nonlocal order
        for q, occ in kids:
            heapq.heappush(heap, (-q, order, row, level + 1, occ))
            order += 1

    kids, level = children(ends, 1.0, 0), 0
    while kids:  # the first path: each node's most frequent child, then its siblings wait in the heap
        q, occ = kids[0]
        add(q, occ, len(tokens))
        push(kids[1:], len(tokens) - 1, level)
        kids, level = children(occ, q, level + 1), level + 1
    a, b = line if line is not None else (1.0, 0.0)
    nodes = max(nodes, len(tokens))
    while heap and len(tokens) < nodes:
        q = min(1.0, -heap[0][0] * factor)
        if b > 0 and q * (a + b * (len(tokens) + 1)) <= b * (1 + priced):
            break  # the next node would lower the round's expected rate (docstring)
        neg, _, parent, level, occ = heapq.heappop(heap)
        add(-neg, occ, parent)
        push(children(occ, -neg, level), len(tokens), level)
    return tokens, parents, score


def draft_chain(
    seq: np.ndarray, ends: np.ndarray, stop: int, max_tokens: int, min_prob: float
) -> tuple[list[int], float]:
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
        nxt, values = _continuations(seq, ends, stop)
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


def _continuations(seq: np.ndarray, ends: np.ndarray, stop: int) -> tuple[np.ndarray, np.ndarray]:
    """(positions, tokens) that follow the occurrences `ends` within seq[:stop], SEP excluded."""
    nxt = ends + 1
    nxt = nxt[nxt < stop]
    values = seq[nxt]
    live = values != SEP
    return nxt[live], values[live]


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

    def occurrences(self, context: Sequence[int], config: SuffixConfig) -> Occurrences | None:
        """The request's last tokens' longest earlier match (its own sequence ends with `context`)."""
        L = self.length
        if L < 2:
            return None
        seq = self.seq[:L]
        ends = np.flatnonzero(seq[: L - 1] == seq[L - 1])[-MAX_CANDIDATES:]  # earlier occurrences of the last token
        context = seq[max(0, L - config.max_depth) :].tolist()
        m, ends = longest_match(seq, ends, context, config.max_depth)
        return Occurrences(m, seq, ends, L)

    def propose(self, context: Sequence[int], config: SuffixConfig, room: int) -> tuple[list[int], float, int]:
        """(tokens, score, match length): the chain draft after occurrences()."""
        return draft(self.occurrences(context, config), config, room)[:3]


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

    def occurrences(self, context: Sequence[int], config: SuffixConfig) -> Occurrences | None:
        if len(context) < 2 or not self.index:
            return None
        positions = self.index.get((int(context[-2]), int(context[-1])))
        if not positions:
            return None
        ends = np.asarray(positions[-MAX_CANDIDATES:], np.int64)
        ends = ends[ends >= self.start] - self.base  # buffer positions of live occurrences
        seq = self.buf[: self.size]
        # the bigram matched: extend from m = 2 (longest_match re-checks one token: cheap)
        m, ends = longest_match(seq, ends, list(context[-config.max_depth :]), config.max_depth)
        return Occurrences(m, seq, ends, self.size)

    def propose(self, context: Sequence[int], config: SuffixConfig, room: int) -> tuple[list[int], float, int]:
        return draft(self.occurrences(context, config), config, room)[:3]

    def describe(self) -> dict:
        return {
            "responses": len(self.responses),
            "tokens": self.tokens,
            "max_tokens": self.max_tokens,
            "responses_added": self.added,
            "memory_bytes": self.memory_bytes(),
        }
