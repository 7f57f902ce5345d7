"""The `mtp` proposer end to end: a tiny Qwen3.5 checkpoint whose safetensors carry an MTP layer
(tests/mtp_checkpoints.py), built with `draft: {mtp: {}}` in both graph forms. Greedy output with
it equals target-only output, sampled output follows the target's law, the manifest records the
proposer, and a checkpoint without MTP layers is refused in one line before anything is written."""

from __future__ import annotations

import json

import pytest
from exactness_support import check_first_two_tokens_follow_target
from tiny import build_tiny_artifact, make_model, save_hf_folder, write_recipe

from specexport.build.artifact import build_artifact
from specexport.models.mtp import MtpUnavailable
from specexport.recipe.load import load_recipe
from specexport_runtime.api import load

PROMPTS = [[7, 150, 33, 299, 12, 260, 5], [40, 41, 42, 43, 44] * 4, [17, 88, 203, 5, 61, 144, 9, 250, 33, 71]]
MAX_NEW = 40


@pytest.fixture(scope="module", params=["mtp", "mtp-fused"])
def built(request, tmp_path_factory):
    out = build_tiny_artifact(tmp_path_factory.mktemp(request.param), request.param)
    return out, load(out)


def test_the_manifest_records_the_mtp_head(built):
    out, _ = built
    data = json.loads((out / "manifest.json").read_text())
    draft = data["draft"]
    assert draft["kind"] == "mtp" and draft["feature_width"] == draft["hidden_width"] == 64
    assert data["target"]["feature_layers"] == [4] and data["speculation"]["proposer"] == "mtp"
    assert "mtp_head" in data["graph_features"] and data["contract_version"] == "1.12"
    assert draft["validation"]["max_abs_diff"] < 1e-4 and draft["validation"]["argmax_agreement"] == 1.0


@pytest.mark.parametrize("gamma", [1, 3, None])
def test_greedy_output_equals_target_only(built, gamma):
    _, gen = built
    accepted = 0
    for ids in PROMPTS:
        spec = gen.generate(ids, max_new_tokens=MAX_NEW, gamma=gamma, proposer="mtp")
        base = gen.generate(ids, max_new_tokens=MAX_NEW, speculative=False)
        assert spec.token_ids == base.token_ids
        assert spec.stats.accepted <= spec.stats.drafted
        assert set(spec.stats.by_source) <= {"mtp"}
        accepted += spec.stats.accepted
    assert accepted > 0 or gamma is None  # the echoing head is right where the target repeats


def test_rounds_accept_some_drafts_and_reject_others(built):
    """Both rollback paths run: rounds that keep drafts and rounds that drop chained rows."""
    _, gen = built
    runs = [gen.generate(ids, max_new_tokens=MAX_NEW, gamma=3, proposer="mtp").stats for ids in PROMPTS]
    assert 0 < sum(s.accepted for s in runs) < sum(s.drafted for s in runs)


@pytest.mark.slow
def test_sampling_follows_the_targets_law(built):
    _, gen = built
    check_first_two_tokens_follow_target(gen, PROMPTS[0], "mtp", N=1000)


def test_a_checkpoint_without_mtp_layers_is_refused_before_anything_is_written(tmp_path):
    target_dir = save_hf_folder(make_model("qwen3_5_text"), tmp_path / "target-hf")
    recipe = write_recipe(tmp_path / "recipe.yaml", target_dir, {"mtp": {}})
    out = tmp_path / "out"
    with pytest.raises(MtpUnavailable) as info:
        build_artifact(load_recipe(recipe), out)
    assert "has none" in str(info.value) and "\n" not in str(info.value)
    assert not out.exists()


def test_a_build_with_another_draft_offers_the_mtp_layer(tmp_path):
    from mtp_checkpoints import add_mtp

    target = make_model("qwen3_5_text")
    target_dir = save_hf_folder(target, tmp_path / "target-hf")
    add_mtp(target_dir, target.config)
    recipe = write_recipe(tmp_path / "recipe.yaml", target_dir, {"proposer": "ngram", "ngram_sizes": [2, 1]})
    lines: list[str] = []
    build_artifact(load_recipe(recipe), tmp_path / "out", validate=False, progress=lines.append)
    offered = [line for line in lines if "MTP layer" in line]  # 11 tensors of the layer, fc and 3 norms
    assert offered == [
        "the target checkpoint carries 1 MTP layer(s) (15 mtp.* tensors): `draft: {mtp: {}}` drafts with them"
        " (proposer mtp)"
    ]
