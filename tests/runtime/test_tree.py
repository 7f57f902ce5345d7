"""Draft trees and tree acceptance (tree.py): validation, masks against hand-written matrices,
greedy walks against a brute-force reference, chains against sampling.py's chain verification,
and the sampling law of both sampled rules (Monte Carlo, chi-square, with power against wrong
rules). Pure numpy, seconds in all."""

from __future__ import annotations

import numpy as np
import pytest
from exactness_support import chi2_sf

from specexport_runtime import tree as tree_mod
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.sampling import one_hot, residual, verify_greedy, verify_sampled
from specexport_runtime.tree import (
    DraftTree,
    residual_without,
    tree_parents_or_none,
    verify_tree_greedy,
    verify_tree_multidraft,
    verify_tree_sampled,
)

# ------------------------------------------------------------------------- the tree itself


@pytest.mark.parametrize(
    "tokens, parents, match",
    [
        ([5, 1, 2], [-1, 2, 0], r"parents\[1\] must be an earlier row in \[0, 1\), got 2 \(rows are topological"),
        ([5, 1, 2], [-1, 1, 1], r"parents\[1\] must be an earlier row in \[0, 1\), got 1"),
        ([5, 1, 2], [-1, 0, -1], r"parents\[2\] .* got -1 \(only row 0 is a root\)"),
        ([5, 1, 2], [-1, 0, 7], r"parents\[2\] must be an earlier row in \[0, 2\), got 7"),
        ([5, 1, 2], [-1, 0, -3], r"parents\[2\] .* got -3"),
        ([5, 1, 2], [0, 0, 1], r"parents\[0\] must be -1 .*got 0"),
        ([5, 1, 2], [-1, 0], r"parents must have one entry per row \(3 tokens\), got 2"),
        ([], [], r"at least its root row"),
        ([5, -1], [-1, 0], r"tokens\[1\] must be a token id >= 0, got -1"),
        ([5, 1.5], [-1, 0], r"tokens must hold integers, got dtype float64"),
        ([5, 1], [-1.0, 0.0], r"parents must hold integers"),
        ([[5, 1]], [[-1, 0]], r"tokens must be a 1-D sequence"),
    ],
)
def test_tree_rejects_bad_rows(tokens, parents, match):
    with pytest.raises(InvalidArgument, match=match):
        DraftTree(tokens, parents)


# row: token, parent        0
#   0: 10, -                / \
#   1: 11, 0               1   2
#   2: 12, 0              / \   \
#   3: 13, 1             3   4   5
#   4: 14, 1             |
#   5: 15, 2             6
#   6: 16, 3
HAND = DraftTree([10, 11, 12, 13, 14, 15, 16], [-1, 0, 0, 1, 1, 2, 3])
HAND_MASK = [
    [1, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0, 0],
    [1, 1, 0, 1, 0, 0, 0],
    [1, 1, 0, 0, 1, 0, 0],
    [1, 0, 1, 0, 0, 1, 0],
    [1, 1, 0, 1, 0, 0, 1],
]


def test_hand_tree_structure():
    assert len(HAND) == 7 and not HAND.is_chain()
    assert HAND.depths().tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert HAND.position_offsets().tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert [HAND.children(i) for i in range(7)] == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert HAND.child_lists() == [[1, 2], [3, 4], [5], [6], [], [], []]
    assert HAND.path_to(6) == [0, 1, 3, 6] and HAND.path_to(5) == [0, 2, 5] and HAND.path_to(0) == [0]
    assert HAND.path_to(np.int64(4)) == [0, 1, 4]
    mask = HAND.ancestors_mask()
    assert mask.dtype == bool and mask.tolist() == np.array(HAND_MASK, dtype=bool).tolist()
    for dtype in (np.float32, np.float16, np.float64):
        bias = HAND.attention_bias(dtype)
        want = np.where(np.array(HAND_MASK) == 1, 0.0, np.finfo(dtype).min).astype(dtype)
        assert bias.dtype == dtype and np.array_equal(bias, want)
    assert HAND.attention_bias().dtype == np.float32
    with pytest.raises(InvalidArgument, match="floating dtype, got int32"):
        HAND.attention_bias(np.int32)
    for bad in (7, -1, True, 1.0):
        with pytest.raises(InvalidArgument, match=r"row must be an integer in \[0, 7\)"):
            HAND.children(bad)


def test_tree_stores_read_only_copies():
    tokens, parents = np.array([1, 2, 3]), np.array([-1, 0, 0])
    t = DraftTree(tokens, parents)
    tokens[1] = 9
    assert t.tokens.tolist() == [1, 2, 3] and t.tokens.dtype == np.int64
    with pytest.raises(ValueError):
        t.tokens[0] = 4


