"""EAGLE-3 heads end to end: the target graph's features and the head graph against independent
references (transformers' output_hidden_states; tests/eagle_heads.py's reference forward), and
the `eagle` proposer's exactness (greedy token for token, sampling in law) on tiny models with a
random head, which drafts wrong often enough to exercise corrections and rollback.

Tolerances: float32 graphs against float32 PyTorch, the same weights: 1e-4 on logits and hidden
rows (summation order only). Lower-precision heads against the same float32 reference, relative to
the largest |value| of the compared rows: fp16 2e-2 (fp16 weights, activations and cache), int8
8e-2 (int8 round-to-nearest weights and int8 activations, accuracy level 4)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from eagle_heads import PROBE_IDS as IDS
from eagle_heads import (
    TOL,
    assert_close_at,
    assert_head_catches_up_after_rollback,
    assert_head_follows_reference,
    make_tiny_head_folder,
    target_features,
    tiny_target_and_head,
)
from tiny import make_model

from specexport.build.validate import FeedRunner
from specexport.graphs.decoder import build_decoder
from specexport.graphs.eagle import build_eagle3_head
from specexport_runtime.engine import OrtModel, SessionConfig


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target model, head folder info, loaded head, target graph, head graph)."""
    root = tmp_path_factory.mktemp("eagle")
    target, info, head = tiny_target_and_head(root)
    assert head.config.layer_ids == tuple(info["layer_ids"])
    t_graph = build_decoder(target, root / "target", 128, feature_layers=head.config.layer_ids, pad_attention=True)
    h_graph = build_eagle3_head(head, target.get_input_embeddings().weight.detach().float(), root / "draft", 128)
    return target, info, head, t_graph, h_graph


