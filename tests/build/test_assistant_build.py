"""The Gemma 4 assistant on the build side: its config checked against the target (one-line
refusals naming the value and what the target has) and its graph, in both layouts, against
transformers' Gemma4AssistantForCausalLM forward on the same target hidden row and K/V
(tolerance 1e-4 absolute: float32 graphs against float32 PyTorch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from assistant_models import make_assistant
from tiny import make_model

from specexport.build.eagle import target_embedding
from specexport.graphs.assistant import build_assistant
from specexport.models.assistant import AssistantMismatch, check_pair
from specexport.models.config import normalize
from specexport_runtime import contract
from specexport_runtime.engine import SessionConfig, make_session

TOL = 1e-4
IDS = [17, 88, 203, 5, 61, 144, 9, 250, 33, 71, 120, 8, 199, 42, 66, 3, 90, 14, 230, 7, 55, 101]  # 22 > 8 + 1


@pytest.fixture(scope="module")
def target():
    return make_model("gemma4_text")


def _facts(assistant, target):
    return check_pair(assistant.config, target.config, normalize(target.config, 256))


# --------------------------------------------------------------------------- the config check


def test_a_matching_assistant_reads_the_targets_store_layers(target):
    facts = _facts(make_assistant(), target)
    # tiny gemma4_text: layers 0..3 own caches; 2 is the last full one, 3 the last sliding one
    assert facts.shared_kv == {"sliding_attention": 3, "full_attention": 2}
    assert facts.head_dims == {"sliding_attention": 16, "full_attention": 32}
    assert (facts.backbone, facts.hidden, facts.vocab, facts.centroids, facts.top_k) == (64, 32, 320, 16, 4)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (dict(backbone=48), "backbone_hidden_size 48 is not the target's hidden_size 64"),
        (dict(vocab_size=384), "vocab_size 384 is not the target's 320"),
        (dict(head_dim=8), "reads 1 K/V heads x 8, but the target's layer 3 stores 1 x 16"),
        (dict(num_key_value_heads=2), "reads 2 K/V heads x 16, but the target's layer 3 stores 1 x 16"),
    ],
)
def test_a_mismatch_is_refused_in_one_line(target, overrides, words):
    with pytest.raises(AssistantMismatch) as info:
        _facts(make_assistant(**overrides), target)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_a_target_of_another_family_is_refused(target):
    with pytest.raises(AssistantMismatch, match="drafts for a Gemma 4 target .* not 'llama'"):
        check_pair(make_assistant().config, make_model("llama").config, normalize(make_model("llama").config, 256))


# --------------------------------------------------------------------------- the graph


def _reference(assistant, target, ids, P, token, hidden):
    """transformers' forward for one draft step at position P: the target's K/V of positions < P."""
    with torch.no_grad():
        out = target(torch.tensor([ids[:P]]), return_shared_kv_states=True)
        shared = {k: (v[0][:, :, :P], v[1][:, :, :P]) for k, v in out.shared_kv_states.items()}
        embeds = torch.cat([target.get_input_embeddings()(torch.tensor([[token]])), hidden[None, None]], -1)
        ref = assistant(inputs_embeds=embeds, position_ids=torch.tensor([[P]]), shared_kv_states=shared)
    return ref.logits[0, 0].numpy(), ref.last_hidden_state[0, 0].numpy(), shared


def _caches(shared, facts, layout: str, D: int, rows: int):
    """The target caches the graph reads, as the runtime holds them: padded to the widest D, in
    `layout` (head_major_inplace: a buffer of `rows` rows, garbage past P)."""
    feeds = {}
    for kind, n in facts.shared_kv.items():
        for i, name in ((0, contract.shared_key(n)), (1, contract.shared_value(n))):
            t = shared[kind][i][0]  # [H_kv, P, Dt]
            t = torch.nn.functional.pad(t, (0, D - t.shape[-1]))  # zeros past the layer's head_dim
            if layout == contract.TIME_MAJOR:
                feeds[name] = t.transpose(0, 1)[None].numpy()  # [1, P, H_kv, D]
            else:
                buf = np.random.default_rng(n).normal(size=(1, t.shape[0], rows, D)).astype(np.float32)
                buf[0, :, : t.shape[1]] = t.numpy()
                feeds[name] = buf
    return feeds


@pytest.mark.parametrize("layout", [contract.TIME_MAJOR, contract.HEAD_MAJOR_INPLACE], ids=["portable", "fused"])
@pytest.mark.parametrize("centroids", [True, False], ids=["centroid-head", "full-head"])
def test_the_graph_matches_transformers_forward(tmp_path, target, layout, centroids):
    """Draft steps at P = 5 (inside the sliding window) and P = 20 (past it), from the target's
    last hidden row and from the assistant's own hidden_out: logits and hidden_out within 1e-4."""
    assistant = make_assistant(centroids=centroids)
    facts = _facts(assistant, target)
    norm = normalize(target.config, 256)
    result = build_assistant(
        assistant, target_embedding(target), facts, tmp_path, kv_heads=1, head_dim=norm.head_dim, kv_layout=layout
    )
    assert result.spec.kind == contract.ASSISTANT and result.spec.shared_kv == (2, 3)
    session = make_session(result.path, SessionConfig(provider="cpu"))
    assert [i.name for i in session.get_inputs()] == result.spec.input_names()
    with torch.no_grad():
        last = target(torch.tensor([IDS]), output_hidden_states=True).hidden_states[-1][0]  # [S, Hb]
    worst = 0.0
    for P in (5, 20):
        hidden, token = last[P - 1], IDS[P]
        for _ in range(2):
            want_logits, want_hidden, shared = _reference(assistant, target, IDS, P, token, hidden)
            feeds = {
                contract.INPUT_IDS: np.array([[token]], np.int64),
                contract.ASSISTANT_HIDDEN: hidden.numpy()[None, None],
                **_caches(shared, facts, layout, norm.head_dim, 40),
            }
            if layout == contract.HEAD_MAJOR_INPLACE:
                feeds[contract.TOTAL_SEQUENCE_LENGTH] = np.array(P, np.int32)
            logits, hidden_out = session.run(None, feeds)
            np.testing.assert_allclose(logits[0, 0], want_logits, atol=TOL, rtol=0)
            np.testing.assert_allclose(hidden_out[0, 0], want_hidden, atol=TOL, rtol=0)
            worst = max(worst, float(np.abs(logits[0, 0] - want_logits).max()))
            hidden, token = torch.from_numpy(hidden_out[0, 0].copy()), int(np.argmax(want_logits))
    print(f"max |logit diff| {worst:.2e}")


def test_rows_of_one_call_are_independent_draft_steps(tmp_path, target):
    """Three rows in one call equal three one-row calls (each row its own draft step at P)."""
    assistant = make_assistant()
    facts = _facts(assistant, target)
    result = build_assistant(assistant, target_embedding(target), facts, tmp_path, kv_heads=1, head_dim=32)
    session = make_session(result.path, SessionConfig(provider="cpu"))
    _, _, shared = _reference(assistant, target, IDS, 12, 5, torch.zeros(64))
    caches = _caches(shared, facts, contract.TIME_MAJOR, 32, 0)
    tokens = np.array([[5, 77, 260]], np.int64)
    hidden = np.random.default_rng(0).normal(size=(1, 3, 64)).astype(np.float32)
    together = session.run(None, {contract.INPUT_IDS: tokens, contract.ASSISTANT_HIDDEN: hidden, **caches})
    for r in range(3):
        alone = session.run(
            None, {contract.INPUT_IDS: tokens[:, r : r + 1], contract.ASSISTANT_HIDDEN: hidden[:, r : r + 1], **caches}
        )
        for a, b in zip(together, alone, strict=True):
            np.testing.assert_allclose(a[0, r], b[0, 0], atol=1e-5, rtol=0)
