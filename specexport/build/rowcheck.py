"""Row invariance: does a token's logits row depend on how many rows its call had?

Target-only decoding feeds one token per call; a speculative round verifies k + 1 tokens in
one call. Greedy speculative output equals target-only output bit for bit only if each row
comes out the same either way. `row_invariance` measures it on a model as the runtime calls
it (with its min_rows padding, feature row_padding): the rows of tokens fed one per call against
the rows of the same tokens fed in one call of k rows, for several k, on the same cache.
The build records the result in the manifest (`exactness`); run it on another provider to
check that provider.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

DEFAULT_SIZES = (2, 3, 5, 9, 17)  # verify calls of gamma 1, 2, 4, 8, 16


@dataclass(frozen=True)
class RowReport:
    """One-per-call rows against k-row calls, over every k of `sizes`."""

    min_rows: int  # the model's padding (row_padding) during the measurement
    sizes: tuple[int, ...]
    rows: int  # rows compared
    bitwise: bool  # every compared row has the same bits
    max_abs_diff: float
    argmax_agreement: float

    @property
    def exactness(self) -> str:
        return "bitwise" if self.bitwise else "numerical"

    def to_dict(self) -> dict:
        return {**asdict(self), "sizes": list(self.sizes), "exactness": self.exactness}


def _stepwise(model, prefix: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    """Rows of `tokens` fed one per call after `prefix`: [len(tokens), V]."""
    model.reset()
    model.forward(list(prefix))
    return np.stack([model.forward([t])[0].copy() for t in tokens])


def _in_one_call(model, prefix: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
    model.reset()
    model.forward(list(prefix))
    return model.forward(list(tokens), last_rows=len(tokens)).copy()


def row_invariance(
    model, prefix: Sequence[int], tokens: Sequence[int], sizes: Sequence[int] = DEFAULT_SIZES
) -> RowReport:
    """model: a model.Model (OrtModel, TrtModel); tokens: at least max(sizes) ids. Leaves the
    model's cache reset-able state dirty (call model.reset() before using it again)."""
    sizes = tuple(k for k in sizes if k <= len(tokens))
    if not sizes:
        raise ValueError(f"need at least {min(DEFAULT_SIZES)} tokens to compare calls, got {len(tokens)}")
    single = _stepwise(model, prefix, tokens[: max(sizes)])  # [n, V]
    same, diff, agree = _compare([(_in_one_call(model, prefix, tokens[:k]), single[:k]) for k in sizes])
    model.reset()
    return RowReport(model.min_rows, sizes, sum(sizes), same, diff, agree)


