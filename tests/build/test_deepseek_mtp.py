"""DeepSeek-style MTP layers (models/mtp_deepseek.py) as the `mtp` draft: the graph against a
reference written from the published equations (tests/deepseek_mtp_checkpoints.py) for both
tensor layouts (DeepSeek-V3's model.layers.{L}.*, MiMo's model.mtp_layers.*) and both graph
forms over a catch-up call and chained steps; greedy output with `draft: {mtp: {}}` against
target-only output; the one-line refusals before any weight is read."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from deepseek_mtp_checkpoints import DeepSeekReference, add_mtp, prefix
from tiny import make_model, make_tokenizer, save_hf_folder, write_recipe

from specexport.build.artifact import build_artifact
from specexport.graphs.mtp import build_mtp
from specexport.models.config import read_config
from specexport.models.mtp import MtpUnavailable
from specexport.models.mtp_deepseek import check, mtp_model, offer
from specexport.models.streaming import open_streamed
from specexport.recipe.load import load_recipe
from specexport_runtime import contract
from specexport_runtime.api import load
from specexport_runtime.engine import OrtModel, SessionConfig

CONTEXT = 64
CASES = [("llama", "deepseek_v3"), ("qwen3", "deepseek_v3"), ("qwen2", "mimo")]


def _checkpoint(tmp_path, arch: str, layout: str, **kwargs):
    """(folder, target, MTP tensors): a tiny target whose safetensors carry one MTP layer."""
    target = make_model(arch)
    folder = save_hf_folder(target, tmp_path / "hf", make_tokenizer())
    return folder, target, add_mtp(folder, target.config, layout, target=target, **kwargs)


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{b}" for a, b in CASES])
def checkpoint(request, tmp_path_factory):
    arch, layout = request.param
    return (*_checkpoint(tmp_path_factory.mktemp(arch), arch, layout), layout)


def _target_rows(target, ids) -> torch.Tensor:
    """The target's final-normed hidden rows [n, H] (transformers' output_hidden_states[-1])."""
    with torch.no_grad():
        return target(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def _reference(target, layout, tensors, **kwargs) -> DeepSeekReference:
    embed, head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    return DeepSeekReference(target.config, layout, tensors, embed, head, **kwargs)


@pytest.mark.parametrize("kv_layout", [contract.HEAD_MAJOR_INPLACE, contract.TIME_MAJOR], ids=["fused", "portable"])
def test_the_graph_matches_the_mtp_equations(tmp_path, checkpoint, kv_layout):
    folder, target, tensors, layout = checkpoint
    found = check("tiny", folder, target.config.model_type, read_config(str(folder)))
    assert found.name == layout and found.prefix == prefix(layout, target.config)
    model = mtp_model(open_streamed(folder, target.config), folder, found)
    result = build_mtp(model, tmp_path / "mtp", CONTEXT, kv_layout)
    assert result.spec.kind == contract.MTP and result.spec.feature_width == result.spec.hidden_width == 64
    head = OrtModel(result.path, result.spec, CONTEXT, SessionConfig(threads=1), max_rows=16)

    ids = [5, 17, 99, 3, 250, 41, 7, 12]
    h = _target_rows(target, ids)  # row t: position t
    # catch-up: rows 0..5 pair the target's hidden of t with the token at t + 1; then two chained steps
    want_logits, want_out = _reference(target, layout, tensors).rows([*ids[1:7], 60, 61], [*h[:6], None, None])
    logits = head.forward(ids[1:7], last_rows=6, features=h[:6].numpy()).copy()
    out = head.hidden_out.copy()
    for token in (60, 61):
        logits = np.concatenate([logits, head.forward([token], hidden=head.hidden_out[-1:].copy())])
        out = np.concatenate([out, head.hidden_out])
    np.testing.assert_allclose(logits, want_logits.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out, want_out.numpy(), atol=1e-4, rtol=1e-4)
    head.truncate(6)  # a rollback is a cursor move: the chained row again after the catch-up rows
    np.testing.assert_allclose(head.forward([60], hidden=out[5:6])[0], want_logits[6].numpy(), atol=1e-4, rtol=1e-4)


def test_the_reference_reads_what_the_graph_reads(checkpoint):
    """The reference is sensitive to the layer's own tensors and to the concatenation order."""
    folder, target, tensors, layout = checkpoint
    h = _target_rows(target, [4, 5, 6])
    base, _ = _reference(target, layout, tensors).rows([5, 6], [h[0], h[1]])
    hnorm = prefix(layout, target.config) + ("hidden_layernorm" if layout == "mimo" else "hnorm") + ".weight"
    other = {k: (v + 0.5 if k == hnorm else v) for k, v in tensors.items()}
    changed, _ = _reference(target, layout, other).rows([5, 6], [h[0], h[1]])
    swapped, _ = _reference(target, layout, tensors, hidden_first=layout != "mimo").rows([5, 6], [h[0], h[1]])
    assert (base - changed).abs().max() > 1e-2 and (base - swapped).abs().max() > 1e-2


def _refusal(tmp_path, arch="llama", layout="deepseek_v3", edit=None, **kwargs) -> str:
    folder, target, _ = _checkpoint(tmp_path, arch, layout, **kwargs)
    if edit is not None:
        edit(folder)
    with pytest.raises(MtpUnavailable) as err:
        check("m", folder, target.config.model_type, read_config(str(folder)))
    assert "\n" not in str(err.value)
    return str(err.value)


