"""The MTP head graph (feature mtp_head, kind mtp) against a reference written from the published
MTP equations (tests/mtp_checkpoints.py), in both layouts, over a catch-up call and chained
steps; and the one-line refusals of checkpoints without usable MTP layers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mtp_checkpoints import MtpReference, add_mtp
from tiny import make_model, make_tokenizer, save_hf_folder

from specexport.graphs.mtp import build_mtp
from specexport.models.mtp import MtpUnavailable, check_mtp, mtp_model, offer
from specexport.models.streaming import open_streamed
from specexport_runtime import contract
from specexport_runtime.engine import OrtModel, SessionConfig

CONTEXT = 64


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5"])
def checkpoint(request, tmp_path_factory):
    """(folder, loaded target, MTP tensors): a tiny Qwen3.5 checkpoint with a random MTP layer."""
    target = make_model(request.param)
    folder = save_hf_folder(target, tmp_path_factory.mktemp(request.param) / "hf", make_tokenizer())
    return folder, target, add_mtp(folder, target.config.get_text_config())


def _target_rows(target, ids) -> torch.Tensor:
    """The target's final-normed hidden rows [n, H] (transformers' output_hidden_states[-1])."""
    with torch.no_grad():
        return target(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


@pytest.mark.parametrize("layout", [contract.HEAD_MAJOR_INPLACE, contract.TIME_MAJOR], ids=["fused", "portable"])
def test_the_graph_matches_the_mtp_equations(tmp_path, checkpoint, layout):
    folder, target, tensors = checkpoint
    streamed = open_streamed(folder, target.config) if target.config.model_type == "qwen3_5_text" else target
    result = build_mtp(mtp_model(streamed, folder), tmp_path / "mtp", CONTEXT, layout)
    assert result.spec.kind == contract.MTP and result.spec.feature_width == result.spec.hidden_width == 64
    head = OrtModel(result.path, result.spec, CONTEXT, SessionConfig(threads=1), max_rows=16)

    ids = [5, 17, 99, 3, 250, 41, 7, 12]
    h = _target_rows(target, ids)  # row t: position t
    embed = target.get_input_embeddings().weight.detach()
    ref = MtpReference(target.config.get_text_config(), tensors, embed, target.get_output_embeddings().weight.detach())

    # catch-up: rows 0..5 pair the target's hidden of t with the token at t + 1; then two chained steps
    want_logits, want_out = ref.rows([*ids[1:7], 60, 61], [*h[:6], None, None])
    logits = head.forward(ids[1:7], last_rows=6, features=h[:6].numpy()).copy()
    out = head.hidden_out.copy()
    for token in (60, 61):
        logits = np.concatenate([logits, head.forward([token], hidden=head.hidden_out[-1:].copy())])
        out = np.concatenate([out, head.hidden_out])
    np.testing.assert_allclose(logits, want_logits.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out, want_out.numpy(), atol=1e-4, rtol=1e-4)
    # a rollback is a cursor move: the chained rows again after truncating to the catch-up rows
    head.truncate(6)
    again = head.forward([60], hidden=out[5:6])
    np.testing.assert_allclose(again[0], want_logits[6].numpy(), atol=1e-4, rtol=1e-4)


def test_the_mtp_weights_change_the_graph(tmp_path, checkpoint):
    """The reference is sensitive to what the graph reads: another MTP layer gives other logits."""
    folder, target, tensors = checkpoint
    embed, head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    config = target.config.get_text_config()
    other = {k: (v + 0.5 if k == "mtp.pre_fc_norm_hidden.weight" else v) for k, v in tensors.items()}
    h = _target_rows(target, [4, 5, 6])
    a, _ = MtpReference(config, tensors, embed, head).rows([5, 6], [h[0], h[1]])
    b, _ = MtpReference(config, other, embed, head).rows([5, 6], [h[0], h[1]])
    assert (a - b).abs().max() > 1e-2


def test_a_checkpoint_without_mtp_layers_is_refused_in_one_line(tmp_path):
    target = make_model("qwen3_5_text")
    folder = save_hf_folder(target, tmp_path / "hf", make_tokenizer())
    assert offer(folder) is None
    with pytest.raises(MtpUnavailable) as err:
        check_mtp("tiny-qwen", folder, "qwen3_5_text", target.config)
    assert str(err.value) == (
        "tiny-qwen: draft mtp reads the checkpoint's own MTP layers (mtp.* tensors) and this checkpoint has none;"
        " use another draft form"
    )
    add_mtp(folder, target.config)
    assert "1 MTP layer(s)" in offer(folder) and "draft: {mtp: {}}" in offer(folder)
    assert check_mtp("tiny-qwen", folder, "qwen3_5_text", target.config)[0].startswith("mtp.")


def test_another_family_is_refused_in_one_line(tmp_path):
    with pytest.raises(MtpUnavailable, match=r"^m: draft mtp reads Qwen3.5 MTP layers .*; this is a llama model$"):
        check_mtp("m", tmp_path, "llama", None)
