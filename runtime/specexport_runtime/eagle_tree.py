"""EAGLE-3 draft trees (EAGLE-2's dynamic trees) from the head's tree graph (feature eagle3_head_tree).

A round starts like the chain proposer's (eagle.py): the catch-up call gives the logits and
hidden_out of the head's last real row, whose top-k tokens are the root's children (depth 1).
Then per depth one HeadTree call expands the best W frontier nodes by cumulative draft
probability q (the product of the draft's probabilities along the path): each row is a node's
token with its parent's hidden_out as draft_hidden (a depth-1 node: the catch-up row's), at
position base + depth - 1 (the head row a chain decoding of that path would use), attending to
the head's past and to its own ancestors among this round's rows. Each expanded node's top-k
tokens become candidates. Finally the best N candidates by q are kept (keep_best: ancestor
closed, topological), N priced by the target's verify-cost line as suffix trees are
(suffix_index.draft_tree): a node joins while q > b (1 + score) / (a + b R).

Siblings are a node's top-k draft tokens, distinct and deterministic given the committed
tokens, so tree.verify_tree_sampled's deterministic-sibling rule keeps sampling exact. The
head's rows of the round lie past `real` and are dropped after it (EagleProposer.commit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from . import contract
from .drafts import Proposal
from .engine import OrtModel, SessionConfig, check_contract, make_session
from .errors import InvalidArgument
from .model import CallStats
from .tree import tree_parents_or_none

TOP_K = 8  # children per expanded node (EAGLE-2 uses 10 on 32k+ vocabularies)
WIDTH = 8  # frontier nodes expanded per depth (one head call of at most WIDTH rows)


class HeadTree:
    """The head entry's tree graph (feature eagle3_head_tree) on the cache of the head's OrtModel."""

    def __init__(self, path: Path, head: OrtModel, config: SessionConfig):
        spec = head.spec
        if not spec.is_head or not head.layout.in_place or head.device != "cpu":
            raise InvalidArgument(
                f"a head tree graph shares the cache of a head_major_inplace EAGLE-3 head on the CPU;"
                f" got kind {spec.kind}, layout {spec.kv_layout}, device {head.device}"
            )
        self.head, self.spec = head, replace(spec, tree=True)
        self.session = make_session(path, config)
        check_contract(self.session, self.spec, str(path))
        self._io = self.session.io_binding()
        head.bind_cache(self._io)
        self._seqlens = np.zeros(1, np.int32)  # [1] = P + S - 1
        self._total = np.zeros((), np.int32)  # [] = P + S
        self._zeros = np.zeros((head.max_rows, spec.feature_width), np.float32)  # the unused features side
        self._logits = np.zeros((1, head.max_rows, spec.embedding_rows), np.float32)
        self._hidden = np.zeros((1, head.max_rows, spec.hidden_width), np.float32)
        # the bias's "hidden" value, finite in the cache's dtype (the graph casts the bias to it)
        self.lowest = float(np.finfo(np.float16 if spec.kv_dtype == "float16" else np.float32).min)
        self.stats = CallStats()

    def forward(
        self, tokens: np.ndarray, hidden: np.ndarray, positions: np.ndarray, bias: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Feed S rows at the head's cursor P: tokens int64 [S] (draft-row tokens as target ids),
        hidden float32 [S, H] (draft_hidden), positions int64 [S], bias float32 [S, M] (M <= P + S,
        over the last M cache rows). Returns views (logits [S, V_draft], hidden_out [S, H]) that
        the next call overwrites; the cursor then stands at P + S."""
        m, S = self.head, len(tokens)
        P = m.length
        if not 1 <= S <= m.max_rows or P + S > m.max_context or not S <= bias.shape[1] <= P + S:
            raise InvalidArgument(
                f"a head tree call of {S} rows (bias {bias.shape}) at {P}: rows 1..{m.max_rows}, within"
                f" max_context {m.max_context}, bias over S..P + S rows"
            )
        io = self._io
        self._seqlens[0], self._total[()] = P + S - 1, P + S
        io.bind_cpu_input(contract.INPUT_IDS, np.ascontiguousarray(tokens, np.int64).reshape(1, S))
        io.bind_cpu_input(contract.HEAD_FEATURES, self._zeros[:S].reshape(1, S, -1))
        io.bind_cpu_input(contract.HEAD_HIDDEN, np.ascontiguousarray(hidden, np.float32).reshape(1, S, -1))
        io.bind_cpu_input(contract.LOGITS_INDEX, np.arange(S, dtype=np.int64))
        io.bind_cpu_input(contract.SEQLENS_K, self._seqlens)
        io.bind_cpu_input(contract.TOTAL_SEQUENCE_LENGTH, self._total)
        io.bind_cpu_input(contract.POSITION_IDS, np.ascontiguousarray(positions, np.int64).reshape(1, S))
        io.bind_cpu_input(contract.TREE_BIAS, np.ascontiguousarray(bias, np.float32))
        V, H = self.spec.embedding_rows, self.spec.hidden_width
        io.bind_output(contract.LOGITS, "cpu", 0, np.float32, [1, S, V], self._logits.ctypes.data)
        io.bind_output(contract.HEAD_HIDDEN_OUT, "cpu", 0, np.float32, [1, S, H], self._hidden.ctypes.data)
        start = time.perf_counter()
        self.session.run_with_iobinding(io)
        self.stats.add(S, time.perf_counter() - start)
        m.length = P + S
        return self._logits[0, :S], self._hidden[0, :S]


