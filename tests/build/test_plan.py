"""specexport.plan.estimate: memory plans of recipes on devices."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from tiny import make_model, tiny_names

from specexport.cli.gpu import plan_cmd
from specexport.cli.main import _Group
from specexport.errors import SpecExportError
from specexport.models.config import config_from_dict, normalize
from specexport.plan.estimate import DEVICES, GIB, PlanError, UnknownDevice, plan, weight_bytes
from specexport.plan.sizes import known_config, parameters
from specexport.recipe.load import bundled_recipes, load_recipe, parse_recipe, resolve_recipe
from specexport.recipe.reader import with_overrides

# The device each bundled recipe is sized for (from its `notes`; the smollm2 recipes run anywhere,
# the smallest module they are meant for is the Orin Nano 8GB).
RECIPE_DEVICES = {
    "smollm2-135m": "orin-nano-8gb",
    "smollm2-135m-int4-draft": "orin-nano-8gb",
    "smollm2-135m-ngram": "orin-nano-8gb",
    "smollm2-135m-q4": "orin-nano-8gb",
    "tinyllama-1.1b-chat-int8-self-draft": "orin-nano-8gb",
    "qwen2.5-1.5b-instruct-qwen2.5-0.5b-draft": "orin-nano-8gb",
    "qwen2.5-3b-instruct-qwen2.5-0.5b-draft": "orin-nx-16gb",
    "qwen2.5-7b-instruct-qwen2.5-0.5b-draft": "agx-orin-32gb",
    "llama-3.1-8b-instruct-llama-3.2-1b-draft": "agx-orin-64gb",
    "llama-3.1-8b-instruct-awq-int4": "orin-nano-8gb",
    "llama-3.1-8b-instruct-eagle3": "agx-orin-32gb",
    "smollm2-135m-eagle3": "orin-nano-8gb",
    "gemma-3-1b-it-gemma-3-270m-draft": "orin-nano-8gb",
    "smollm3-3b-int4-self-draft": "orin-nx-16gb",
    "granite-3.3-2b-instruct-int4-self-draft": "orin-nx-16gb",
    "phi-4-mini-instruct-int4-self-draft": "agx-orin-32gb",
    "lfm2-1.2b-int8-self-draft": "orin-nx-16gb",
    "qwen3.5-0.8b-int8-self-draft": "orin-nx-16gb",
    "qwen3.5-2b-int8-self-draft": "agx-orin-32gb",
    "qwen3.5-4b-qwen3.5-0.8b-draft": "agx-orin-32gb",
    "granite-4.0-h-1b-int8-self-draft": "orin-nx-16gb",
    "falcon-h1-0.5b-instruct-int8-self-draft": "orin-nano-8gb",
    "gemma-4-e2b-it-int8-self-draft": "agx-orin-64gb",
    "gemma-4-e2b-it-assistant": "agx-orin-32gb",
    "qwen3.5-2b-mtp": "orin-nx-16gb",
    "qwen3.5-4b-mtp": "agx-orin-32gb",
}


def test_every_bundled_recipe_has_an_intended_device():
    assert {p.stem for p in bundled_recipes()} == set(RECIPE_DEVICES)


@pytest.mark.parametrize("name", sorted(RECIPE_DEVICES))
def test_bundled_recipe_fits_its_device(name):
    report = plan(name, RECIPE_DEVICES[name])
    assert report.fits, "\n".join(report.lines())
    recipe = load_recipe(bundled_recipes()[[p.stem for p in bundled_recipes()].index(name)])
    label = DEVICES[RECIPE_DEVICES[name]].label.replace("Jetson ", "")
    if recipe.notes and "Targets" in recipe.notes:
        assert label in recipe.notes  # the table agrees with the recipe's own notes


def test_default_recipe_fits_orin_nano_8gb():
    report = plan("smollm2-135m", "orin-nano-8gb")
    assert report.fits and not report.tight
    assert [m.role for m in report.models] == ["target", "draft"]
    assert report.advice == []


def test_llama_8b_fp16_does_not_fit_orin_nano_8gb_and_says_what_to_change():
    report = plan("llama-3.1-8b-instruct-llama-3.2-1b-draft", "orin-nano-8gb")
    assert not report.fits
    assert report.headroom_bytes < 0
    text = "\n".join(report.advice)
    assert "int4 target" in text or "-> int4" in text
    assert "agx-orin-32gb" in text  # a device where it fits as is
    assert "max_context" in text
    assert any("DOES NOT FIT" in line for line in report.lines())


def test_qwen_7b_does_not_fit_orin_nx_16gb_as_its_notes_say():
    assert not plan("qwen2.5-7b-instruct-qwen2.5-0.5b-draft", "orin-nx-16gb").fits


def test_numbers_match_a_hand_computation():
    """smollm2-135m (fp32 target, int8 self-draft, max_context 2048, max_gamma 8) on an Orin Nano 8GB."""
    report = plan("smollm2-135m", "orin-nano-8gb")
    target, draft = report.models
    L, h, inter, H, Hkv, D, V, T = 30, 576, 1536, 9, 3, 64, 49152, 2048
    linear = L * (h * H * D + 2 * h * Hkv * D + H * D * h + 3 * h * inter)  # 106,168,320
    small = L * 2 * h + h
    params = linear + small + V * h  # tied: the embedding once
    assert params == 134_515_008 == target.parameters
    assert target.weight_bytes == 4 * params
    assert draft.weight_bytes == int((linear + V * h) * (1 + 4 / 32)) + 4 * (V * h + small)  # int8 + fp32 embedding
    kv = 2 * L * T * Hkv * D * 4
    assert target.kv_bytes == draft.kv_bytes == kv == 94_371_840
    prefill = 2 * H * T * T * 4 + 3 * T * inter * 4 + 4 * T * h * 4 + 2 * H * T * D * 4 + 1 * V * 4
    verify = 2 * H * 9 * T * 4 + 3 * 9 * inter * 4 + 4 * 9 * h * 4 + 2 * H * T * D * 4 + 9 * V * 4
    assert target.activation_bytes == max(prefill, verify) == prefill
    assert target.logits_buffer_bytes == 64 * V * 4
    total = sum(m.weight_bytes + m.kv_bytes + m.activation_bytes + m.logits_buffer_bytes for m in report.models) + GIB
    assert report.total_bytes == total
    assert report.budget_bytes == int((8 - 1.5) * GIB)
    assert report.fits == (total <= report.budget_bytes)


def test_known_configs_match_published_sizes():
    published = {  # parameter counts of the model cards, +-1 %
        "meta-llama/Llama-3.1-8B-Instruct": 8.03e9,
        "meta-llama/Llama-3.2-1B-Instruct": 1.24e9,
        "Qwen/Qwen2.5-0.5B-Instruct": 0.494e9,
        "Qwen/Qwen2.5-1.5B-Instruct": 1.54e9,
        "Qwen/Qwen2.5-3B-Instruct": 3.09e9,
        "Qwen/Qwen2.5-7B-Instruct": 7.62e9,
        "TinyLlama/TinyLlama-1.1B-Chat-v1.0": 1.10e9,
        "builtin:smollm2-135m-instruct": 0.1345e9,
        "google/gemma-3-1b-it": 1.00e9,
        "google/gemma-3-270m-it": 0.268e9,
        "HuggingFaceTB/SmolLM3-3B": 3.08e9,
        "ibm-granite/granite-3.3-2b-instruct": 2.53e9,
        "microsoft/Phi-4-mini-instruct": 3.84e9,
        "LiquidAI/LFM2-1.2B": 1.17e9,
    }
    for model, count in published.items():
        assert parameters(known_config(model)) == pytest.approx(count, rel=0.01), model


FORMULA_CASES = [a for a in tiny_names() if a not in ("gemma3", "qwen3_5", "gemma4")]  # + a vision tower


@pytest.mark.parametrize("arch", FORMULA_CASES)
def test_formula_matches_a_real_model_from_its_config_json(tmp_path, arch):
    model = make_model(arch)
    model.config.save_pretrained(tmp_path)
    config = normalize(config_from_dict(json.loads((tmp_path / "config.json").read_text())))
    assert parameters(config) == sum(p.numel() for p in model.parameters())
    recipe = parse_recipe(
        {
            "name": "local",
            "max_context": 256,
            "target": {"model": str(tmp_path)},
            "draft": {"from_target": {"precision": "int4"}},
        }
    )
    report = plan(recipe, "orin-nano-4gb")
    assert report.fits and report.models[0].config_source.endswith("config.json")
    assert report.models[1].weight_bytes == weight_bytes(config, "int4")


def test_formula_counts_gemma4_layers_past_index_nine(tmp_path):
    """12 layers: config.json keys per_layer_config by zero-padded index ("04", "09"), so the full
    layers 4 and 9 must still get global_head_dim."""
    types = (["sliding_attention"] * 4 + ["full_attention"]) * 2 + ["sliding_attention", "full_attention"]
    model = make_model("gemma4_text", num_hidden_layers=12, layer_types=types, num_kv_shared_layers=4)
    model.config.save_pretrained(tmp_path)
    config = normalize(config_from_dict(json.loads((tmp_path / "config.json").read_text())))
    assert [config.layer_head_dim(i) for i in (4, 9, 11)] == [32, 32, 32]
    assert parameters(config) == sum(p.numel() for p in model.parameters())


def test_gemma4_e2b_known_config_and_caches():
    """The known Gemma 4 E2B text config sizes as transformers' own model of it (built on the meta
    device: shapes only); its 15 cache-owning layers (the last 20 read layers 13 / 14) keep caches at
    the widest head_dim, 512, the 12 sliding ones padding from 256."""
    import torch
    from transformers import AutoModelForCausalLM

    from specexport.plan.known import KNOWN_CONFIGS
    from specexport.plan.sizes import head_padding_bytes, kv_bytes, kv_sharing_saving_bytes

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_from_dict(KNOWN_CONFIGS["google/gemma-4-E2B-it"]))
    c = known_config("google/gemma-4-E2B-it", 4096)
    assert parameters(c) == sum(p.numel() for p in model.parameters())
    assert c.attention_layers == tuple(range(15)) and c.head_dim == 512
    assert kv_bytes(c, "fp32", 4096) == 2 * 15 * 4096 * 1 * 512 * 4
    assert kv_sharing_saving_bytes(c, "fp32", 4096) == 2 * 20 * 4096 * 512 * 4
    assert head_padding_bytes(c, "fp32", 4096) == 2 * 12 * 4096 * 256 * 4
    report = plan("gemma-4-e2b-it-int8-self-draft", "agx-orin-64gb")
    assert any(n.startswith("K/V sharing: 20 of 35 target layers") for n in report.notes), report.notes
    assert any(n.startswith("12 target caches belong to layers narrower") for n in report.notes), report.notes
    # the per-layer table [262144, 35 x 256] stays a float Gather in the int8 draft
    assert report.models[1].weight_bytes > 262144 * 35 * 256 * 4


def test_unknown_device_is_a_typed_error_listing_devices():
    with pytest.raises(UnknownDevice) as info:
        plan("smollm2-135m", "orin-nano-16gb")
    message = str(info.value)
    assert all(name in message for name in DEVICES)
    assert isinstance(info.value, (KeyError, SpecExportError))


def test_unknown_model_and_bad_arguments():
    recipe = parse_recipe(
        {"name": "x", "max_context": 256, "target": {"model": "someone/unknown-model"}, "draft": {"proposer": "ngram"}}
    )
    with pytest.raises(PlanError, match="cannot size model"):
        plan(recipe, "thor")
    with pytest.raises(PlanError):
        plan("smollm2-135m", "thor", max_prompt=0)


def test_overrides_and_report_forms():
    small = plan("qwen2.5-3b-instruct-qwen2.5-0.5b-draft", "orin-nano-8gb", max_context=256, max_prompt=256)
    big = plan("qwen2.5-3b-instruct-qwen2.5-0.5b-draft", "orin-nano-8gb")
    assert small.total_bytes < big.total_bytes and small.max_context == 256
    data = json.loads(json.dumps(big.to_dict()))
    assert data["fits"] is False and data["device"]["name"] == "orin-nano-8gb" and len(data["models"]) == 2
    ngram = plan("smollm2-135m-ngram", "orin-nano-4gb")
    assert [m.role for m in ngram.models] == ["target"]
    lowered = [a for a in big.advice if a.startswith("lower max_context to")]
    if lowered:  # the suggested context must really fit
        ctx = int(lowered[0].split()[3])
        assert plan("qwen2.5-3b-instruct-qwen2.5-0.5b-draft", "orin-nano-8gb", max_context=ctx).fits


def test_tight_fit_is_flagged():
    report = plan("tinyllama-1.1b-chat-int8-self-draft", "orin-nano-8gb")
    assert report.fits
    if report.tight:
        assert report.notes and report.advice


def test_cli_plan():
    group = _Group(commands={"plan": plan_cmd})
    runner = CliRunner()
    ok = runner.invoke(group, ["plan", "smollm2-135m", "--device", "orin-nano-8gb"])
    assert ok.exit_code == 0 and "FITS" in ok.output
    bad = runner.invoke(
        group, ["plan", "llama-3.1-8b-instruct-llama-3.2-1b-draft", "--device", "orin-nano-8gb", "--json"]
    )
    assert bad.exit_code == 1 and json.loads(bad.output)["fits"] is False
    listing = runner.invoke(group, ["plan", "x", "--device", "list"])
    assert listing.exit_code == 0 and "agx-orin-64gb" in listing.output
    unknown = runner.invoke(group, ["plan", "smollm2-135m", "--device", "nope"])
    assert unknown.exit_code == 2 and "known devices" in unknown.output


def test_fused_recipe_says_where_its_graphs_run():
    fused = plan("smollm2-135m", "orin-nano-8gb")  # graph: fused, fp32 target
    assert any("fp16 target" in n and "graph: portable" in n for n in fused.notes), fused.notes
    fp16 = plan(
        with_overrides(load_recipe(resolve_recipe("smollm2-135m")), {"target.precision": "fp16"}), "orin-nano-8gb"
    )
    assert any("CUDA provider (GroupQueryAttention)" in n for n in fp16.notes), fp16.notes
    portable = plan(with_overrides(load_recipe(resolve_recipe("smollm2-135m")), {"graph": "portable"}), "orin-nano-8gb")
    assert not any("graph: fused" in n for n in portable.notes)


def test_portable_eagle3_recipe_plans_the_same_head():
    """An EAGLE-3 head sizes the same in either graph form (its weights, one-layer cache and call
    memory do not depend on the form); the portable plan does not send the user to graph: fused,
    and an int8 head, MatMulNBits, is refused with graph: portable."""
    from specexport.recipe.load import RecipeError

    recipe = load_recipe(resolve_recipe("llama-3.1-8b-instruct-eagle3"))
    fused = plan(recipe, "agx-orin-32gb")
    portable = plan(with_overrides(recipe, {"graph": "portable"}), "agx-orin-32gb")
    f_head, p_head = fused.models[1].to_dict(), portable.models[1].to_dict()
    assert "EAGLE-3 head" in p_head["model"] and p_head == f_head
    assert portable.fits and not any("graph: fused" in n for n in portable.notes)
    with pytest.raises(RecipeError, match="draft.eagle3.precision = 'int8' needs graph: fused"):
        with_overrides(recipe, {"graph": "portable", "draft.eagle3.precision": "int8"})


def test_quantized_target_weight_bytes():
    """int4 block 32 with fp16 scales: 0.5 + 2/32 bytes per linear weight, int8 head and
    embedding 1 + 2/32, fp16 norms; computed here from the Llama-3.1-8B shapes."""
    from specexport.plan.estimate import weight_bytes
    from specexport.recipe.load import QuantizationSpec

    c = known_config("meta-llama/Llama-3.1-8B-Instruct")
    linear = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)
    table = 128256 * 4096
    norms = 32 * 2 * 4096 + 4096
    q = QuantizationSpec(block_size=32, head="int8", embedding="int8", dtype="fp16")
    expected = linear * (0.5 + 2 / 32) + 2 * table * (1 + 2 / 32) + 2 * norms
    assert weight_bytes(c, "int4", q) == int(expected)
    tied_float = QuantizationSpec(block_size=32, head="fp32", embedding="fp32", dtype="fp32")
    smol = known_config("builtin:smollm2-135m-instruct")
    s_linear = 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536)
    assert weight_bytes(smol, "int8", tied_float) == int(
        s_linear * (1 + 4 / 32) + 49152 * 576 * 4 + 4 * (30 * 2 * 576 + 576)
    )


def test_plan_counts_every_cache_slot_of_a_batch_graph():
    one = plan("smollm2-135m", "orin-nano-8gb")
    eight = plan(with_overrides(load_recipe(resolve_recipe("smollm2-135m")), {"max_batch": 8}), "orin-nano-8gb")
    (t1, d1), (t8, d8) = one.models, eight.models
    assert t8.kv_bytes == 8 * t1.kv_bytes == 8 * 94_371_840
    assert t8.logits_buffer_bytes == 8 * t1.logits_buffer_bytes
    assert t8.weight_bytes == t1.weight_bytes and d8 == d1  # one weights file; the draft stays batch 1
    assert eight.total_bytes - one.total_bytes == 7 * (t1.kv_bytes + t1.logits_buffer_bytes)
    assert eight.to_dict()["max_batch"] == 8 and "8 sequences per target call" in "\n".join(eight.lines())


def test_plan_counts_the_tree_graph_as_a_second_session():
    """tree_verify: the target's weights once more (a second session), no KV cache of its own, and
    an attention bias of 64 x (max_context + 64) floats per call."""
    one = plan("smollm2-135m", "orin-nano-8gb")
    recipe = with_overrides(load_recipe(resolve_recipe("smollm2-135m")), {"tree_verify": True})
    tree = plan(recipe, "orin-nano-8gb")
    t1 = one.models[0]
    (extra,) = [m for m in tree.models if m.role == "tree"]
    assert extra.weight_bytes == t1.weight_bytes and extra.kv_bytes == 0 and extra.logits_buffer_bytes == 0
    bias = 64 * (recipe.max_context + 64) * 4
    assert tree.total_bytes - one.total_bytes == t1.weight_bytes + t1.activation_bytes + bias
    assert any("second ONNX Runtime session" in n for n in tree.notes)


def test_plan_counts_the_portable_tree_graph():
    """graph: portable with tree_verify (contract 1.9): the same second session over the target's
    weights as the fused form's tree graph, no KV cache of its own."""
    base = with_overrides(load_recipe(resolve_recipe("smollm2-135m")), {"graph": "portable"})
    one = plan(base, "orin-nano-8gb")
    tree = plan(with_overrides(base, {"tree_verify": True}), "orin-nano-8gb")
    (extra,) = [m for m in tree.models if m.role == "tree"]
    assert extra.weight_bytes == one.models[0].weight_bytes and extra.kv_bytes == 0
    assert tree.total_bytes > one.total_bytes + extra.weight_bytes


def test_plan_counts_the_head_tree_graph():
    """An EAGLE-3 head with tree_verify: the head's weights once more (its tree graph's session),
    no KV cache of its own, beside the target's tree graph."""
    recipe = with_overrides(load_recipe(resolve_recipe("smollm2-135m-eagle3")), {"tree_verify": True})
    report = plan(recipe, "orin-nano-8gb")
    roles = [m.role for m in report.models]
    assert roles.count("tree") == 1 and roles.count("head tree") == 1
    head = next(m for m in report.models if m.role == "draft")
    extra = next(m for m in report.models if m.role == "head tree")
    assert extra.weight_bytes == head.weight_bytes and extra.kv_bytes == 0
    assert any("head's tree graph" in n for n in report.notes)
