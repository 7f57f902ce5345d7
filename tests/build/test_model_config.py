"""The normalized config (specexport.models.config) and the closed list of config features.

* every key of every registered family's transformers config class is classified (a shape, an
  inert key or a feature), so a new transformers key cannot slip through unread;
* config.json files as transformers 4.x wrote them (rope_scaling / rope_theta /
  rope_local_base_freq) and as 5.x writes them normalize to the same facts;
* every feature value the exporter does not implement is refused by `specexport build` with
  one line naming the key and value, from config.json alone: the folders below hold no
  weights and no tokenizer, so reaching any load would fail differently.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner
from tiny import TINY_CONFIGS, write_recipe
from transformers import AutoConfig, PretrainedConfig

from specexport.cli.main import cli
from specexport.models.architectures import ARCHITECTURES, UnsupportedArchitecture
from specexport.models.config import UnsupportedConfig, config_from_dict, normalize
from specexport.models.config_keys import FEATURE_OF_KEY, INERT_KEYS, SHAPE_KEYS

BASE_KEYS = set(PretrainedConfig().to_dict())


UNREAD = {"nemotron_h": {"sliding_window"}}  # NemotronHConfig has it; its attention never windows (refused when set)


@pytest.mark.parametrize("family", sorted(ARCHITECTURES))
def test_every_config_key_of_a_family_is_classified(family):
    arch = ARCHITECTURES[family]
    config = AutoConfig.for_model(family)
    if arch.text_config:
        config = config.text_config
    keys = set(config.to_dict()) - BASE_KEYS
    unclassified = sorted(keys - SHAPE_KEYS - INERT_KEYS - set(FEATURE_OF_KEY))
    assert not unclassified, f"{family}: config keys {unclassified} are neither shapes, inert nor features"
    # a feature a family's config class carries is one it implements, or one no family does;
    # layer_types also carries the mixer pattern (ArchSpec.layer_kinds refuses kinds a family lacks)
    implemented = set().union(*(a.features for a in ARCHITECTURES.values()))
    mixers = any(kind != "attention" for _, kind in arch.layer_kinds)
    unread = UNREAD.get(family, set())  # carried by the config class, read by none of its modules
    for key in (keys & set(FEATURE_OF_KEY)) - ({"layer_types"} if mixers else set()) - unread:
        feature = FEATURE_OF_KEY[key]
        assert feature in arch.features or feature not in implemented or key in ("attention_bias", "mlp_bias"), (
            family,
            key,
        )


def _raw(family: str, **overrides) -> dict:
    data = {**TINY_CONFIGS[family], "model_type": family, **overrides}
    return {k: v for k, v in data.items() if v is not None}


def test_transformers_4_rope_scaling_is_read():
    """A Llama 3.1 config.json as published (transformers 4.x keys)."""
    legacy = _raw(
        "llama",
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    modern = _raw(
        "llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    )
    a, b = normalize(config_from_dict(legacy), 256), normalize(config_from_dict(modern), 256)
    assert a == b
    assert a.rope("all").kind == "llama3" and a.rope("all").theta == 500000.0


def test_transformers_4_longrope_is_bounded_by_its_original_context():
    """Phi-3-mini-128k style: a 4.x `rope_scaling` dict with `type` (not `rope_type`)."""
    raw = _raw(
        "phi3",
        max_position_embeddings=4096,
        original_max_position_embeddings=128,
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8},
    )
    config = config_from_dict(raw)
    assert normalize(config, 128).rope("all").kind == "longrope"
    with pytest.raises(UnsupportedConfig, match=r"'longrope'.*original_max_position_embeddings = 128.*256"):
        normalize(config, 256)


def test_transformers_4_dynamic_rope_is_bounded_by_max_position_embeddings():
    config = config_from_dict(
        _raw("llama", max_position_embeddings=128, rope_scaling={"type": "dynamic", "factor": 2.0})
    )
    assert normalize(config, 128).rope("all").bound == 128
    with pytest.raises(UnsupportedConfig, match=r"'dynamic'.*128.*256"):
        normalize(config, 256)


def test_gemma3_4b_legacy_keys_give_two_rotary_tables_and_the_5_to_1_pattern():
    """Gemma 3 4B's text config as 4.x wrote it: rope_theta (global), rope_local_base_freq,
    linear scaling on the global table only, sliding_window_pattern 6."""
    text = dict(
        TINY_CONFIGS["gemma3_text"],
        model_type="gemma3_text",
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window_pattern=6,
        num_hidden_layers=12,
    )
    del text["rope_parameters"]
    norm = normalize(config_from_dict(text), 256)
    assert [layer.window for layer in norm.layers] == [16] * 5 + [None] + [16] * 5 + [None]
    assert [layer.rope for layer in norm.layers] == ["sliding_attention"] * 5 + ["full_attention"] + [
        "sliding_attention"
    ] * 5 + ["full_attention"]
    assert norm.rope("sliding_attention").theta == 10000.0 and norm.rope("sliding_attention").kind == "default"
    assert norm.rope("full_attention").theta == 1000000.0 and norm.rope("full_attention").kind == "linear"
    assert norm.head_rope_theta == 1000000.0
    assert norm.attn_scale == 24**-0.5 and norm.arch.qk_norm == "head"


def test_multimodal_gemma3_normalizes_its_text_config():
    from tiny import tiny_config

    norm = normalize(tiny_config("gemma3"), 256)
    assert norm.family == "gemma3" and norm.arch.decoder == "model.language_model"
    assert replace(norm, family="gemma3_text") == normalize(tiny_config("gemma3_text"), 256)


@pytest.mark.parametrize("use, layers", [(False, [None, None]), (True, [None, 16])])
def test_qwen2_use_sliding_window_is_honoured(use, layers):
    raw = _raw("qwen2", use_sliding_window=use, sliding_window=16, max_window_layers=1)
    assert [layer.window for layer in normalize(config_from_dict(raw), 256).layers] == layers


def test_phi3_4k_window_covers_every_layer():
    norm = normalize(config_from_dict(_raw("phi3", sliding_window=2047)), 4096)
    assert [layer.window for layer in norm.layers] == [2047, 2047] and norm.long_range_length(4096) == 2047 + 16


def test_smollm3_nope_granite_multipliers_gemma2_softcaps():
    smol = normalize(config_from_dict(_raw("smollm3", num_hidden_layers=8, no_rope_layer_interval=4)))
    assert [layer.rope for layer in smol.layers] == ["all", "all", "all", None] * 2
    granite = normalize(config_from_dict(_raw("granite")))
    assert (granite.embedding_multiplier, granite.residual_multiplier, granite.attn_scale, granite.logits_divisor) == (
        12.0,
        0.22,
        0.05,
        8.0,
    )
    gemma2 = normalize(config_from_dict(_raw("gemma2")))
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (5.0, 8.0)
    assert [layer.window for layer in gemma2.layers] == [16, None]


# --------------------------------------------------------------------------- refusals through the CLI

REFUSALS = [  # (family, config overrides, words the one-line error must contain)
    ("llama", dict(sliding_window=4096), ["'sliding_window'", "4096", "'llama'"]),
    ("llama", dict(attn_logit_softcapping=30.0), ["'attn_logit_softcapping'", "30.0"]),
    ("llama", dict(logits_scaling=8.0), ["'logits_scaling'", "8.0"]),
    ("llama", dict(no_rope_layers=[1, 0]), ["'no_rope_layers'", "[1, 0]"]),
    ("llama", dict(partial_rotary_factor=0.5), ["'partial_rotary_factor'", "0.5"]),
    ("llama", dict(hidden_act="relu6"), ["'hidden_act'", "'relu6'"]),
    ("llama", dict(rope_scaling={"rope_type": "mrope", "factor": 2.0}), ["'mrope'", "rope_scaling"]),
    (
        "llama",
        dict(max_position_embeddings=128, rope_scaling={"type": "dynamic", "factor": 2.0}),
        ["'dynamic'", "128", "256"],
    ),
    (
        "phi3",
        dict(
            max_position_embeddings=4096,
            original_max_position_embeddings=128,
            rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8},
        ),
        ["'longrope'", "128", "256"],
    ),
    ("mistral", dict(num_local_experts=8), ["'num_local_experts'", "8", "mixture of experts"]),
    ("gemma3_text", dict(use_bidirectional_attention=True), ["'use_bidirectional_attention'", "True"]),
    ("gemma", dict(query_pre_attn_scalar=24), ["'query_pre_attn_scalar'", "24"]),
    ("qwen2", dict(clip_qkv=8.0), ["'clip_qkv'", "8.0"]),
    # Gemma 4 26B-A4B: a mixture-of-experts block beside each MLP
    (
        "gemma4_text",
        dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32),
        ["'enable_moe_block'", "True", "mixture of experts"],
    ),
    ("gemma4_text", dict(use_bidirectional_attention="all"), ["'use_bidirectional_attention'", "'all'"]),
    # Gemma 4 31B: keys as values with K/V heads of their own on the full-attention layers
    (
        "gemma4_text",
        dict(attention_k_eq_v=True, num_global_key_value_heads=2),
        ["'per_layer_config'", "2 K/V heads", "num_global_key_value_heads"],
    ),
]


def _config_only_folder(root: Path, family: str, overrides: dict) -> Path:
    """A model folder holding config.json and nothing else (no weights, no tokenizer)."""
    folder = root / "model"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(_raw(family, **overrides)), encoding="utf-8")
    return folder


def _build(tmp_path: Path, folder: Path, graph: str = "portable"):
    recipe = write_recipe(
        tmp_path / "r.yaml", folder, {"proposer": "ngram", "ngram_sizes": [3, 2, 1]}, graph=graph, max_context=256
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["build", str(recipe), "-o", str(out), "--quiet"], catch_exceptions=False)
    return result, out


def _one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.stderr
    return lines[0]


@pytest.mark.parametrize("family, overrides, words", REFUSALS, ids=[f"{f}-{next(iter(o))}" for f, o, _ in REFUSALS])
def test_unimplemented_feature_is_refused_before_any_weight(tmp_path, family, overrides, words):
    folder = _config_only_folder(tmp_path, family, overrides)
    result, out = _build(tmp_path, folder)
    line = _one_error_line(result)
    for word in words:
        assert word in line, (word, line)
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_the_refusal_folder_would_otherwise_fail_at_loading(tmp_path):
    """The control: the same config-only folder with an implemented config gets past the check
    and fails where weights or the tokenizer are read, so the refusals above came first."""
    folder = _config_only_folder(tmp_path, "llama", {})
    result, _ = _build(tmp_path, folder)
    line = _one_error_line(result)
    assert "tokenizer" in line or "weight" in line or "model" in line, line
    assert "config key" not in line


def test_fused_partial_rotary_width_is_refused_before_any_weight(tmp_path):
    """GroupQueryAttention needs rotary_dim / 2 to be a multiple of 8: 0.75 of head_dim 16 is 12."""
    folder = _config_only_folder(tmp_path, "phi3", dict(partial_rotary_factor=0.75))
    result, out = _build(tmp_path, folder, graph="fused")
    line = _one_error_line(result)
    assert "partial rotary over 12 of 16" in line and "portable" in line
    assert not out.exists()


def test_unknown_architecture_is_refused_before_any_weight(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "opt", "hidden_size": 64}), encoding="utf-8")
    result, _ = _build(tmp_path, folder)
    line = _one_error_line(result)
    assert "'opt'" in line and all(name in line for name in ARCHITECTURES)


def test_config_from_dict_refuses_unknown_architecture():
    with pytest.raises(UnsupportedArchitecture):
        config_from_dict({"model_type": "bert"})
