"""EAGLE-3 heads in the portable graph form (standard ONNX ops, time-major caches): the portable
target's hidden_states output and the portable head graph against independent references
(transformers' output_hidden_states; tests/eagle_heads.py's reference forward), the artifact's
manifest and TensorRT lint, and the `eagle` / `hybrid` proposers' greedy exactness on a tiny
model whose random head drafts wrong often enough to exercise corrections and rollback.

Tolerances: float32 graphs against float32 PyTorch with the same weights: 1e-4 absolute on logits,
hidden rows and features (summation order only). The fp16 head against the same float32 reference:
2e-2 relative to the largest |value| of the compared rows (fp16 weights, activations and cache;
norms and attention scores in float32), the fused fp16 head's bound in test_eagle3.py."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from eagle_heads import PROBE_IDS as IDS
from eagle_heads import (
    TOL,
    assert_close_at,
    assert_head_catches_up_after_rollback,
    assert_head_follows_reference,
    target_features,
    tiny_target_and_head,
)
from tiny import export_portable

from specexport.build.validate import FeedRunner
from specexport.graphs.eagle import build_eagle3_head
from specexport_runtime import contract
from specexport_runtime.engine import OrtModel, SessionConfig


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target model, head folder info, loaded head, the target's embedding [V, H])."""
    root = tmp_path_factory.mktemp("eagle-portable")
    target, info, head = tiny_target_and_head(root)
    return target, info, head, target.get_input_embeddings().weight.detach().float()


@pytest.fixture(scope="module")
def heads(pair, tmp_path_factory):
    """Portable head graphs by precision."""
    _, _, head, embed = pair
    root = tmp_path_factory.mktemp("portable-heads")
    return {
        p: build_eagle3_head(head, embed, root / p, 128, precision=p, kv_layout=contract.TIME_MAJOR)
        for p in ("fp32", "fp16")
    }


# --------------------------------------------------------------------------- target features


def test_portable_target_features_are_the_entering_residual_streams(pair, tmp_path):
    """hidden_states of every input row, fed in two calls (the second over a 9-row past), equal
    transformers' output_hidden_states at the head's layer ids, concatenated in their order."""
    target, info, _, _ = pair
    graph = export_portable(target, tmp_path / "target", feature_layers=tuple(info["layer_ids"]))
    assert graph.spec.feature_width == 3 * target.config.hidden_size and graph.spec.kv_layout == contract.TIME_MAJOR
    runner = FeedRunner(graph.path, graph.spec)
    runner.run(IDS[:9], [8])
    first = runner.features.copy()
    runner.run(IDS[9:], [len(IDS) - 10])
    got = np.concatenate([first, runner.features])  # [S, F]
    want = target_features(target, IDS, info["layer_ids"]).numpy()  # [S, 3 H_t], transformers
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    meta = {p.key: p.value for p in onnx.load(str(graph.path), load_external_data=False).metadata_props}
    assert meta[contract.META_CONTRACT_VERSION] == "1.2" and meta[contract.META_KV_LAYOUT] == contract.TIME_MAJOR


def test_portable_target_refuses_feature_layers_past_its_depth(pair, tmp_path):
    from specexport.models.config import UnsupportedConfig

    # 0 .. L: layer L is the stream after the final norm (what a Gemma 4 assistant or an MTP head reads)
    with pytest.raises(UnsupportedConfig, match=r"feature layers \[3\] are outside the target's 0..2"):
        export_portable(pair[0], tmp_path / "t", feature_layers=(0, 1, 3))


# --------------------------------------------------------------------------- the head graph


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_portable_head_matches_the_reference_forward(pair, heads, precision):
    """Catch-up over 10 rows from features, then 3 chained steps from the head's own hidden, on
    the runtime's time-major cache: logits and hidden rows equal the reference's (the reference
    is fed its own hidden and tokens, so the fp16 head's error does not compound)."""
    target, info, _, embed = pair
    graph = heads[precision]
    assert graph.spec.kv_layout == contract.TIME_MAJOR and graph.spec.is_head
    assert graph.spec.kv_dtype == ("float16" if precision == "fp16" else "float32")
    model = OrtModel(graph.path, graph.spec, 128, SessionConfig(threads=1))
    assert_head_follows_reference(
        model, target, info, embed, IDS, lambda got, want: assert_close_at(got, want, precision)
    )


def test_portable_head_catches_up_after_rollback(pair, heads):
    """Rows written by chained steps are dropped by a cursor move; catching up again with real
    features gives the reference's rows (stale cache rows past the cursor are never read)."""
    target, info, _, embed = pair
    graph = heads["fp32"]
    model = OrtModel(graph.path, graph.spec, 128, SessionConfig(threads=1))
    assert_head_catches_up_after_rollback(model, target, info, embed, IDS, TOL)