def test_target_features_are_the_entering_residual_streams(pair):
    target, info, head, t_graph, _ = pair
    runner = FeedRunner(t_graph.path, t_graph.spec)
    runner.run(IDS, [len(IDS) - 1])
    want = target_features(target, IDS, info["layer_ids"]).numpy()  # [S, 3 H_t], transformers
    assert runner.features.shape == want.shape
    np.testing.assert_allclose(runner.features, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8"])
def test_head_graph_matches_the_reference_forward(pair, tmp_path, precision):
    """Catch-up over 10 rows from features, then 3 chained steps from the head's own hidden, on
    the runtime's in-place cache: logits and hidden rows equal the reference's (the reference is
    fed its own hidden and tokens, so a low-precision head's error does not compound)."""
    target, info, head, t_graph, h_graph = pair
    embed = target.get_input_embeddings().weight.detach().float()
    if precision != "fp32":
        h_graph = build_eagle3_head(head, embed, tmp_path / precision, 128, precision=precision)
        assert h_graph.spec.kv_dtype == ("float16" if precision == "fp16" else "float32")
    model = OrtModel(h_graph.path, h_graph.spec, 128, SessionConfig(threads=1))
    assert_head_follows_reference(
        model, target, info, embed, IDS, lambda got, want: assert_close_at(got, want, precision)
    )


def test_low_precision_heads_are_smaller(pair, tmp_path):
    """int8 stores a quarter of fp32's bytes (+ scales), fp16 half."""
    target, info, head, _, h_graph = pair
    embed = target.get_input_embeddings().weight.detach().float()

    def size(result) -> int:
        return sum(f.stat().st_size for f in result.path.parent.iterdir())

    fp32 = size(h_graph)
    assert 0.45 < size(build_eagle3_head(head, embed, tmp_path / "fp16", 128, precision="fp16")) / fp32 < 0.55
    assert 0.25 < size(build_eagle3_head(head, embed, tmp_path / "int8", 128, precision="int8")) / fp32 < 0.36
    with pytest.raises(ValueError, match="head precision 'int4'"):
        build_eagle3_head(head, embed, tmp_path / "x", 128, precision="int4")


def test_head_graph_catches_up_after_rollback(pair):
    """Rows written by chained steps are dropped by a cursor move; catching up again with real
    features gives the reference's rows (stale cache rows past the cursor are never read)."""
    target, _, _, _, h_graph = pair
    embed = target.get_input_embeddings().weight.detach().float()
    model = OrtModel(h_graph.path, h_graph.spec, 128, SessionConfig(threads=1))
    assert_head_catches_up_after_rollback(model, target, pair[1], embed, IDS, TOL)


# --------------------------------------------------------------------------- the artifact


def test_artifact_records_the_head(tiny_artifacts):
    root = tiny_artifacts["eagle3"]
    raw = json.loads((root / "manifest.json").read_text())
    assert raw["contract_version"] == "1.2" and raw["speculation"]["proposer"] == "eagle"
    draft, target = raw["draft"], raw["target"]
    assert draft["kind"] == "eagle3_head" and draft["vocab_map"] == "draft/vocab_map.npy"
    assert target["feature_layers"] == [1, 0, 1] and target["feature_width"] == 3 * 64
    assert draft["validation"]["layer_ids"] == [1, 0, 1] and 0 <= draft["validation"]["target_agreement"] <= 1
    assert "draft/vocab_map.npy" in raw["files"]


PROMPTS = ["def add(a, b):", "The quick brown fox", [40, 41, 42, 43, 44] * 4]


@pytest.mark.parametrize("proposer", ["eagle", "hybrid"])
def test_greedy_eagle_equals_target_only(gens, proposer):
    gen = gens("eagle3")
    corrections = 0
    for prompt in PROMPTS:
        base = gen.generate(prompt, max_new_tokens=40, speculative=False)
        for gamma in (1, 2, 4, 8, None):
            result = gen.generate(prompt, max_new_tokens=40, proposer=proposer, gamma=gamma)
            assert result.token_ids == base.token_ids, (prompt, gamma)
            s = result.stats
            assert s.rounds == s.corrections + s.bonus and s.new_tokens == len(result.token_ids)
            corrections += s.corrections
    assert corrections > 0  # a random head is wrong often: rollbacks happen


def test_eagle_needs_a_head(gens):
    from specexport_runtime.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="'draft' needs a draft model; this artifact's draft is an EAGLE-3 head"):
        gens("eagle3").generate([5, 6, 7], proposer="draft", max_new_tokens=4)


@pytest.mark.parametrize("defect, message", [("layers", "layer"), ("d2t", "d2t"), ("hidden", "fc.weight")])
def test_bad_head_fails_the_build_and_leaves_nothing(tmp_path, defect, message):
    """A head with layer ids past the target's depth, a d2t pointing outside the target's
    vocabulary, or the wrong hidden width: a typed one-line error and no artifact folder."""
    from safetensors.torch import load_file, save_file
    from tiny import save_hf_folder, write_recipe

    from specexport.build.artifact import build_artifact
    from specexport.errors import SpecExportError
    from specexport.recipe.load import load_recipe

    target = make_model("llama")
    target_dir = save_hf_folder(target, tmp_path / "hf")
    info = make_tiny_head_folder(
        tmp_path / "head", target, draft_vocab=160, seed=0, layer_ids=(1, 0, 7) if defect == "layers" else None
    )
    weights = tmp_path / "head" / "model.safetensors"
    tensors = load_file(str(weights))
    if defect == "d2t":
        tensors["d2t"] = tensors["d2t"].clone()
        tensors["d2t"][-1] = 10_000
    if defect == "hidden":
        tensors["fc.weight"] = tensors["fc.weight"][:, :-8].contiguous()
    save_file(tensors, str(weights))
    recipe = load_recipe(
        write_recipe(
            tmp_path / "r.yaml", target_dir, {"eagle3": {"model": str(info["folder"])}}, name="bad-head", graph="fused"
        )
    )
    with pytest.raises(SpecExportError) as err:
        build_artifact(recipe, tmp_path / "out")
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))
