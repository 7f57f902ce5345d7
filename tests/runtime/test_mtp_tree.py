"""MTP draft trees end to end: a tiny full-attention Qwen3.5 target whose checkpoint carries an
echoing MTP layer, built with tree_verify (graph: fused), so the artifact has the target's tree
graph and the MTP head's (draft/tree.onnx). Greedy output with `mtp` trees equals target-only
output token for token (the reference: one token per call through the chain graph), with the
head's own drafts and with an oracle that gets paths accepted (drafter_tree_support.py); the
manifest records the head's tree graph; a hybrid Qwen3.5 target (the published layout) refuses
tree_verify in one line before any weight loads."""

from __future__ import annotations

import json

import pytest
from drafter_tree_support import build_mtp_tree, greedy_tree_runs

from specexport_runtime import eagle
from specexport_runtime.api import load
from specexport_runtime.mtp import MtpProposer

TOL = 1e-4  # float32 tree rows against chain rows


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    return load(build_mtp_tree(tmp_path_factory.mktemp("mtp-tree")))


def test_the_manifest_records_the_mtp_heads_tree_graph(gen):
    data = json.loads((gen.root / "manifest.json").read_text())
    draft = data["draft"]
    assert draft["kind"] == "mtp" and draft["tree_graph"] == "draft/tree.onnx"
    assert data["target"]["tree_graph"] == "target/tree.onnx"
    assert {"mtp_head", "eagle3_head_tree", "tree_verify"} <= set(data["graph_features"])
    assert data["contract_version"] == "1.12"
    rows = draft["validation"]["tree_rows"]  # the build's check: tree rows against chain calls of each path
    assert rows["paths"] == 7 and rows["max_abs_diff"] < TOL and rows["argmax_agreement"] == 1.0
    assert gen.head_tree is not None and gen.head_tree.spec.kind == "mtp"


@pytest.mark.parametrize("oracle", [False, True], ids=["head", "oracle"])
@pytest.mark.parametrize("nodes", [4, 24])
def test_greedy_mtp_tree_output_equals_target_only(gen, free_rows, monkeypatch, nodes, oracle):
    patch = (monkeypatch, eagle, MtpProposer) if oracle else ()
    total = greedy_tree_runs(gen, "mtp", nodes, *patch)
    assert total["tree_rounds"] > 0 and total["sources"] <= {"mtp"}
    if oracle:
        assert 0 < total["accepted"] < total["drafted"]


def test_chains_still_run_without_tree_nodes(gen):
    out = gen.generate([40, 41, 42, 43, 44] * 4, max_new_tokens=24, proposer="mtp", gamma=3)
    base = gen.generate([40, 41, 42, 43, 44] * 4, max_new_tokens=24, speculative=False)
    assert out.token_ids == base.token_ids and out.stats.tree_rounds == 0 and out.stats.rounds > 0


def test_a_hybrid_qwen3_5_target_refuses_mtp_trees_before_weights_load(tmp_path):
    from mtp_checkpoints import add_mtp
    from tiny import make_model, save_hf_folder, write_recipe

    from specexport.build.artifact import build_artifact
    from specexport.models.config import UnsupportedConfig
    from specexport.recipe.load import load_recipe

    target = make_model("qwen3_5_text")  # Gated DeltaNet layers and a full-attention layer
    folder = save_hf_folder(target, tmp_path / "hf")
    add_mtp(folder, target.config)
    recipe = write_recipe(tmp_path / "r.yaml", folder, {"mtp": {}}, graph="fused", tree_verify=True)
    with pytest.raises(UnsupportedConfig, match="recurrent layers.*build without tree_verify") as info:
        build_artifact(load_recipe(recipe), tmp_path / "out")
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()
