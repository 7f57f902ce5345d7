"""The fused tree-verify graph (contract 1.7) against the chain graph of the same model.

One tree call scores every row of a draft tree; each root-to-leaf path's rows must match the
chain graph's logits for the same tokens fed as one verify call (the independent reference),
within float32 tolerance (the class is numerical: attention runs with a bias). After
keep_path the cache must match the cache a chain call of the accepted path leaves.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny import build_tiny_artifact, make_model

from specexport.fused import build_fused
from specexport.model_config import UnsupportedConfig
from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec
from specexport_runtime.engine import OrtModel, SessionConfig
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.tree import DraftTree, verify_tree_greedy
from specexport_runtime.tree_model import TreeVerifier

MAX_CONTEXT = 64
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 6, 0]  # three children of the root, a path of depth 4
LOGIT_TOL = 1e-4  # |logit| of the tiny models is O(1); float32 sums in another order
KV_TOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen3", "smollm3", "granite", "phi3"])
def pair(request, tmp_path_factory):
    """(chain OrtModel, TreeVerifier on its cache) of one tiny model."""
    model = make_model(request.param)
    root = tmp_path_factory.mktemp(f"tree-{request.param}")
    chain = build_fused(model, root / "chain", MAX_CONTEXT)
    tree = build_fused(model, root / "tree", MAX_CONTEXT, tree=True)
    assert tree.spec.tree and not chain.spec.tree
    config = SessionConfig(provider="cpu", threads=1)
    m = OrtModel(chain.path, chain.spec, MAX_CONTEXT, config, max_rows=16)
    return m, TreeVerifier(tree.path, m, config)


def _after_prompt(m, rng, n: int) -> tuple[int, int]:
    """Feed all but the last of n random tokens; (that last token, the cursor P after them)."""
    prompt = rng.integers(0, m.spec.embedding_rows, n).tolist()
    m.reset()
    m.forward(prompt[:-1])
    return prompt[-1], m.length


def _tree(rng, V: int, root: int) -> DraftTree:
    tokens = rng.integers(0, V, len(PARENTS))
    tokens[0] = root
    return DraftTree(tokens, np.array(PARENTS))


def test_tree_rows_equal_chain_rows_of_each_path(pair):
    m, tv = pair
    rng = np.random.default_rng(0)
    V = m.spec.embedding_rows
    last, P = _after_prompt(m, rng, 11)
    tree = _tree(rng, V, last)
    got = tv.forward(tree).copy()  # [R, V]
    assert got.shape == (len(PARENTS), V) and m.length == P + len(PARENTS)
    for leaf in (i for i in range(len(tree)) if not tree.children(i)):
        path = tree.path_to(leaf)
        m.truncate(P)
        want = m.forward(tree.tokens[path].tolist(), last_rows=len(path))  # [L, V]
        np.testing.assert_allclose(got[path], want, rtol=0, atol=LOGIT_TOL)


def test_keep_path_leaves_the_cache_of_a_chain_call(pair):
    m, tv = pair
    rng = np.random.default_rng(1)
    last, P = _after_prompt(m, rng, 9)
    tree = _tree(rng, m.spec.embedding_rows, last)
    logits = tv.forward(tree).copy()
    path = tree.path_to(7)  # rows 0, 1, 3, 6, 7
    m.keep_path(P, path[1:])
    assert m.length == P + len(path)
    kept = [rows.copy() for rows in m.kv_rows(0, m.length)]
    following = int(logits[path[-1]].argmax())
    after_tree = m.forward([following]).copy()  # reads the kept rows
    m.truncate(P)
    chain = m.forward(tree.tokens[path].tolist(), last_rows=len(path)).copy()
    for a, b in zip(kept, m.kv_rows(0, P + len(path))):
        np.testing.assert_allclose(a, b, rtol=0, atol=KV_TOL)
    np.testing.assert_allclose(logits[path], chain, rtol=0, atol=LOGIT_TOL)
    np.testing.assert_allclose(after_tree, m.forward([following]), rtol=0, atol=LOGIT_TOL)


def test_greedy_walk_on_the_tree_follows_the_chain_argmax(pair):
    """A tree whose one path is the target's own greedy continuation: the walk accepts it whole."""
    m, tv = pair
    rng = np.random.default_rng(2)
    V = m.spec.embedding_rows
    last, P = _after_prompt(m, rng, 8)
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


def test_tree_calls_are_checked(pair):
    m, tv = pair
    m.reset()
    m.forward([1, 2, 3])
    with pytest.raises(InvalidArgument, match="2..16 rows"):
        tv.forward(DraftTree([1], [-1]))


def test_tree_graph_is_refused_where_it_cannot_be_right(tmp_path):
    with pytest.raises(UnsupportedConfig, match="attention windows"):
        build_fused(make_model("mistral", sliding_window=4), tmp_path / "w", MAX_CONTEXT, tree=True)
    with pytest.raises(UnsupportedConfig, match="one slot"):
        build_fused(make_model("llama"), tmp_path / "s", MAX_CONTEXT, tree=True, slots=2)
    with pytest.raises(ValueError, match="tree graph"):
        GraphSpec(2, 1, 8, 32, kv_layout=contract.HEAD_MAJOR_INPLACE, slots=2, tree=True)
    spec = GraphSpec(1, 1, 8, 32, kv_layout=contract.HEAD_MAJOR_INPLACE, tree=True)
    assert spec.input_names()[4:6] == [contract.POSITION_IDS, contract.TREE_BIAS]
    assert contract.version_for(contract.HEAD_MAJOR_INPLACE, tree=True) == contract.TREE_VERSION


def test_tree_graph_whose_argmax_disagrees_is_refused(tmp_path, monkeypatch):
    """The build measures the tree rows against chain calls (rowcheck.tree_rows); a tree graph
    whose rows would change a greedy choice is refused in one line, not shipped."""
    from specexport import rowcheck
    from specexport.errors import BuildError

    real = rowcheck.tree_rows

    class Worse:
        def __init__(self, report):
            self.report = report

        def to_dict(self):
            return {**self.report.to_dict(), "argmax_agreement": 12 / 13, "max_abs_diff": 2.46}

    monkeypatch.setattr(rowcheck, "tree_rows", lambda *a, **k: Worse(real(*a, **k)))
    with pytest.raises(BuildError) as info:
        build_tiny_artifact(tmp_path, "noisy-fused-tree")
    msg = str(info.value)
    assert "argmax on only 92%" in msg and "2.46" in msg and "\n" not in msg
    assert not any(tmp_path.rglob("tree.onnx"))  # nothing half-written