# --- the pure parts: children, pricing, the kept set ---------------------------------------


def top_children(probs: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(draft ids [<= k], their probabilities) of one row's k most probable tokens with p > 0,
    most probable first (ties: the smaller id; the draft's argmax order)."""
    if k < probs.size:  # O(V): the k-th largest value, then every id reaching it (ties kept, ids ascending)
        ids = np.flatnonzero(probs >= np.partition(probs, probs.size - k)[probs.size - k])
    else:
        ids = np.arange(probs.size)
    order = ids[np.argsort(-probs[ids], kind="stable")[:k]]
    order = order[probs[order] > 0]
    return order, probs[order]


def priced_count(qs, line: tuple[float, float] | None, nodes: int) -> int:
    """How many of the nodes with path probabilities `qs` (non-increasing) join a tree of at
    most `nodes`: the i-th (i from 0, a tree of R = i + 1 rows with the root) joins while it
    raises the round's expected tokens per second under the verify cost a + b rows,
    q > b (1 + score) / (a + b R), score the sum of the q's before it. No line: all of them."""
    a, b = line if line is not None else (1.0, 0.0)
    score, n = 0.0, 0
    for q in qs:
        if n >= nodes or (b > 0 and q * (a + b * (n + 1)) <= b * (1 + score)):
            break
        score += q
        n += 1
    return n


def calibration_factor(
    predicted: float, accepted: float, prior: float = 4.0, lo: float = 0.1, hi: float = 2.0
) -> float:
    """How much the head's path probabilities over- or underestimate acceptance: the accepted
    draft tokens over the predicted ones (the sum of the kept nodes' q, each a node's chance to be
    on the accepted path) of the rounds so far, each side starting at `prior` tokens (factor 1
    before any evidence), clipped to [lo, hi]."""
    return min(hi, max(lo, (accepted + prior) / (predicted + prior)))


def calibrated(q: np.ndarray, factor: float) -> np.ndarray:
    """Path probabilities scaled by the measured factor, at most 1 (the estimate that prices a
    node: the order of the nodes is unchanged)."""
    return np.minimum(1.0, q * factor)


def keep_best(q: np.ndarray, parents: np.ndarray, depth: np.ndarray, n: int) -> list[int]:
    """Candidate indices of the best n by path probability q [C], ancestor closed, in
    topological order (depth, then index). parents [C]: a candidate's parent index, -1 the
    root; depth [C]. Order (-q, depth, index): a parent (q >= its child's, smaller depth) always
    comes before its child, so the best n are closed; a candidate whose parent is not kept is
    skipped all the same (never on path probabilities)."""
    kept: set[int] = set()
    for i in sorted(range(len(q)), key=lambda i: (-q[i], depth[i], i)):
        if len(kept) >= n:
            break
        if parents[i] < 0 or parents[i] in kept:
            kept.add(i)
    return sorted(kept, key=lambda i: (depth[i], i))


@dataclass
class Candidates:
    """The round's candidate nodes, grown per depth (index order = creation order)."""

    draft: list[int]  # draft-vocabulary id of each
    q: list[float]  # path probability
    parent: list[int]  # candidate index of its parent, -1 the root
    depth: list[int]  # 1 for the root's children
    row: list[int]  # its head row in the round once expanded (else -1)

    def add(self, ids: np.ndarray, probs: np.ndarray, parent: int, q_parent: float, depth: int) -> None:
        for i, p in zip(ids.tolist(), probs.tolist()):
            self.draft.append(int(i))
            self.q.append(q_parent * float(p))
            self.parent.append(parent)
            self.depth.append(depth)
            self.row.append(-1)

    def ancestors(self, i: int) -> list[int]:
        """Candidate indices from i's parent up to the root's child (i excluded)."""
        out, j = [], self.parent[i]
        while j >= 0:
            out.append(j)
            j = self.parent[j]
        return out


def frontier(c: Candidates, depth: int, width: int, limit: int) -> list[int]:
    """The best `width` candidates at `depth` by q (ties: the earlier) that fewer than `limit`
    candidates beat. grow's limit: min(nodes - 1, the priced count now). A child's q never
    exceeds its parent's and it comes after it, so a node ranked nodes - 1 or lower has no
    child among the best `nodes`; and a node past the priced count fails the pricing test now,
    where more candidates only make its test (and its children's) harder."""
    at = sorted((i for i in range(len(c.q)) if c.depth[i] == depth), key=lambda i: (-c.q[i], i))[:width]
    qs = np.asarray(c.q)
    return [i for i in at if int((qs > c.q[i]).sum()) < limit]


def tree_parents(c: Candidates, kept: list[int]) -> list[int]:
    """Proposal parents of the kept candidates (topological): 0 the root, j + 1 kept[j]."""
    row = {i: j + 1 for j, i in enumerate(kept)}
    return [0 if c.parent[i] < 0 else row[c.parent[i]] for i in kept]


def grow(
    tree: HeadTree,
    first: np.ndarray,
    first_hidden: np.ndarray,
    base: int,
    probs,
    d2t: np.ndarray,
    nodes: int,
    depth: int,
    line: tuple[float, float] | None,
    factor: float = 1.0,
) -> tuple[Candidates, list[int]]:
    """(candidates, kept) of one round: first [V_draft] the catch-up row's logits and
    first_hidden [H] its hidden_out; base the head's cursor after the catch-up (a depth-d
    node's row sits at position base + d - 1); probs: logits [R, V_draft] -> probabilities
    [R, V_draft]; d2t [V_draft] the target id of each draft row (the head embeds target ids);
    nodes, depth: the tree's budget; line: the target's verify cost (a, b); factor: the
    measured calibration of q (calibration_factor) for the pricing."""
    c = Candidates([], [], [], [], [])
    ids, p = top_children(probs(first[None])[0], TOP_K)
    c.add(ids, p, -1, 1.0, 1)
    hidden_of: dict[int, np.ndarray] = {}  # an expanded candidate's hidden_out [H]
    rows = 0  # head rows of this round so far
    for d in range(1, depth):  # expand the depth-d frontier: children at depth d + 1
        priced = priced_count(calibrated(np.sort(np.asarray(c.q))[::-1], factor), line, nodes)
        front = frontier(c, d, WIDTH, min(nodes - 1, priced))
        S = len(front)
        if S == 0 or tree.head.free < S or S > tree.head.max_rows:
            break
        bias = np.full((S, rows + S), tree.lowest, np.float32)  # [S, M]: over this round's rows
        for s, i in enumerate(front):
            c.row[i] = rows + s
            bias[s, [rows + s, *(c.row[a] for a in c.ancestors(i))]] = 0.0
        hidden = np.stack([first_hidden if c.parent[i] < 0 else hidden_of[c.parent[i]] for i in front])  # [S, H]
        tokens = d2t[[c.draft[i] for i in front]]  # [S] target ids
        logits, out = tree.forward(tokens, hidden, np.full(S, base + d - 1, np.int64), bias)
        p_rows = probs(logits)  # [S, V_draft]
        for s, i in enumerate(front):
            hidden_of[i] = out[s].copy()
            ids, p = top_children(p_rows[s], TOP_K)
            c.add(ids, p, i, c.q[i], d + 1)
        rows += S
    q = np.asarray(c.q)
    order = sorted(range(len(q)), key=lambda i: (-q[i], c.depth[i], i))
    n = max(1, priced_count(calibrated(q[order], factor), line, nodes))
    return c, keep_best(q, np.asarray(c.parent), np.asarray(c.depth), n)


class TreeRounds:
    """One proposer's tree rounds (EAGLE-3 and MTP heads, the Gemma 4 assistant): grow's tree from
    the head tree graph, scaled by calibration_factor over the rounds so far, and their record."""

    def __init__(self, tree: HeadTree, nodes: int, cost=None):
        """nodes: most tokens a tree holds; cost: the target's costs.VerifyCost pricing its rows."""
        self.tree, self.nodes, self.cost = tree, nodes, cost
        self.predicted = self.accepted = 0.0  # sum of the kept q, accepted drafts
        self._pending: float | None = None  # the last tree's predicted accepted tokens, until committed

    def draft(self, first, hidden, base: int, probs, d2t: np.ndarray, depth: int, source: str) -> Proposal:
        """A draft tree after the first row's logits [V_draft] and hidden row: deterministic top-k
        siblings (q None), as a chain when it has no branch; tokens mapped by d2t."""
        line = self.cost.line() if self.cost is not None else None
        factor = calibration_factor(self.predicted, self.accepted)
        c, kept = grow(self.tree, first, hidden, base, probs, d2t, self.nodes, depth, line, factor)
        self._pending = float(sum(c.q[i] for i in kept))
        tokens = [int(d2t[c.draft[i]]) for i in kept]
        return Proposal(tokens, None, source=source, parents=tree_parents_or_none(tree_parents(c, kept)))

    def committed(self, n_new: int) -> None:
        """The loop committed n_new tokens: after a tree round, n_new - 1 of its drafts were accepted."""
        if self._pending is not None:
            self.predicted, self.accepted = self.predicted + self._pending, self.accepted + n_new - 1
            self._pending = None