def _drop(*names):
    def edit(folder):
        from safetensors.torch import load_file, save_file

        path = folder / "model.safetensors"
        tensors = load_file(str(path))
        save_file({k: v for k, v in tensors.items() if not k.endswith(names)}, str(path), metadata={"format": "pt"})

    return edit


def _add(name):
    def edit(folder):
        from safetensors.torch import load_file, save_file

        path = folder / "model.safetensors"
        tensors = load_file(str(path))
        save_file({**tensors, name: torch.zeros(4, 64)}, str(path), metadata={"format": "pt"})

    return edit


def test_checkpoints_without_one_usable_mtp_layer_are_refused_in_one_line(tmp_path):
    target = make_model("llama")
    folder = save_hf_folder(target, tmp_path / "none", make_tokenizer())
    assert offer(folder) is None
    with pytest.raises(MtpUnavailable) as err:
        check("m", folder, "llama", target.config)
    assert str(err.value) == (
        "m: draft mtp reads the checkpoint's own MTP layers (model.layers.2.eh_proj or model.mtp_layers.*)"
        " and this checkpoint has none; use another draft form"
    )
    two = _refusal(tmp_path / "two", layers=2)
    assert two == (
        "m: one MTP layer is implemented; the checkpoint has num_nextn_predict_layers 2, deepseek_v3 layers [2, 3]"
    )
    assert "mimo layers [0, 1]" in _refusal(tmp_path / "mimo2", "qwen2", "mimo", layers=2)
    moe = _refusal(tmp_path / "moe", edit=_add("model.layers.2.mlp.experts.0.gate_proj.weight"))
    assert moe == (
        "m: the MTP layer's block is a mixture of experts (model.layers.2.mlp.experts.0.gate_proj.weight);"
        " dense blocks are implemented"
    )
    lacking = _refusal(tmp_path / "lacking", edit=_drop("layers.2.mlp.up_proj.weight"))
    assert lacking == "m: the deepseek_v3 MTP layer lacks 'model.layers.2.mlp.up_proj.weight'"
    assert "lacks 'model.layers.2.hnorm.weight'" in _refusal(tmp_path / "hnorm", edit=_drop("layers.2.hnorm.weight"))
    windowed, _, _ = _checkpoint(tmp_path / "window", "llama", "deepseek_v3")
    with pytest.raises(MtpUnavailable, match=r"^m: attention windows \[16\] on the target; .* not implemented$"):
        check("m", windowed, "llama", read_config(str(windowed)), (16,))
    other = r"^m: draft mtp reads DeepSeek-style MTP layers on .*; this is a gemma model$"
    with pytest.raises(MtpUnavailable, match=other):
        check("m", folder, "gemma", None)


def test_a_build_with_another_draft_offers_the_layer(tmp_path):
    folder, _, _ = _checkpoint(tmp_path, "qwen2", "mimo")
    assert offer(folder) == (
        "the target checkpoint carries 1 mimo MTP layer(s): `draft: {mtp: {}}` drafts with them (proposer mtp)"
    )


@pytest.fixture(scope="module", params=[("llama", "deepseek_v3", "portable"), ("qwen2", "mimo", "fused")])
def built(request, tmp_path_factory):
    arch, layout, graph = request.param
    work = tmp_path_factory.mktemp(f"{arch}-{layout}")
    folder, _, _ = _checkpoint(work, arch, layout, echo=True)  # drafts accepted where the target repeats
    recipe = write_recipe(work / "recipe.yaml", folder, {"mtp": {}}, name=f"tiny-{layout}", graph=graph)
    out = work / "artifact"
    build_artifact(load_recipe(recipe), out)
    return out, load(out), layout


PROMPTS = [[7, 150, 33, 299, 12, 260, 5], [40, 41, 42, 43, 44] * 4, [17, 88, 203, 5, 61, 144, 9, 250, 33, 71]]


def test_greedy_output_equals_target_only(built):
    out, gen, layout = built
    manifest = json.loads((out / "manifest.json").read_text())
    draft = manifest["draft"]
    assert draft["kind"] == "mtp" and draft["architecture"] == f"{layout}_mtp"
    assert manifest["speculation"]["proposer"] == "mtp" and draft["validation"]["max_abs_diff"] < 1e-4
    accepted = drafted = 0
    for ids in PROMPTS:
        for gamma in (1, 3):
            spec = gen.generate(ids, max_new_tokens=40, gamma=gamma, proposer="mtp")
            assert spec.token_ids == gen.generate(ids, max_new_tokens=40, speculative=False).token_ids
            assert set(spec.stats.by_source) <= {"mtp"}
            accepted, drafted = accepted + spec.stats.accepted, drafted + spec.stats.drafted
    assert 0 < accepted < drafted  # rounds that keep drafts and rounds that drop chained rows


def test_a_build_of_a_checkpoint_with_two_layers_is_refused_before_anything_is_written(tmp_path):
    folder, _, _ = _checkpoint(tmp_path, "llama", "deepseek_v3", layers=2)
    recipe = write_recipe(tmp_path / "recipe.yaml", folder, {"mtp": {}})
    out = tmp_path / "out"
    with pytest.raises(MtpUnavailable, match=r"^.*: one MTP layer is implemented; .* deepseek_v3 layers \[2, 3\]$"):
        build_artifact(load_recipe(recipe), out)
    assert not out.exists()
