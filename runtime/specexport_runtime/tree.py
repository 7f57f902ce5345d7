"""Draft trees and the exact acceptance math of tree speculation (pure numpy, no graph).

A draft tree holds R rows in topological order: row 0 is the root, the last committed token
(not a draft), every other row a drafted token whose parent row comes before it. The target
runs once over all R rows (each row attending to itself and its ancestors, at position
past + depth) and gives one distribution per row: the target's law of the token that follows
the path root..row. Verification walks from the root, accepting at most one child per node,
and emits the tokens of the accepted path plus one token from the target at its last node.

    tokens         [R]     int64, tokens[0] the root's token
    parents        [R]     int64, parents[0] = -1, 0 <= parents[i] < i for i > 0
    target_argmax  [R]     int, the target's argmax at each row (greedy)
    target_probs   [R, V]  float64, the target's sampling distribution at each row
                           (`sampling.probabilities`: temperature, top-k, top-p applied)
    draft_probs    [R, V]  float64, row i the draft distribution q that row i's token was
                           sampled from at its parent (row 0 unused)

Sampled acceptance visits a node's children in row order with a working distribution p'
(starting at the node's target row): a child x is accepted with probability
min(1, p'(x) / q(x)); a rejection replaces p' by the residual norm(max(0, p' - q)); when every
child is rejected (or the node has none) the bonus token is sampled from p'. This is SpecInfer's
multi-step speculative sampling (Miao et al. 2024), exact when the children of a node are
independent draws (siblings sampled with replacement, duplicates kept). For deterministic
siblings (top-k, as in EAGLE-2, SGLang and TensorRT-LLM) q is one-hot: a child is accepted with
probability p'(x) and a rejection zeroes p'(x) and renormalises (sampling without replacement).
Either way the emitted tokens are distributed exactly as tokens sampled one by one from the
target. On a chain both reduce to `sampling.verify_sampled`, uniform draw for uniform draw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import InvalidArgument
from .sampling import accept_probability, residual, residual_without, sample


def _int_vector(values, name: str) -> np.ndarray:
    """values -> read-only int64 [n] copy; InvalidArgument unless 1-D integers."""
    a = np.asarray(values)
    if a.ndim != 1:
        raise InvalidArgument(f"{name} must be a 1-D sequence of integers, got shape {a.shape}")
    if a.size and a.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must hold integers, got dtype {a.dtype}")
    out = a.astype(np.int64)  # a copy, so the caller's array can change without touching the tree
    out.setflags(write=False)
    return out


@dataclass(frozen=True, eq=False)
class DraftTree:
    """R rows in topological order; row 0 is the root (the last committed token).

    tokens [R] and parents [R] are stored as read-only int64 copies. Equality is identity
    (eq=False: numpy arrays have no single truth value).
    """

    tokens: np.ndarray  # [R] int64 >= 0
    parents: np.ndarray  # [R] int64, parents[0] = -1, 0 <= parents[i] < i

    def __post_init__(self) -> None:
        tokens = _int_vector(self.tokens, "tokens")
        parents = _int_vector(self.parents, "parents")
        R = tokens.size
        if R == 0:
            raise InvalidArgument("a draft tree needs at least its root row, got 0 tokens")
        if parents.size != R:
            raise InvalidArgument(f"parents must have one entry per row ({R} tokens), got {parents.size}")
        if parents[0] != -1:
            raise InvalidArgument(f"parents[0] must be -1 (row 0 is the root), got {int(parents[0])}")
        bad = (parents[1:] < 0) | (parents[1:] >= np.arange(1, R))
        if bad.any():
            i = int(bad.argmax()) + 1
            hint = " (only row 0 is a root)" if parents[i] == -1 else ""
            if parents[i] >= i:
                hint = " (rows are topological: a parent comes before its children)"
            raise InvalidArgument(f"parents[{i}] must be an earlier row in [0, {i}), got {int(parents[i])}{hint}")
        if tokens.min() < 0:
            i = int(tokens.argmin())
            raise InvalidArgument(f"tokens[{i}] must be a token id >= 0, got {int(tokens[i])}")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)

    @classmethod
    def chain(cls, tokens) -> DraftTree:
        """The degenerate tree of one speculative chain: tokens [gamma+1] = [root, d_1..d_gamma],
        parents [-1, 0, 1, ..., gamma-1]."""
        t = _int_vector(tokens, "tokens")
        return cls(t, np.arange(t.size, dtype=np.int64) - 1)

    def __len__(self) -> int:
        return int(self.tokens.size)

    def is_chain(self) -> bool:
        """Every row's parent is the row before it (one path, as `chain` builds)."""
        return bool(np.array_equal(self.parents, np.arange(len(self)) - 1))

    def _row(self, i) -> int:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < len(self):
            raise InvalidArgument(f"row must be an integer in [0, {len(self)}), got {i!r}")
        return int(i)

    def children(self, i: int) -> list[int]:
        """Rows whose parent is row i, in row order."""
        return np.flatnonzero(self.parents == self._row(i)).tolist()

    def child_lists(self) -> list[list[int]]:
        """children(i) for every row i at once: [R] lists, each in row order (O(R))."""
        out: list[list[int]] = [[] for _ in range(len(self))]
        for i, parent in enumerate(self.parents.tolist()[1:], start=1):
            out[parent].append(i)
        return out

    def depths(self) -> np.ndarray:
        """[R] int64: 0 at the root, depth(parent) + 1 elsewhere."""
        d = np.zeros(len(self), dtype=np.int64)
        for i, parent in enumerate(self.parents.tolist()[1:], start=1):
            d[i] = d[parent] + 1
        return d

    def position_offsets(self) -> np.ndarray:
        """[R] int64: row i sits at position past + depth(i), where past counts the committed
        tokens before the root (the root itself is at position past)."""
        return self.depths()

    def path_to(self, i: int) -> list[int]:
        """Rows from the root to row i, both included ([0] for the root)."""
        path = [self._row(i)]
        while path[-1] != 0:
            path.append(int(self.parents[path[-1]]))
        return path[::-1]

    def ancestors_mask(self) -> np.ndarray:
        """[R, R] bool: mask[i, j] iff j == i or j is an ancestor of i (row i may attend to j).

        Lower-triangular (parents come first); the diagonal and column 0 are all True."""
        R = len(self)
        m = np.zeros((R, R), dtype=bool)
        for i, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                m[i] = m[parent]  # the parent's row is final: parent < i
            m[i, i] = True
        return m

    def attention_bias(self, dtype=np.float32) -> np.ndarray:
        """[R, R] additive attention bias of `dtype` (floating): 0 where `ancestors_mask` allows,
        np.finfo(dtype).min elsewhere. finfo.min rather than -inf: a score plus the bias stays
        finite or becomes -inf, never NaN, and every row allows at least its own diagonal."""
        dt = np.dtype(dtype)
        if dt.kind != "f":
            raise InvalidArgument(f"attention_bias needs a floating dtype, got {dt}")
        return np.where(self.ancestors_mask(), dt.type(0), np.finfo(dt).min).astype(dt)


