"""The portable tree-verify graph (contract 1.9) against the portable chain graph of the same model.

The portable decoder takes position_ids and tree_bias and writes the tree rows' K/V through its
new_* outputs into the time_major cache at P .. P+R-1. Each root-to-leaf path's rows must match
the chain graph's logits for the same tokens fed as one verify call (the independent reference:
the chain graph is checked against transformers by the parity tests), within float32 tolerance;
after keep_path the cache must match the cache a chain call of the accepted path leaves. Families
with attention windows are covered with prompts longer than their windows: the tree graph applies
them by position, as a chain decoding of each path does.
"""

from __future__ import annotations

import onnx
import pytest
import torch
import tree_checks
from tiny import export_portable, make_model, save_hf_folder, write_recipe

from specexport.models.config import normalize
from specexport.plan.trtcheck import check_trt
from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec
from specexport_runtime.engine import OrtModel, SessionConfig
from specexport_runtime.manifest import sha256_file
from specexport_runtime.tree_model import TreeVerifier

MAX_CONTEXT = 64
PROMPT = 21  # tokens before the tree: past every window below (4 and 16 keys)
LOGIT_TOL = 1e-4  # |logit| of the tiny models is O(1); float32 sums over other row counts
KV_TOL = 1e-4
FP16_TOL = 1e-2  # an fp16 graph: K/V and activations rounded to fp16 (measured: bitwise on this CPU)
# (name, make_model arguments): rotary families, NoPE layers, multipliers, fused qkv, learned
# positions (gpt2), windows by position (mistral with a 4-key window, gemma2's 16 with softcaps),
# and an fp16 graph (fp16 caches, the mask still float32)
MODELS = {
    "llama": ("llama", {}),
    "llama-fp16": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "smollm3": ("smollm3", {}),
    "granite": ("granite", {}),
    "phi3": ("phi3", {}),
    "gpt2": ("gpt2", {}),
    "mistral-w4": ("mistral", {"sliding_window": 4}),
    "gemma2": ("gemma2", {}),
}


def _tol(m) -> float:
    return FP16_TOL if m.spec.kv_dtype == "float16" else LOGIT_TOL


@pytest.fixture(scope="module", params=sorted(MODELS))
def pair(request, tmp_path_factory):
    """(chain OrtModel, TreeVerifier on its cache, chain ExportResult, tree ExportResult)."""
    arch, overrides = MODELS[request.param]
    model = make_model(arch, **overrides)
    if request.param.endswith("-fp16"):
        model = model.to(torch.float16)
    windows = normalize(model.config, MAX_CONTEXT).windows
    assert all(w < PROMPT for w in windows)  # the windows bite
    root = tmp_path_factory.mktemp(f"ptree-{request.param}")
    chain = export_portable(model, root / "chain")
    tree = export_portable(model, root / "tree", tree=True)
    assert tree.spec.tree and not chain.spec.tree and tree.spec.kv_layout == contract.TIME_MAJOR
    config = SessionConfig(provider="cpu", threads=1)
    m = OrtModel(chain.path, chain.spec, MAX_CONTEXT, config, max_rows=16)
    return m, TreeVerifier(tree.path, m, config), chain, tree


def test_tree_rows_equal_chain_rows_of_each_path(pair):
    m, tv, _, _ = pair
    tree_checks.check_rows_equal_chain_rows(m, tv, PROMPT, _tol(m))


def test_keep_path_leaves_the_cache_of_a_chain_call(pair):
    m, tv, _, _ = pair
    tree_checks.check_keep_path(m, tv, PROMPT, _tol(m), KV_TOL if m.spec.kv_dtype == "float32" else FP16_TOL)


def test_greedy_walk_on_the_tree_follows_the_chain_argmax(pair):
    m, tv, _, _ = pair
    tree_checks.check_greedy_walk(m, tv, PROMPT)


