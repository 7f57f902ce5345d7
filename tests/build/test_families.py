"""Every family and feature variant end to end: `specexport build` (the CLI) in both graph forms,
then greedy generation past every window equals transformers' own greedy tokens, with
speculation off and on.

Each case saves a tiny random-init checkpoint shaped like the real one (tests/tiny.py: windows
of 16 tokens, softcaps that bite, NoPE layers, multipliers, partial rotary, longrope, ...),
builds it through the CLI with the n-gram proposer, and generates GENERATE tokens from a
prompt; transformers' `generate` on the same saved checkpoint is the independent reference.
Alongside: each feature changes transformers' own logits (so a graph that ignored it would
fail here), and a windowed fused artifact declares contract 1.4 and its windows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tiny import TINY_VARIANTS, make_model, make_tokenizer, save_hf_folder, tiny_names, write_recipe

from specexport.cli.main import cli
from specexport.graphs.decoder import fused_supported
from specexport_runtime.api import load

GENERATE = 72  # > every tiny window (16) + the prompt
PROMPT = "def add(a, b):\n    return a + b\nfor i in range(10):\n"
# feature variants of the hybrid families whose base family runs the same mixer by default: their
# cases run in .ci/run's second pass (marked slow), except the fused build and generation
# and Gemma 4's variants: the multimodal checkpoint's language model and keys as values
HYBRID_VARIANTS = {
    "lfm2-bias",
    "granitemoehybrid-rope",
    "falcon_h1-gate",
    "qwen3_5",
    "gemma4",
    "gemma4_text-keys-as-values",
}
PAIRS = [
    (name, graph)
    for name in tiny_names()
    for graph in ("portable", "fused")
    if graph == "portable" or fused_supported(TINY_VARIANTS.get(name, (name,))[0])
]
# fp16 and features of a hybrid family: the fused form by default (its mixers are the portable
# form's ops; only attention differs, which every other family checks in both forms)
HYBRIDS = {"lfm2", "granitemoehybrid", "qwen3_5_text", "nemotron_h", "falcon_h1"}
CASES = [
    pytest.param(n, g, marks=pytest.mark.slow) if n in HYBRID_VARIANTS or (n in HYBRIDS and g == "portable") else (n, g)
    for n, g in PAIRS
]
# the portable build of the Mamba2 and convolution hybrids too (17-34 s each; their mixers are
# ops both forms share, and the Gated DeltaNet family keeps its portable build by default)
SLOW_PORTABLE_BUILDS = HYBRID_VARIANTS | (HYBRIDS - {"qwen3_5_text"})
# and their fused builds: test_hybrid builds each of them and compares it with transformers
SLOW_BUILDS = HYBRIDS - {"qwen3_5_text"}
BUILD_CASES = [
    pytest.param(n, g, marks=pytest.mark.slow)
    if n in SLOW_BUILDS or (n in SLOW_PORTABLE_BUILDS and g == "portable")
    else (n, g)
    for n, g in PAIRS
]
IDS = [f"{n}-{g}" for n, g in PAIRS]


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


EOS = 2  # the tiny tokenizer's <|im_end|>, the checkpoints' eos_token_id


def _hf_greedy(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, up to (not including) the end of sequence as the runtime reports them."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=EOS, pad_token_id=0)
    new = out[0, len(ids) :].tolist()
    return new[: new.index(EOS)] if EOS in new else new


@pytest.mark.parametrize("name, graph", BUILD_CASES, ids=IDS)
def test_family_builds_and_generates_like_transformers(tmp_path, tokenizer, name, graph):
    from transformers import AutoModelForCausalLM

    folder = save_hf_folder(make_model(name), tmp_path / "hf", tokenizer)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        folder,
        {"proposer": "ngram", "ngram_sizes": [3, 2, 1]},
        graph=graph,
        max_context=160,
        name=f"tiny-{name}",
    )
    out = tmp_path / "artifact"
    result = CliRunner().invoke(
        cli, ["build", str(recipe), "-o", str(out), "--quiet", "--json"], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    family = TINY_VARIANTS.get(name, (name,))[0]
    # the Qwen3.5 checkpoint (vision and language) builds its language model, qwen3_5_text
    assert manifest["target"]["architecture"] == {"qwen3_5": "qwen3_5_text"}.get(family, family)

    ids = tokenizer(PROMPT)["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    want = _hf_greedy(reference, ids, GENERATE)
    gen = load(out)
    off = gen.generate(ids, max_new_tokens=GENERATE, speculative=False)
    on = gen.generate(ids, max_new_tokens=GENERATE, proposer="ngram", gamma=4)
    assert list(off.token_ids) == want, f"{name} {graph}: target-only differs from transformers"
    assert list(on.token_ids) == want, f"{name} {graph}: speculative output differs from transformers"
    assert on.stats.drafted > 0, "speculation never drafted: the verify path went untested"


FEATURE_OFF = {  # name -> config overrides that remove its feature (the reference must change)
    "mistral": dict(sliding_window=None),
    "gemma2": dict(attn_logit_softcapping=None, final_logit_softcapping=None),
    "gemma3_text": dict(sliding_window=100000),
    "smollm3": dict(no_rope_layer_interval=100),
    "granite": dict(embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0),
    "qwen2-window": dict(use_sliding_window=False),
    "phi3-4k": dict(sliding_window=None),
    "llama-llama3-rope": dict(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "llama-yarn": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "phi3-mini": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.75}),
    "smollm3-window": dict(use_sliding_window=False),
    "olmo3": dict(sliding_window=100000),
    "olmo3-yarn": dict(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
        }
    ),
    "exaone4": dict(sliding_window=100000),  # windows (its full layers stay NoPE)
    "gemma4_text": dict(sliding_window=100000),  # windows on the owning and the K/V-sharing layers
    "exaone4-global": dict(layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=100000),
    "lfm2-bias": dict(conv_bias=False),
    "granitemoehybrid": dict(embedding_multiplier=1.0, residual_multiplier=1.0, logits_scaling=1.0),
    "granitemoehybrid-rope": dict(position_embedding_type=None, mamba_n_groups=1),
}


@pytest.mark.parametrize("name", sorted(FEATURE_OFF))
def test_each_feature_changes_the_reference(name):
    """The parity and generation tests can fail: without the feature transformers' own logits
    move by far more than the FP32 tolerance past the windows."""
    ids = np.random.default_rng(0).integers(3, 300, size=40).tolist()
    with torch.no_grad():
        a = make_model(name)(input_ids=torch.tensor([ids])).logits[0]
        b = make_model(name, **FEATURE_OFF[name])(input_ids=torch.tensor([ids])).logits[0]
    assert float((a - b).abs().max()) > 1e-2, name


def test_windowed_fused_artifact_declares_its_windows(tmp_path, tokenizer):
    folder = save_hf_folder(make_model("gemma2"), tmp_path / "hf", tokenizer)
    recipe = write_recipe(
        tmp_path / "r.yaml", folder, {"proposer": "ngram", "ngram_sizes": [3, 2, 1]}, graph="fused", max_context=64
    )
    for graph, version, windows in (("fused", "1.4", [16]), ("portable", None, None)):
        text = recipe.read_text().replace("graph: fused", f"graph: {graph}")
        path = tmp_path / f"{graph}.yaml"
        path.write_text(text)
        out = tmp_path / graph
        assert CliRunner().invoke(cli, ["build", str(path), "-o", str(out), "--quiet"]).exit_code == 0
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["target"].get("attention_windows") == windows
        if version:
            assert manifest["contract_version"] == version
        else:  # portable graphs apply windows in their mask: no 1.4 requirement
            assert manifest["contract_version"] != "1.4"


def _export(name: str, graph: str, model, out, **kwargs):
    from tiny import export_portable

    from specexport.graphs.decoder import build_decoder

    if graph == "fused":
        return build_decoder(model, out, 300, **kwargs)
    return export_portable(model, out, **kwargs)


@pytest.mark.parametrize("name, graph", CASES, ids=IDS)
def test_fp16_graph_matches_the_fp32_reference_past_the_windows(tmp_path, name, graph):
    """fp16 weights and activations (what CUDA runs) against the fp32 transformers model, on the
    short probe and on a 256-token one (validate.FP16: the bound and the agreement it states)."""
    import copy

    from specexport.build.validate import FP16, validate_export, validate_long_range

    model = make_model(name)
    res = _export(name, graph, copy.deepcopy(model).half(), tmp_path)
    assert res.spec.kv_dtype == "float16"
    ids = np.random.default_rng(0).integers(3, 300, size=40).tolist()
    short = validate_export(model, res.path, res.spec, ids, FP16)
    long = validate_long_range(model, res.path, res.spec, ids, 256, FP16)
    assert 0 < short.max_abs_diff and 0 < long.max_abs_diff  # fp16 really ran


@pytest.mark.parametrize("name, graph", CASES, ids=IDS)
def test_target_features_are_transformers_hidden_states(tmp_path, name, graph):
    """The EAGLE-3 output `hidden_states`: the residual streams entering three layers, as
    transformers' output_hidden_states[i], for every row of a prefill and of a verify step."""
    from specexport.build.validate import FeedRunner

    model = make_model(name)
    layers = model.config.get_text_config().num_hidden_layers
    feature_layers = (0, layers // 2, layers - 1)
    res = _export(name, graph, model, tmp_path, feature_layers=feature_layers)
    assert res.spec.feature_width == 3 * model.config.get_text_config().hidden_size
    ids = np.random.default_rng(1).integers(3, 300, size=30).tolist()
    runner = FeedRunner(res.path, res.spec)
    runner.run(ids[:25], [24])
    prefill = runner.features
    runner.run(ids[25:], [0])
    verify = runner.features
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    want = torch.cat([hidden[i][0] for i in feature_layers], dim=-1).numpy()  # [30, 3 H]
    got = np.concatenate([prefill, verify])
    assert float(np.abs(got - want).max()) <= 1e-4 * max(1.0, float(np.abs(want).max()))
