"""Hybrid families on the build side (feature recurrent_state): what a recipe may ask of a model
with recurrent layers, refused from config.json alone before any weight is read, and the
planner's count of their state beside the attention layers' K/V caches."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from tiny import TINY_CONFIGS, make_tokenizer, tiny_config, write_recipe

from specexport.cli.main import cli
from specexport.models.config import UnsupportedConfig, config_from_dict, normalize
from specexport.plan.sizes import known_config, kv_bytes, parameters, state_bytes, state_positions


def _config_only_folder(tmp_path, **overrides):
    """An LFM2 folder with config.json and a tokenizer but no weights: a build that read any
    weight would fail on the missing file, not with the refusal."""
    folder = tmp_path / "lfm2-config-only"
    folder.mkdir()
    tiny_config("lfm2", **overrides).save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("ask, named", [(dict(tree_verify=True), "tree_verify")])
def test_trees_are_refused_before_weights_load(tmp_path, ask, named):
    folder = _config_only_folder(tmp_path)
    recipe = write_recipe(tmp_path / "r.yaml", folder, {"proposer": "ngram", "ngram_sizes": [3, 2, 1]}, **ask)
    result = CliRunner().invoke(cli, ["build", str(recipe), "-o", str(tmp_path / "out"), "--quiet"])
    assert result.exit_code != 0
    line = result.output.strip().splitlines()[-1]
    assert "recurrent layers" in line and named in line and "lfm2" in line, result.output
    assert not (tmp_path / "out").exists()


def test_a_layer_type_the_family_lacks_is_refused_naming_it():
    raw = {**TINY_CONFIGS["lfm2"], "model_type": "lfm2"}
    raw["layer_types"] = ["conv", "linear_attention", "full_attention", "conv", "conv", "full_attention"]
    with pytest.raises(UnsupportedConfig, match="'linear_attention'.*'lfm2' does not implement"):
        normalize(config_from_dict(raw))
    raw["layer_types"] = ["conv"] * 6
    with pytest.raises(UnsupportedConfig, match="no layer attends"):
        normalize(config_from_dict(raw))


def test_lfm2_shapes_and_the_planners_state_count():
    """LFM2-1.2B as published: 1.17 B parameters; K/V on its 6 attention layers only, plus the
    10 conv layers' windows [2, 2048] at the runtime's kept positions."""
    c = known_config("LiquidAI/LFM2-1.2B")
    assert c.attention_layers == (2, 5, 8, 10, 12, 14)
    assert c.intermediate == 8192 and c.conv_kernel == 3
    assert parameters(c) == pytest.approx(1.17e9, rel=0.01)
    assert kv_bytes(c, "fp32", 4096) == 2 * 6 * 4096 * 8 * 64 * 4
    assert state_bytes(c, state_positions(8)) == 10 * 2 * 2048 * 4 * 20


def test_the_mamba2_dt_limit_is_applied_as_the_uncached_forward_does(tmp_path):
    """time_step_limit clamps dt in transformers' chunked scan (its cached one-token step does not:
    the graph follows the full forward, which validation compares against)."""
    import numpy as np
    import torch
    from tiny import export_portable, make_model

    from specexport_runtime.engine import OrtModel, SessionConfig

    ids = [int(t) for t in np.random.default_rng(0).integers(3, 300, size=40)]
    logits = {}
    for name, limit in (("clamped", {"time_step_limit": [0.05, 0.3]}), ("free", {})):
        model = make_model("granitemoehybrid", **limit)
        res = export_portable(model, tmp_path / name)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0].numpy()
        got = OrtModel(res.path, res.spec, 64, SessionConfig()).forward(ids, last_rows=len(ids))
        assert np.abs(got - ref).max() < 1e-4, name
        logits[name] = ref
    assert np.abs(logits["clamped"] - logits["free"]).max() > 1e-2, "the limit does not bite on this model"