def tree_parents_or_none(parents: Sequence[int]) -> tuple[int, ...] | None:
    """A proposal's parents (0 the root, j + 1 token j) as Proposal.parents: None when each token
    is the child of the one before (a chain, verified by the chain graph)."""
    return None if list(parents) == list(range(len(parents))) else tuple(int(p) for p in parents)


def first_path(parents) -> list[int]:
    """The draft tokens (indices into a proposal's tokens) along the first child of each node
    from the root: a tree proposal as a chain. parents[i]: token i's parent row (0 the root,
    j + 1 token j)."""
    path: list[int] = []
    row = 0
    for i, parent in enumerate(parents):
        if parent == row:
            path.append(i)
            row = i + 1
    return path


# ------------------------------------------------------------------ acceptance at one node


def verify_siblings_deterministic(
    p: np.ndarray, child_tokens: Sequence[int], rng: np.random.Generator
) -> tuple[int | None, int]:
    """One node, deterministic children (q one-hot): children in order, x accepted with
    probability p'(x); a rejection sets p' = residual_without(p', x).

    p: [V] the node's target distribution; child_tokens: [k] (duplicates allowed: a repeated
    token has p'(x) = 0 once rejected). One uniform per examined child, one for the bonus.
    Returns (k_accepted, token): the position of the accepted child in child_tokens and its
    token, or (None, bonus) with the bonus sampled from p' after k rejections (p when k = 0).
    """
    work = p
    for k, x in enumerate(child_tokens):
        if rng.random() < accept_probability(work[x], 1.0):
            return k, int(x)
        work = residual_without(work, x)
    return None, sample(work, rng)


def verify_siblings_multidraft(
    p: np.ndarray, child_tokens: Sequence[int], child_q: Sequence[np.ndarray], rng: np.random.Generator
) -> tuple[int | None, int]:
    """One node, sampled children (SpecInfer's multi-step speculative sampling): children in
    order, x_k ~ q_k independently of the earlier siblings, accepted with probability
    min(1, p'(x_k) / q_k(x_k)); a rejection sets p' = residual(p', q_k).

    p: [V] the node's target distribution; child_tokens: [k]; child_q: [k] rows [V] (identical
    rows for i.i.d. siblings). Returns (k_accepted, token) or (None, bonus ~ p'), as
    `verify_siblings_deterministic`.
    """
    work = p
    for k, (x, q) in enumerate(zip(child_tokens, child_q)):
        if rng.random() < accept_probability(work[x], q[x]):
            return k, int(x)
        work = residual(work, q)
    return None, sample(work, rng)


