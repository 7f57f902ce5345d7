"""Checks shared by the fused and the portable tree-graph tests: a tree graph's rows against the
chain graph's for each root-to-leaf path (the independent reference: the chain graph, which the
parity tests check against transformers), keep_path against a chain call of the accepted path,
and the greedy walk against the chain graph's own greedy tokens.

m: the chain graph's OrtModel; tv: a TreeVerifier on its cache; tol: |logit| tolerance;
kv_tol: |K/V| tolerance; prompt: tokens fed before the tree (random, seeded)."""

from __future__ import annotations

import numpy as np

from specexport_runtime.tree import DraftTree, verify_tree_greedy

PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6, 0]  # three children of the root, a path of depth 4


def after_prompt(m, rng, n: int) -> tuple[int, int]:
    """Feed all but the last of n random tokens; (that last token, the cursor P after them)."""
    prompt = rng.integers(0, m.spec.embedding_rows, n).tolist()
    m.reset()
    m.forward(prompt[:-1])
    return prompt[-1], m.length


def random_tree(rng, V: int, root: int) -> DraftTree:
    tokens = rng.integers(0, V, len(PARENTS))
    tokens[0] = root
    return DraftTree(tokens, np.array(PARENTS))


def check_rows_equal_chain_rows(m, tv, prompt: int, tol: float) -> None:
    rng = np.random.default_rng(0)
    V = m.spec.embedding_rows
    last, P = after_prompt(m, rng, prompt)
    tree = random_tree(rng, V, last)
    got = tv.forward(tree).copy()  # [R, V]
    assert got.shape == (len(PARENTS), V) and m.length == P + len(PARENTS)
    for leaf in (i for i in range(len(tree)) if not tree.children(i)):
        path = tree.path_to(leaf)
        m.truncate(P)
        want = m.forward(tree.tokens[path].tolist(), last_rows=len(path))  # [L, V]
        np.testing.assert_allclose(got[path], want, rtol=0, atol=tol)
        assert (got[path].argmax(-1) == want.argmax(-1)).all()


def check_keep_path(m, tv, prompt: int, tol: float, kv_tol: float) -> None:
    rng = np.random.default_rng(1)
    last, P = after_prompt(m, rng, prompt)
    tree = random_tree(rng, m.spec.embedding_rows, last)
    logits = tv.forward(tree).copy()
    path = tree.path_to(7)  # rows 0, 1, 3, 6, 7: not the tree's first rows, so rows move
    m.keep_path(P, path[1:])
    assert m.length == P + len(path)
    kept = [rows.copy() for rows in m.kv_rows(0, m.length)]
    following = int(logits[path[-1]].argmax())
    after_tree = m.forward([following]).copy()  # reads the kept rows
    m.truncate(P)
    chain = m.forward(tree.tokens[path].tolist(), last_rows=len(path)).copy()
    for a, b in zip(kept, m.kv_rows(0, P + len(path))):
        np.testing.assert_allclose(a, b, rtol=0, atol=kv_tol)
    np.testing.assert_allclose(logits[path], chain, rtol=0, atol=tol)
    np.testing.assert_allclose(after_tree, m.forward([following]), rtol=0, atol=tol)


def check_greedy_walk(m, tv, prompt: int) -> None:
    """A tree whose one path is the target's own greedy continuation: the walk accepts it whole."""
    rng = np.random.default_rng(2)
    V = m.spec.embedding_rows
    last, P = after_prompt(m, rng, prompt)
    greedy = [last]
    for _ in range(5):  # the chain graph's own greedy tokens, one call each
        greedy.append(int(m.forward(greedy[-1:]).argmax()))
    m.truncate(P)
    tokens = rng.integers(0, V, len(PARENTS))
    tokens[0] = last
    tokens[[2, 1, 3, 6, 7]] = [(greedy[1] + 1) % V, *greedy[1:5]]  # path 0 -> 1 -> 3 -> 6 -> 7; row 2 wrong
    tree = DraftTree(tokens, np.array(PARENTS))
    rows, bonus = verify_tree_greedy(tree, tv.forward(tree).argmax(-1))
    assert (rows, bonus) == ([1, 3, 6, 7], greedy[5])