def test_chain_and_single_root():
    c = DraftTree.chain([7, 3, 3, 1])
    assert c.is_chain() and c.parents.tolist() == [-1, 0, 1, 2] and c.tokens.tolist() == [7, 3, 3, 1]
    assert c.ancestors_mask().tolist() == np.tril(np.ones((4, 4), dtype=bool)).tolist()
    root = DraftTree([4], [-1])
    assert root.is_chain() and root.depths().tolist() == [0] and root.ancestors_mask().tolist() == [[True]]
    assert not DraftTree([1, 2, 3], [-1, 0, 0]).is_chain()


def test_proposal_parents_of_a_chain_are_none():
    assert tree_parents_or_none([0, 1, 2]) is None and tree_parents_or_none([]) is None
    assert tree_parents_or_none([0, 0, 1]) == (0, 0, 1) and tree_parents_or_none(np.array([0, 1, 1])) == (0, 1, 1)


# ------------------------------------------------------------------------- greedy


def greedy_reference(tokens, parents, argmax):
    """Enumerate the root-to-leaf paths; on each, the prefix of rows whose token is the argmax
    at their parent and is the first sibling with that token; the longest such prefix wins."""
    R = len(tokens)

    def first_match(r):
        p = parents[r]
        earlier = any(parents[s] == p and tokens[s] == tokens[r] for s in range(1, r))
        return tokens[r] == argmax[p] and not earlier

    best = []
    for leaf in (r for r in range(R) if r not in parents[1:]):
        path, r = [], leaf
        while r != 0:
            path.append(r)
            r = parents[r]
        prefix = []
        for r in reversed(path):
            if not first_match(r):
                break
            prefix.append(r)
        if len(prefix) > len(best):
            best = prefix
    return best, argmax[best[-1] if best else 0]


def random_parents(rng, R):
    # half the rows extend the previous row, so deep paths are common
    return [-1] + [i - 1 if rng.random() < 0.5 else int(rng.integers(0, i)) for i in range(1, R)]


def test_greedy_random_trees_match_brute_force():
    rng = np.random.default_rng(7)
    lengths = []
    for _ in range(1500):
        R = int(rng.integers(1, 16))
        parents = random_parents(rng, R)
        tokens = rng.integers(0, 3, R).tolist()  # 3 tokens: many matches and duplicate siblings
        argmax = rng.integers(0, 3, R).tolist()
        for i in range(1, R):  # mostly agree with some child, so long paths are accepted too
            if rng.random() < 0.6:
                argmax[parents[i]] = tokens[i]
        got = verify_tree_greedy(DraftTree(tokens, parents), np.array(argmax))
        assert got == greedy_reference(tokens, parents, argmax), (tokens, parents, argmax)
        lengths.append(len(got[0]))
    assert min(lengths) == 0 and max(lengths) >= 5  # short and long accepted paths were both seen


def test_greedy_first_sibling_wins_ties():
    # children 1 and 2 both carry the argmax 4; only child 2 has a matching grandchild
    t = DraftTree([0, 4, 4, 9], [-1, 0, 0, 2])
    assert verify_tree_greedy(t, [4, 1, 9, 3]) == ([1], 1)


def test_greedy_chains_equal_verify_greedy():
    rng = np.random.default_rng(3)
    for _ in range(500):
        gamma = int(rng.integers(0, 7))
        d = rng.integers(0, 3, gamma)
        a = rng.integers(0, 3, gamma + 1)
        rows, bonus = verify_tree_greedy(DraftTree.chain([5, *d.tolist()]), a)
        n, nxt = verify_greedy(a, d)
        assert (rows, bonus) == (list(range(1, n + 1)), nxt)


def test_greedy_root_children_all_wrong():
    t = DraftTree([8, 1, 2, 3, 0], [-1, 0, 0, 0, 1])  # row 4 (token 0) is a grandchild, not a child
    assert verify_tree_greedy(t, [0, 0, 0, 0, 0]) == ([], 0)
    assert verify_tree_greedy(DraftTree([8], [-1]), [6]) == ([], 6)
    with pytest.raises(InvalidArgument, match=r"target_argmax must have one entry per row \(R = 5\), got 4"):
        verify_tree_greedy(t, [0, 0, 0, 0])


# ------------------------------------------------------------------------- sampled: chains, edges


def test_residual_without_is_residual_of_one_hot():
    rng = np.random.default_rng(11)
    for _ in range(50):
        p = rng.random(6) * (rng.random(6) < 0.7)
        p = p / p.sum() if p.sum() > 0 else np.full(6, 1 / 6)
        x = int(rng.integers(0, 6))
        np.testing.assert_array_equal(residual_without(p, x), residual(p, one_hot([x], 6)[0]))
    p = np.array([0.0, 1.0, 0.0])
    np.testing.assert_array_equal(residual_without(p, 1), p)  # guard: nothing left