def _compare(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[bool, float, float]:
    """(every pair bitwise equal, max |diff|, argmax agreement over all rows) of (rows, reference
    rows) pairs of logits, each [k, V]."""
    same = all(np.array_equal(block, ref) for block, ref in pairs)
    diff = max(float(np.max(np.abs(block.astype(np.float64) - ref))) for block, ref in pairs)
    agree = sum(int(np.sum(block.argmax(-1) == ref.argmax(-1))) for block, ref in pairs)
    return same, diff, agree / sum(len(ref) for _, ref in pairs)


class _Exactness:
    """The class and record of a comparison report with `bitwise` (a dataclass)."""

    bitwise: bool

    @property
    def exactness(self) -> str:
        return "bitwise" if self.bitwise else "numerical"

    def to_dict(self) -> dict:
        return {**asdict(self), "exactness": self.exactness}


@dataclass(frozen=True)
class BatchRowReport(_Exactness):
    """A slots graph's rows (feature cache_slots) against the batch-1 graph's for the same tokens on the
    same prefix, with other slots in the call holding other sequences and row counts."""

    slots: int
    calls: int  # batched calls compared
    rows: int  # rows compared
    bitwise: bool
    max_abs_diff: float
    argmax_agreement: float


def batch_rows(
    solo, slots, prefix: Sequence[int], tokens: Sequence[int], sizes: Sequence[int] = (1, 2, 5)
) -> BatchRowReport:
    """solo: the batch-1 graph (a model.Model); slots: its slots graph (runtime slots.SlotModel).
    For each k in sizes, slot 0 feeds tokens[:k] after `prefix` while slot b > 0 (a prefix
    rotated by b) feeds k + b rows, and then the last slot feeds them alone (the others idle);
    both calls' rows are compared with the solo call's."""
    from specexport_runtime.slots import SlotCall

    K = slots.slots
    prefixes = [list(prefix[b:]) + list(prefix[:b]) for b in range(K)]  # slot b: the prefix rotated by b
    pairs = []
    for k in sizes:
        ref = _in_one_call(solo, prefix, tokens[:k])  # [k, V]
        slots.lengths[:] = 0
        slots.forward([SlotCall(b, prefixes[b], 1) for b in range(K)])
        calls = [SlotCall(0, list(tokens[:k]), k)]
        calls += [SlotCall(b, list(tokens[: k + b]), 1) for b in range(1, K) if k + b <= len(tokens)]
        pairs.append((slots.forward(calls)[0].copy(), ref))
        slots.lengths[K - 1] = 0
        slots.forward([SlotCall(K - 1, prefixes[0], 1)])
        pairs.append((slots.forward([SlotCall(K - 1, list(tokens[:k]), k)])[0].copy(), ref))
    solo.reset()
    slots.lengths[:] = 0
    same, diff, agree = _compare(pairs)
    return BatchRowReport(K, 2 * len(sizes), 2 * sum(sizes), same, diff, agree)


TREE_PARENTS = (-1, 0, 0, 1, 1, 2, 3, 6, 0)  # root, 3 children, a path of depth 4: every row kind


@dataclass(frozen=True)
class TreeRowReport(_Exactness):
    """A tree graph's rows (feature tree_verify) against the batch-1 graph's chain call of each
    root-to-leaf path, on the same prefix."""

    paths: int
    rows: int  # rows compared
    bitwise: bool
    max_abs_diff: float
    argmax_agreement: float


def tree_rows(solo, tree_graph, max_context: int, probe: Sequence[int], min_rows: int, cache_pad: int) -> TreeRowReport:
    """solo: the batch-1 graph's ExportResult (with its contract-1.2 padding); tree_graph: the
    tree graph's path. The tree's rows are probe tokens in TREE_PARENTS' shape after half the
    probe as the prefix."""
    from specexport_runtime.engine import OrtModel, SessionConfig
    from specexport_runtime.tree import DraftTree
    from specexport_runtime.tree_model import TreeVerifier

    config = SessionConfig(provider="cpu")
    model = OrtModel(
        solo.path, solo.spec, max_context, config, max_rows=len(TREE_PARENTS), min_rows=min_rows, cache_pad=cache_pad
    )
    verifier = TreeVerifier(tree_graph, model, config)
    half = max(2, len(probe) // 2)
    prefix = list(probe[:half])
    drafted = [probe[(half + i) % len(probe)] for i in range(1, len(TREE_PARENTS))]
    tree = DraftTree([prefix[-1], *drafted], list(TREE_PARENTS))  # row 0: the prefix's last token
    model.forward(prefix[:-1])
    start = model.length
    rows = verifier.forward(tree).copy()  # [R, V]
    pairs = []
    leaves = [i for i in range(len(tree)) if not tree.children(i)]
    for leaf in leaves:
        path = tree.path_to(leaf)
        model.truncate(start)
        pairs.append((rows[path], model.forward(tree.tokens[path].tolist(), last_rows=len(path)).copy()))
    same, diff, agree = _compare(pairs)
    return TreeRowReport(len(leaves), sum(len(r) for r, _ in pairs), same, diff, agree)


HEAD_TREE_PARENTS = (-1, -1, 0, 0, 1, 2, 5)  # a round's nodes (-1: the root's children), depths 1 1 2 2 2 3 4


def head_tree_rows(head, tree, features: np.ndarray, tokens: Sequence[int]) -> TreeRowReport:
    """An EAGLE-3 head's tree graph (feature eagle3_head_tree) against chain calls of its batch-1 graph.

    head: the head's OrtModel; tree: eagle_tree.HeadTree on its cache; features [k, F] and
    tokens [k + 1 + len(HEAD_TREE_PARENTS)]: a catch-up of k rows (features[t], tokens[t + 1]),
    then the nodes of HEAD_TREE_PARENTS with the next tokens, fed one depth per tree call as a
    round does (draft_hidden: the parent's hidden_out, the catch-up row's for a depth-1 node).
    Each node's logits are compared with those of the chain call of its path."""
    k = len(features)
    parents = HEAD_TREE_PARENTS
    depth = [1] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    nodes = [int(t) for t in tokens[k + 1 : k + 1 + len(parents)]]
    head.reset()
    head.forward(list(tokens[1 : k + 1]), features=features)
    base, h0 = head.length, head.hidden_out[0].copy()  # [H]
    hidden_of, row_of, tree_logits = {}, {}, {}
    rows = 0
    for d in range(1, max(depth) + 1):
        at = [i for i in range(len(parents)) if depth[i] == d]
        bias = np.full((len(at), rows + len(at)), tree.lowest, np.float32)
        for s, i in enumerate(at):
            row_of[i] = rows + s
            j, allowed = i, []
            while j >= 0:
                allowed.append(row_of[j])
                j = parents[j]
            bias[s, allowed] = 0.0
        hidden = np.stack([h0 if parents[i] < 0 else hidden_of[parents[i]] for i in at])
        logits, out = tree.forward(np.array([nodes[i] for i in at]), hidden, np.full(len(at), base + d - 1), bias)
        for s, i in enumerate(at):
            hidden_of[i], tree_logits[i] = out[s].copy(), logits[s].copy()
        rows += len(at)
    pairs = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        head.truncate(base)
        h = h0
        for j in reversed(path):
            ref = head.forward([nodes[j]], hidden=h[None])
            h = head.hidden_out[0].copy()
        pairs.append((tree_logits[i][None], ref.copy()))
    head.truncate(base)
    same, diff, agree = _compare(pairs)
    return TreeRowReport(len(parents), len(parents), same, diff, agree)
