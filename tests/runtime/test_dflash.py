"""The dflash proposer end to end: a tiny Qwen3 target and a random-init DFlash drafter (the
layout transformers' DFlash generator reads) built into an artifact from a recipe naming the
drafter as `draft: {model: PATH}`; greedy output equals target-only output and transformers' own
DFlash-assisted generate, and sampled rounds keep the target's distribution of the first two tokens."""

from __future__ import annotations

import json

import pytest
import torch
from dflash_support import BLOCK, MASK, tiny_drafter, tiny_target

PROMPTS = [[1, 5, 9, 33, 100, 7, 8, 2, 44], [40, 41, 42, 43, 44] * 4, [3, 250, 17, 90, 61]]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from tiny import save_hf_folder, write_recipe

    from specexport.build.artifact import build_artifact
    from specexport.recipe.load import load_recipe

    root = tmp_path_factory.mktemp("dflash-artifact")
    target = tiny_target()
    drafter = tiny_drafter(root / "drafter")
    target_dir = save_hf_folder(target, root / "target-hf")
    recipe = load_recipe(
        write_recipe(root / "r.yaml", target_dir, {"model": str(root / "drafter"), "precision": "fp32"})
    )
    assert recipe.draft.dflash and recipe.proposer == "dflash"
    build_artifact(recipe, root / "artifact")
    return target, drafter, root / "artifact"


@pytest.fixture(scope="module")
def gen(built):
    from specexport_runtime.api import load

    return load(built[2], threads=1)


def test_artifact_records_the_drafter(built):
    raw = json.loads((built[2] / "manifest.json").read_text())
    draft, target = raw["draft"], raw["target"]
    assert raw["contract_version"] == "1.12" and raw["speculation"]["proposer"] == "dflash"
    assert "dflash_block" in raw["graph_features"]
    assert draft["kind"] == "dflash_block" and draft["block_size"] == BLOCK and draft["mask_token_id"] == MASK
    assert target["feature_layers"] == [1, 3] and target["feature_width"] == draft["feature_width"] == 128
    assert 0 <= draft["validation"]["target_agreement"] <= 1


def test_greedy_dflash_equals_target_only_and_transformers(built, gen):
    target, drafter, _ = built
    corrections = 0
    for prompt in PROMPTS:
        base = gen.generate(prompt, max_new_tokens=40, speculative=False)
        with torch.no_grad():
            hf = target.generate(
                torch.tensor([prompt]),
                max_new_tokens=40,
                do_sample=False,
                assistant_model=drafter,
                speculation_type="dflash",
                eos_token_id=None,
            )
        want = hf[0, len(prompt) :].tolist()
        for gamma in (1, 2, 3, 8):
            result = gen.generate(prompt, max_new_tokens=40, proposer="dflash", gamma=gamma)
            assert result.token_ids == base.token_ids, (prompt, gamma)
            s = result.stats
            assert s.rounds == s.corrections + s.bonus and s.new_tokens == len(result.token_ids)
            corrections += s.corrections
        assert base.token_ids == want[: len(base.token_ids)], prompt
    assert corrections > 0  # a random drafter is wrong often: rollbacks happen


def test_dflash_needs_its_drafter():
    from specexport_runtime import registry
    from specexport_runtime.errors import InvalidArgument

    assert registry.get("dflash").needs == ("dflash_block",)
    assert registry.recipe_default("dflash_block") == "dflash"
    with pytest.raises(InvalidArgument, match="needs an artifact with a DFlash block drafter"):
        registry.check_available("dflash", "eagle3_head")


@pytest.mark.slow  # ~8 s; the greedy DFlash checks stay in the default run
def test_sampled_dflash_keeps_the_targets_first_two_tokens(gens):
    """Each draft's q is its own block row's distribution: speculative sampling with those rows
    keeps the target's law of the first two tokens (chi-square against the exact law, and a TV
    bound against target-only samples; tests/runtime/exactness_support.py)."""
    from exactness_support import check_first_two_tokens_follow_target

    gen = gens("dflash")
    assert gen.draft.spec.kind == "dflash_block"
    check_first_two_tokens_follow_target(gen, PROMPTS[0], "dflash", N=1000)