def test_portable_head_uses_standard_ops_and_the_contract_names(heads):
    from specexport.plan.trtcheck import check_trt

    for precision, graph in heads.items():
        proto = onnx.load(str(graph.path), load_external_data=False)
        assert {n.domain for n in proto.graph.node} <= {"", "ai.onnx"}, precision
        assert [i.name for i in proto.graph.input] == graph.spec.input_names()
        assert [o.name for o in proto.graph.output] == graph.spec.output_names()
        assert graph.spec.output_names()[2:] == ["new_key_0", "new_value_0"]
        report = check_trt(graph.path, "10.3")
        assert report.ok, report.errors
        assert set(report.dynamic_dims) == {"seq", "past", "rows"}
        assert report.op_counts["MatMul"] >= 8 and report.op_counts["Softmax"] == 1


def test_portable_head_refuses_int8(pair, tmp_path):
    _, _, head, embed = pair
    with pytest.raises(ValueError, match="portable head precision 'int8': expected one of fp32, fp16"):
        build_eagle3_head(head, embed, tmp_path / "x", 128, precision="int8", kv_layout=contract.TIME_MAJOR)


def test_recipe_refuses_a_portable_int8_head(tmp_path):
    from tiny import write_recipe

    from specexport.recipe.load import RecipeError, load_recipe

    draft = {"eagle3": {"model": str(tmp_path / "head"), "precision": "int8"}}
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(tmp_path / "r.yaml", tmp_path / "t", draft, graph="portable"))
    message = str(err.value)
    assert "draft.eagle3.precision = 'int8' needs graph: fused" in message and "fp32, fp16" in message
    assert "\n" not in message
    for precision in ("fp32", "fp16"):  # the portable precisions are accepted
        draft["eagle3"]["precision"] = precision
        recipe = load_recipe(write_recipe(tmp_path / "r.yaml", tmp_path / "t", draft, graph="portable"))
        assert recipe.graph == "portable" and recipe.draft.kind == "eagle3"


# --------------------------------------------------------------------------- the artifact


def test_portable_artifact_records_the_head_and_passes_trt_check(tiny_artifacts):
    from specexport.plan.trtcheck import check_artifact

    root = tiny_artifacts["eagle3-portable"]
    raw = json.loads((root / "manifest.json").read_text())
    assert raw["contract_version"] == "1.3" and raw["speculation"]["proposer"] == "eagle"
    draft, target = raw["draft"], raw["target"]
    assert draft["kind"] == "eagle3_head" and draft["kv_layout"] == "time_major"
    assert target["kv_layout"] == "time_major"
    assert target["feature_layers"] == [1, 0, 1] and target["feature_width"] == 3 * 64
    assert 0 <= draft["validation"]["target_agreement"] <= 1
    report = check_artifact(root, "10.3")
    assert set(report.graphs) == {"target", "draft"}
    assert report.ok, report.errors
    assert any("EAGLE-3 head" in line for line in report.lines())


def test_a_portable_head_declared_at_contract_1_2_is_refused(tiny_artifacts, tmp_path):
    """A time_major head needs contract 1.3 (a 1.2 runtime only knows in-place heads): a manifest
    declaring 1.2 for one is a typed ArtifactError naming both versions, not a failure later."""
    import shutil

    from specexport_runtime.api import open_artifact
    from specexport_runtime.errors import ArtifactError

    root = tmp_path / "a"
    shutil.copytree(tiny_artifacts["eagle3-portable"], root)
    raw = json.loads((root / "manifest.json").read_text())
    raw["contract_version"] = "1.2"
    (root / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(ArtifactError, match=r"needs contract 1\.3, but the manifest declares 1\.2"):
        open_artifact(root, verify=False)


PROMPTS = ["def add(a, b):", "The quick brown fox", [40, 41, 42, 43, 44] * 4]


@pytest.mark.parametrize("proposer", ["eagle", "hybrid"])
def test_greedy_portable_eagle_equals_target_only(gens, proposer):
    gen = gens("eagle3-portable")
    assert not gen.target.spec.layout.in_place and not gen.draft.spec.layout.in_place and gen.draft.spec.is_head
    corrections = 0
    for prompt in PROMPTS:
        base = gen.generate(prompt, max_new_tokens=40, speculative=False)
        for gamma in (1, 2, 4, 8):
            result = gen.generate(prompt, max_new_tokens=40, proposer=proposer, gamma=gamma)
            assert result.token_ids == base.token_ids, (prompt, gamma)
            s = result.stats
            assert s.rounds == s.corrections + s.bonus and s.new_tokens == len(result.token_ids)
            corrections += s.corrections
    assert corrections > 0  # a random head is wrong often: rollbacks happen