def test_tree_graph_reads_the_chain_graphs_weights_file(pair):
    """The portable tree graph's weights file is the chain graph's byte for byte (what the build's
    share_weights needs), and the tree graph is the contract's: 1.9 metadata, standard ops only."""
    _, _, chain, tree = pair
    assert sha256_file(tree.path.with_name(tree.path.name + ".data")) == sha256_file(
        chain.path.with_name(chain.path.name + ".data")
    )
    proto = onnx.load(str(tree.path), load_external_data=False)
    meta = {p.key: p.value for p in proto.metadata_props}
    assert meta[contract.META_CONTRACT_VERSION] == contract.PORTABLE_TREE_VERSION == "1.9"
    assert meta[contract.META_KV_LAYOUT] == contract.TIME_MAJOR
    assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}
    names = [i.name for i in proto.graph.input]
    assert names[:4] == [contract.INPUT_IDS, contract.LOGITS_INDEX, contract.POSITION_IDS, contract.TREE_BIAS]


def test_trtcheck_accepts_the_portable_tree_graph(pair):
    """Every op in TensorRT's support matrix, opset within range, every dynamic dim a profile's
    (tree_bias is [seq, seq]: its axis 0 is not a batch axis)."""
    _, _, _, tree = pair
    for version in ("8.6", "10.3"):
        report = check_trt(tree.path, version)
        assert report.ok, report.errors
        assert contract.TREE_BIAS in report.dynamic_dims["seq"]


def test_contract_1_9_names_and_versions():
    spec = GraphSpec(2, 1, 8, 32, tree=True)  # time_major
    assert spec.input_names()[:4] == [
        contract.INPUT_IDS,
        contract.LOGITS_INDEX,
        contract.POSITION_IDS,
        contract.TREE_BIAS,
    ]
    assert spec.output_names()[1:3] == [contract.new_key(0), contract.new_value(0)]
    assert contract.version_for(contract.TIME_MAJOR, tree=True) == "1.9"
    assert contract.version_for(contract.HEAD_MAJOR_INPLACE, tree=True) == contract.TREE_VERSION == "1.7"
    assert contract.parse_version(contract.CONTRACT_VERSION) >= (1, 9)  # a runtime reads every older minor
    with pytest.raises(ValueError, match="tree graph"):
        GraphSpec(1, 1, 8, 32, kind=contract.EAGLE3_HEAD, feature_width=8, hidden_width=8, tree=True)


def test_a_tree_for_a_window_family_passes_the_config_check_in_both_forms(tmp_path, monkeypatch):
    """graph: fused or portable with tree_verify and a windowed target: the config check, before
    any weight is read, keeps the windows (both forms apply them by position in the tree graph;
    tests/runtime/test_tree_windows.py runs the fused one)."""
    from specexport.build import load as build_load
    from specexport.recipe.load import load_recipe

    target = save_hf_folder(make_model("mistral", sliding_window=4), tmp_path / "t")

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(build_load, "load_model", no_weights)
    for graph in ("fused", "portable"):
        recipe = load_recipe(
            write_recipe(tmp_path / f"{graph}.yaml", target, {"proposer": "ngram"}, graph=graph, tree_verify=True)
        )
        assert build_load.check_config(recipe.target, recipe).windows == (4,)


def test_build_cli_writes_and_checks_a_portable_tree_graph(tmp_path):
    """`specexport build --tree-verify` of a portable recipe whose target has a 4-key window: the
    tree graph beside the batch-1 graph on its weights file, its rows against chain calls in the
    report (the probe's prefix is past the window), contract 1.9, and check-trt accepts every
    graph of the artifact, the tree graph included."""
    import json

    from click.testing import CliRunner

    from specexport.cli.main import cli
    from specexport.plan.trtcheck import check_artifact

    target = save_hf_folder(make_model("mistral", sliding_window=4), tmp_path / "t")
    recipe = write_recipe(tmp_path / "r.yaml", target, {"proposer": "ngram"}, max_context=64)
    out = tmp_path / "a"
    result = CliRunner().invoke(cli, ["build", str(recipe), "-o", str(out), "--tree-verify"])
    assert result.exit_code == 0, result.output
    assert "target tree rows: max |diff|" in result.output and "13 rows of 4 paths" in result.output
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["target"]
    assert manifest["contract_version"] == "1.9" and entry["tree_graph"] == "target/tree.onnx"
    assert entry["kv_layout"] == contract.TIME_MAJOR
    rows = entry["validation"]["tree_rows"]
    assert rows["max_abs_diff"] < LOGIT_TOL and rows["argmax_agreement"] == 1.0
    assert not (out / "target" / "tree.onnx.data").exists()  # it reads target/model.onnx.data
    report = check_artifact(out, "10.3")
    assert set(report.graphs) == {"target", "target tree"} and report.ok, report.errors
