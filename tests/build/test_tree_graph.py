"""The fused tree-verify graph (contract 1.7) against the chain graph of the same model.

One tree call scores every row of a draft tree; each root-to-leaf path's rows must match the
chain graph's logits for the same tokens fed as one verify call (the independent reference),
within float32 tolerance (the class is numerical: attention runs with a bias). After
keep_path the cache must match the cache a chain call of the accepted path leaves.
"""

from __future__ import annotations

import pytest
import tree_checks
from tiny import build_tiny_artifact, make_model

from specexport.graphs.decoder import build_decoder
from specexport.models.config import UnsupportedConfig
from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec
from specexport_runtime.engine import OrtModel, SessionConfig
from specexport_runtime.errors import InvalidArgument
from specexport_runtime.tree import DraftTree
from specexport_runtime.tree_model import TreeVerifier

MAX_CONTEXT = 64
LOGIT_TOL = 1e-4  # |logit| of the tiny models is O(1); float32 sums in another order
KV_TOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen3", "smollm3", "granite", "phi3"])
def pair(request, tmp_path_factory):
    """(chain OrtModel, TreeVerifier on its cache) of one tiny model."""
    model = make_model(request.param)
    root = tmp_path_factory.mktemp(f"tree-{request.param}")
    chain = build_decoder(model, root / "chain", MAX_CONTEXT)
    tree = build_decoder(model, root / "tree", MAX_CONTEXT, tree=True)
    assert tree.spec.tree and not chain.spec.tree
    config = SessionConfig(provider="cpu", threads=1)
    m = OrtModel(chain.path, chain.spec, MAX_CONTEXT, config, max_rows=16)
    return m, TreeVerifier(tree.path, m, config)


def test_tree_rows_equal_chain_rows_of_each_path(pair):
    tree_checks.check_rows_equal_chain_rows(*pair, prompt=11, tol=LOGIT_TOL)


def test_keep_path_leaves_the_cache_of_a_chain_call(pair):
    tree_checks.check_keep_path(*pair, prompt=9, tol=LOGIT_TOL, kv_tol=KV_TOL)


def test_greedy_walk_on_the_tree_follows_the_chain_argmax(pair):
    tree_checks.check_greedy_walk(*pair, prompt=8)


def test_tree_calls_are_checked(pair):
    m, tv = pair
    m.reset()
    m.forward([1, 2, 3])
    with pytest.raises(InvalidArgument, match="2..16 rows"):
        tv.forward(DraftTree([1], [-1]))


def test_tree_graph_is_refused_where_it_cannot_be_right(tmp_path):
    with pytest.raises(UnsupportedConfig, match="one slot"):
        build_decoder(make_model("llama"), tmp_path / "s", MAX_CONTEXT, tree=True, slots=2)
    with pytest.raises(ValueError, match="tree graph"):
        GraphSpec(2, 1, 8, 32, kv_layout=contract.HEAD_MAJOR_INPLACE, slots=2, tree=True)
    spec = GraphSpec(1, 1, 8, 32, kv_layout=contract.HEAD_MAJOR_INPLACE, tree=True)
    assert spec.input_names()[4:6] == [contract.POSITION_IDS, contract.TREE_BIAS]
    assert contract.version_for(contract.HEAD_MAJOR_INPLACE, tree=True) == contract.TREE_VERSION


def test_tree_graph_whose_argmax_disagrees_is_refused(tmp_path, monkeypatch):
    """The build measures the tree rows against chain calls (rowcheck.tree_rows); a tree graph
    whose rows would change a greedy choice is refused in one line, not shipped."""
    from specexport.build import rowcheck
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