# ------------------------------------------------------------------ acceptance on a tree


def _walk(tree: DraftTree, select: Callable[[int, list[int]], tuple[int | None, int]]) -> tuple[list[int], int]:
    """From the root, select(node, children rows) -> (k, token) moves to child k or, with
    k None, ends with `token` as the bonus. Returns (accepted rows, root excluded; bonus)."""
    kids = tree.child_lists()
    rows: list[int] = []
    node = 0
    while True:
        k, token = select(node, kids[node])
        if k is None:
            return rows, token
        node = kids[node][k]
        rows.append(node)


def _check_rows(tree: DraftTree, probs: np.ndarray, name: str) -> np.ndarray:
    """probs must be [R, V] with every drafted token (rows 1..R-1) in [0, V)."""
    probs = np.asarray(probs)
    R = len(tree)
    if probs.ndim != 2 or probs.shape[0] != R or probs.shape[1] == 0:
        raise InvalidArgument(f"{name} must have shape [R = {R}, V], got {probs.shape}")
    V = probs.shape[1]
    if R > 1 and tree.tokens[1:].max() >= V:
        i = int(tree.tokens[1:].argmax()) + 1
        raise InvalidArgument(f"tokens[{i}] = {int(tree.tokens[i])} is outside the vocabulary [0, {V}) of {name}")
    return probs


def verify_tree_greedy(tree: DraftTree, target_argmax) -> tuple[list[int], int]:
    """Greedy verification: from the root, follow the first child (row order) whose token is
    the target's argmax at the current node, while there is one.

    target_argmax: [R] int. Returns (accepted_rows, bonus_token): the rows of the accepted
    path (root excluded, root to leaf order) and the argmax at its last node (the root's when
    nothing is accepted). On a chain this is `sampling.verify_greedy` (n = len(accepted_rows)).
    """
    a = np.asarray(target_argmax).reshape(-1).tolist()  # [R]
    if len(a) != len(tree):
        raise InvalidArgument(f"target_argmax must have one entry per row (R = {len(tree)}), got {len(a)}")
    tokens = tree.tokens.tolist()

    def select(node: int, kids: list[int]) -> tuple[int | None, int]:
        want = int(a[node])
        for k, child in enumerate(kids):
            if tokens[child] == want:
                return k, want
        return None, want

    return _walk(tree, select)


def verify_tree_sampled(tree: DraftTree, target_probs: np.ndarray, rng: np.random.Generator) -> tuple[list[int], int]:
    """Exact sampled verification of a tree of deterministic drafts (top-k siblings: EAGLE-2,
    SGLang, TensorRT-LLM): `verify_siblings_deterministic` at each node of the path.

    target_probs: [R, V] float64. Returns (accepted_rows, bonus_token) as `verify_tree_greedy`;
    the bonus is sampled from the last node's residual p' (its target row when it is a leaf).
    """
    p = _check_rows(tree, target_probs, "target_probs")
    tokens = tree.tokens.tolist()

    def select(node: int, kids: list[int]) -> tuple[int | None, int]:
        return verify_siblings_deterministic(p[node], [tokens[c] for c in kids], rng)

    return _walk(tree, select)


def verify_tree_multidraft(
    tree: DraftTree, target_probs: np.ndarray, draft_probs: np.ndarray, rng: np.random.Generator
) -> tuple[list[int], int]:
    """Exact sampled verification of a tree of sampled drafts (SpecInfer): the children of a
    node are independent draws, child i from draft_probs[i] (the same q for i.i.d. siblings);
    `verify_siblings_multidraft` at each node of the path.

    target_probs, draft_probs: [R, V] float64 (draft rows pad_vocab'ed; draft_probs[0] is
    unused). Returns (accepted_rows, bonus_token) as `verify_tree_greedy`.
    """
    p = _check_rows(tree, target_probs, "target_probs")
    q = np.asarray(draft_probs)
    if q.shape != p.shape:
        raise InvalidArgument(f"draft_probs must have the shape of target_probs {p.shape}, got {q.shape}")
    tokens = tree.tokens.tolist()

    def select(node: int, kids: list[int]) -> tuple[int | None, int]:
        return verify_siblings_multidraft(p[node], [tokens[c] for c in kids], [q[c] for c in kids], rng)

    return _walk(tree, select)
