"""The Gemma 4 assistant end to end: a random-init Gemma4AssistantForCausalLM saved with
save_pretrained, named by a recipe as any draft model (`draft: {model: PATH}`), built beside a
tiny Gemma 4 target in both graph forms and run by the `assistant` proposer. Greedy output with
it equals target-only output and transformers' own assisted generation (Gemma4Assistant through
SinglePositionMultiTokenCandidateGenerator); sampled output follows the target's law; an
assistant whose backbone width differs from the target's is refused in one line before anything
is written."""

from __future__ import annotations

import json

import pytest
import torch
from assistant_models import make_assistant, save_assistant
from exactness_support import check_first_two_tokens_follow_target
from tiny import make_model, save_hf_folder, write_recipe

from specexport.build.artifact import build_artifact
from specexport.models.assistant import AssistantMismatch
from specexport.recipe.load import load_recipe
from specexport_runtime.api import load

PROMPTS = [[7, 150, 33, 299, 12, 260, 5], [40, 41, 42, 43, 44] * 4, [17, 88, 203, 5, 61, 144, 9, 250, 33, 71]]
MAX_NEW = 40  # past the assistant's window of 8 and the target's of 16


@pytest.fixture(scope="module")
def models():
    return make_model("gemma4_text"), make_assistant()


@pytest.fixture(scope="module", params=["portable", "fused"])
def built(request, tmp_path_factory, models):
    target, assistant = models
    work = tmp_path_factory.mktemp(f"assistant-{request.param}")
    target_dir = save_hf_folder(target, work / "target-hf")
    assistant_dir = save_assistant(assistant, work / "assistant-hf")
    recipe = write_recipe(work / "recipe.yaml", target_dir, {"model": str(assistant_dir)}, graph=request.param)
    report = build_artifact(load_recipe(recipe), work / "artifact")
    return report, load(report.output)


def test_the_manifest_records_the_assistant(built):
    report, gen = built
    data = json.loads((report.output / "manifest.json").read_text())
    draft = data["draft"]
    assert draft["kind"] == "assistant" and draft["shared_kv"] == [2, 3] and draft["hidden_width"] == 64
    assert data["target"]["feature_layers"] == [7] and data["speculation"]["proposer"] == "assistant"
    assert "assistant" in data["graph_features"] and data["contract_version"] == "1.12"
    assert draft["validation"]["max_abs_diff"] < 1e-4 and draft["validation"]["argmax_agreement"] == 1.0


@pytest.mark.parametrize("gamma", [1, 3, None])
def test_greedy_output_equals_target_only(built, gamma):
    _, gen = built
    for ids in PROMPTS:
        spec = gen.generate(ids, max_new_tokens=MAX_NEW, gamma=gamma)
        base = gen.generate(ids, max_new_tokens=MAX_NEW, speculative=False)
        assert spec.token_ids == base.token_ids
        assert spec.stats.accepted <= spec.stats.drafted
        assert spec.stats.drafted > 0 or gamma is None  # the adaptive policy may turn a poor draft off


def test_greedy_output_equals_transformers_assisted_generation(built, models):
    """transformers' generate(assistant_model=...) with greedy settings (its own reference of the
    assistant's drafting) gives the same tokens as our greedy speculative output."""
    _, gen = built
    target, assistant = models
    assistant.generation_config.num_assistant_tokens = 3
    for ids in PROMPTS:
        with torch.no_grad():
            out = target.generate(
                torch.tensor([ids]),
                assistant_model=assistant,
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        want = out[0, len(ids) :].tolist()
        got = gen.generate(ids, max_new_tokens=MAX_NEW, gamma=3).token_ids
        n = len(got)  # ours stops at eos; transformers was told not to
        assert got == want[:n]


@pytest.mark.slow
def test_sampling_follows_the_targets_law(built):
    _, gen = built
    check_first_two_tokens_follow_target(gen, PROMPTS[0], "assistant", N=1000)


def test_a_backbone_mismatch_is_refused_before_anything_is_written(tmp_path, models):
    target, _ = models
    target_dir = save_hf_folder(target, tmp_path / "target-hf")
    wrong = save_assistant(make_assistant(backbone=48), tmp_path / "assistant-hf")
    recipe = write_recipe(tmp_path / "recipe.yaml", target_dir, {"model": str(wrong)})
    out = tmp_path / "out"
    with pytest.raises(AssistantMismatch) as info:
        build_artifact(load_recipe(recipe), out)
    message = str(info.value)
    assert "backbone_hidden_size 48 is not the target's hidden_size 64" in message and "\n" not in message
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "assistant-hf",
        "recipe.yaml",
        "target-hf",
    ]


def test_a_hub_id_is_recognised_by_its_config_alone(tmp_path, models, monkeypatch):
    # the recipe names the published hub id; huggingface_hub (faked: no network here) serves its
    # config.json first, and the mismatch is found before any weight is fetched or written
    import huggingface_hub

    target, _ = models
    target_dir = save_hf_folder(target, tmp_path / "target-hf")
    hub = save_assistant(make_assistant(backbone=48), tmp_path / "hub-cache")
    fetched = []

    def config_only(repo_id, filename, revision=None, **kw):
        assert repo_id == "google/gemma-4-e2b-it-assistant" and filename == "config.json"
        fetched.append(filename)
        return str(hub / filename)

    def weights(*a, **kw):
        raise AssertionError("weights fetched before the check")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", config_only)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", weights)
    recipe = write_recipe(tmp_path / "recipe.yaml", target_dir, {"model": "google/gemma-4-e2b-it-assistant"})
    with pytest.raises(AssistantMismatch, match="backbone_hidden_size 48 is not the target's hidden_size 64"):
        build_artifact(load_recipe(recipe), tmp_path / "out")
    assert fetched and not (tmp_path / "out").exists()