def test_sampled_chains_equal_verify_sampled():
    """On a chain both rules are verify_sampled (one-hot q, or the draft's q), draw for draw."""
    rng = np.random.default_rng(5)
    for case in range(300):
        gamma, v = int(rng.integers(0, 5)), 5
        p = rng.dirichlet(np.full(v, 0.5), gamma + 1)  # [gamma+1, v]
        q = rng.dirichlet(np.full(v, 0.5), gamma)  # [gamma, v]
        d = [int(rng.choice(v, p=row)) for row in q]
        chain = DraftTree.chain([0, *d])
        n, nxt = verify_sampled(p, one_hot(d, v), d, np.random.default_rng(case))
        assert verify_tree_sampled(chain, p, np.random.default_rng(case)) == (list(range(1, n + 1)), nxt)
        n, nxt = verify_sampled(p, q, d, np.random.default_rng(case))
        q_rows = np.vstack([np.full((1, v), 1 / v), q])  # row 0 unused
        assert verify_tree_multidraft(chain, p, q_rows, np.random.default_rng(case)) == (list(range(1, n + 1)), nxt)


def test_sampled_edges_and_errors():
    rng = np.random.default_rng(0)
    t = DraftTree([0, 1, 2, 0], [-1, 0, 0, 2])
    p = np.array([[0.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert verify_tree_sampled(t, p, rng) == ([2], 1)  # deterministic target: child 2, then its bonus
    p[0] = [1.0, 0.0, 0.0]  # neither child is possible: nothing accepted, the root's bonus
    assert verify_tree_sampled(t, p, rng) == ([], 0)
    with pytest.raises(InvalidArgument, match=r"target_probs must have shape \[R = 4, V\], got \(3, 3\)"):
        verify_tree_sampled(t, p[:3], rng)
    with pytest.raises(InvalidArgument, match=r"tokens\[2\] = 2 is outside the vocabulary \[0, 2\)"):
        verify_tree_sampled(t, p[:, :2], rng)
    with pytest.raises(InvalidArgument, match=r"draft_probs must have the shape of target_probs \(4, 3\)"):
        verify_tree_multidraft(t, p, p[1:], rng)


# ------------------------------------------------------------------------- the sampling law

V = 6
P_ROOT = np.array([0.3, 0.25, 0.0, 0.2, 0.15, 0.1])  # the target's law of the first token
P_NEXT = np.array(  # row a: the target's law of the second token after a first token a
    [
        [0.1, 0.4, 0.0, 0.2, 0.2, 0.1],
        [0.25, 0.05, 0.3, 0.0, 0.2, 0.2],
        [1 / 6] * 6,  # never used: P_ROOT(2) = 0
        [0.0, 0.35, 0.15, 0.3, 0.05, 0.15],
        [0.2, 0.2, 0.2, 0.2, 0.1, 0.1],
        [0.5, 0.0, 0.0, 0.25, 0.25, 0.0],
    ]
)
UNIFORM = np.full(V, 1 / V)  # deeper rows: the law of a third token, not checked
JOINT = P_ROOT[:, None] * P_NEXT  # [V, V] the exact law of the first two emitted tokens
N = 20000
ALPHA = 1e-3  # per chi-square assertion (the seeds are fixed: the outcome is deterministic)

# Deterministic siblings, fixed tree. Root children: 3, 2 (P_ROOT = 0), 0, 3 again (a duplicate
# that can never be accepted). Under the first 3: 0 (P_NEXT[3] = 0), 1, 4, 1 again; under 0: 5
# (which has a child itself); the children of 2 and of the second 3 are unreachable.
DET_TREE = DraftTree([9, 3, 2, 0, 3, 0, 1, 4, 1, 5, 0, 2, 2], [-1, 0, 0, 0, 0, 1, 1, 1, 1, 3, 2, 4, 9])
DET_PROBS = np.array([P_ROOT] + [P_NEXT[t] for t in DET_TREE.tokens[1:5]] + [UNIFORM] * 8)

# Sampled siblings: 3 children of the root i.i.d. from Q_ROOT, 2 children of each i.i.d. from
# Q_NEXT[its token]. Q_ROOT proposes 2 (P_ROOT = 0) and never 4 (P_ROOT > 0).
Q_ROOT = np.array([0.1, 0.1, 0.3, 0.3, 0.0, 0.2])
Q_NEXT = np.array(
    [
        [0.3, 0.1, 0.2, 0.0, 0.2, 0.2],
        [0.1, 0.1, 0.1, 0.5, 0.1, 0.1],
        [1 / 6] * 6,
        [0.5, 0.1, 0.1, 0.1, 0.1, 0.1],
        [0.0, 0.0, 0.5, 0.0, 0.0, 0.5],
        [0.2, 0.2, 0.2, 0.2, 0.2, 0.0],
    ]
)
MULTI_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 3]


def draw(law: np.ndarray, rng, size: int | None = None):
    """Tokens ~ law by inverse CDF (rng.choice is several times slower per call)."""
    cdf = np.cumsum(law)
    return np.minimum(np.searchsorted(cdf / cdf[-1], rng.random(size), side="right"), V - 1)


def first_two(t: DraftTree, rows, bonus, rng) -> tuple[int, int]:
    """The first two tokens a round emits; a round that emits one token is completed by plain
    sampling from the target (P_NEXT)."""
    out = [int(t.tokens[r]) for r in rows] + [int(bonus)]
    if len(out) == 1:
        out.append(int(draw(P_NEXT[out[0]], rng)))
    return out[0], out[1]


def det_pairs(verify, seed: int, lengths: list | None = None) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(N):
        rows, bonus = verify(DET_TREE, DET_PROBS, rng)
        pairs.append(first_two(DET_TREE, rows, bonus, rng))
        if lengths is not None:
            lengths.append(len(rows))
    return np.array(pairs)


def multi_pairs(verify, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(N):
        kids = draw(Q_ROOT, rng, 3)
        grand = [draw(Q_NEXT[a], rng, 2) for a in kids]
        t = DraftTree([9, *kids, *np.concatenate(grand)], MULTI_PARENTS)
        target = np.array([P_ROOT, *P_NEXT[kids]] + [UNIFORM] * 6)
        draft = np.array([UNIFORM] + [Q_ROOT] * 3 + [Q_NEXT[a] for a in kids for _ in range(2)])
        pairs.append(first_two(t, *verify(t, target, draft, rng), rng))
    return np.array(pairs)


def law_stats(pairs: np.ndarray) -> dict:
    """Chi-square p-values (first token; pair, over the cells of positive probability), the
    largest absolute frequency errors and the count of impossible pairs."""
    counts = np.zeros((V, V))
    np.add.at(counts, (pairs[:, 0], pairs[:, 1]), 1)
    out = {"impossible": int(counts[JOINT == 0].sum())}
    for name, c, law in (("first", counts.sum(axis=1), P_ROOT), ("pair", counts, JOINT)):
        live = law > 0
        e = N * law[live]
        out[name + "_p"] = chi2_sf(float(((c[live] - e) ** 2 / e).sum()), int(live.sum()) - 1)
        out[name + "_err"] = float(np.abs(c / N - law).max())
    return out


def assert_follows_target(s: dict) -> None:
    assert s["impossible"] == 0, s
    assert s["first_p"] > ALPHA and s["pair_p"] > ALPHA, s
    # about 5 binomial standard deviations of the largest cell (0.3 first, 0.12 pair) at N = 20000
    assert s["first_err"] < 0.017 and s["pair_err"] < 0.012, s


def test_tree_sampled_follows_target():
    lengths = []
    pairs = det_pairs(verify_tree_sampled, 1, lengths)
    assert_follows_target(law_stats(pairs))
    # every possible pair was seen, and every length of accepted path (0 to 3: row 12)
    assert len({tuple(p) for p in pairs}) == int((JOINT > 0).sum())
    assert set(lengths) == {0, 1, 2, 3}


def test_tree_multidraft_follows_target():
    assert_follows_target(law_stats(multi_pairs(verify_tree_multidraft, 2)))


def accept_first_sibling(t: DraftTree, target, *rest):
    """A wrong rule: always accept the first child; the bonus from the leaf's target row.
    rest: (rng,) or (draft_probs, rng), the signatures of both rules."""
    rng = rest[-1]
    rows = []
    while kids := t.children(rows[-1] if rows else 0):
        rows.append(kids[0])
    return rows, int(draw(target[rows[-1] if rows else 0], rng))


@pytest.mark.parametrize("rule", ["first sibling", "no residual"])
def test_wrong_rules_are_caught(rule, monkeypatch):
    """The same statistic rejects wrong rules: always accepting the first sibling, and keeping p
    after a rejection instead of moving to the residual (later siblings judged against p, the
    bonus sampled from p: the classic bug)."""
    if rule == "first sibling":
        det = det_pairs(accept_first_sibling, 1)
        multi = multi_pairs(accept_first_sibling, 2)
    else:
        monkeypatch.setattr(tree_mod, "residual_without", lambda p, x: p)
        monkeypatch.setattr(tree_mod, "residual", lambda p, q: p)
        det = det_pairs(verify_tree_sampled, 1)
        multi = multi_pairs(verify_tree_multidraft, 2)
    for pairs in (det, multi):
        s = law_stats(pairs)
        assert min(s["first_p"], s["pair_p"]) < ALPHA, s
