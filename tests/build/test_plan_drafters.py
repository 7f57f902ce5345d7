"""specexport plan counts the drafters that read the target: a Gemma 4 assistant (no cache of its
own, a copy of the target's embedding in its graph) and a Qwen3.5 MTP layer (one layer's K/V cache,
the same copy). Expected figures are written here from the shapes; the tiny graphs the build's
writers produce are the second reference (their initializers' bytes)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from assistant_models import make_assistant, save_assistant
from tiny import make_model, make_tokenizer, save_hf_folder

from specexport.models.config import normalize
from specexport.plan.drafters import assistant_config, assistant_weight_bytes, mtp_weight_bytes
from specexport.plan.estimate import plan
from specexport.plan.known import KNOWN_ASSISTANTS
from specexport.recipe.load import parse_recipe
from specexport.recipe.spec import ModelSpec

CONTEXT = 4096


def _initializer_bytes(path) -> int:
    """Bytes of every initializer of a graph (external data included), read from its tensor protos."""
    model = onnx.load(str(path), load_external_data=False)
    total = 0
    for t in model.graph.initializer:
        itemsize = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
        total += int(np.prod(t.dims, dtype=np.int64)) * itemsize
    return total


# --------------------------------------------------------------------------- Gemma 4 assistant


def _e2b_assistant_by_hand() -> tuple[int, int]:
    """(own parameters, graph weight bytes) of the assumed E2B assistant: vocabulary 262144,
    backbone 1536, hidden 256, MLP 2048, 4 query heads, layers of head_dim 256, 256, 256, 512
    (3 sliding, 1 full), 2048 centroids; float32, the token ordering int64."""
    V, Hb, H, M, Hq, C = 262144, 1536, 256, 2048, 4, 2048
    layers = sum(H * Hq * d + Hq * d * H + d + 4 * H + 3 * H * M for d in (256, 256, 256, 512))
    own = 2 * Hb * H + layers + H + H * Hb + V * H + C * H
    return own, 4 * (own + V * Hb) + 8 * V


def test_the_assumed_e2b_assistant_sizes_as_transformers_builds_it():
    """The known (assumed) config's parameters as transformers' own model of it counts them (meta
    device: shapes only), and the hand count of the same shapes."""
    from transformers import Gemma4AssistantForCausalLM

    config, source = assistant_config(ModelSpec("google/gemma-4-e2b-it-assistant"))
    assert "assumed" in source
    with torch.device("meta"):
        model = Gemma4AssistantForCausalLM(config)
    own, weight = _e2b_assistant_by_hand()
    assert sum(p.numel() for p in model.parameters()) == own
    assert assistant_weight_bytes(config) == weight


def test_the_e2b_assistant_recipe_counts_the_assistant_and_no_cache():
    report = plan("gemma-4-e2b-it-assistant", "agx-orin-32gb")
    assert report.fits
    target, draft = report.models
    own, weight = _e2b_assistant_by_hand()
    assert (draft.parameters, draft.weight_bytes, draft.kv_bytes) == (own, weight, 0)
    # the copy of the target's embedding [262144, 1536] float32 is most of it: 1.5 GiB
    assert weight - 4 * own - 8 * 262144 == 262144 * 1536 * 4
    R = 9  # max_gamma 8 + 1 rows a call: host logits [R, V] and hidden rows [R, Hb]
    assert draft.logits_buffer_bytes == R * (262144 + 1536) * 4
    # the target is the same model as in the self-draft recipe
    self_draft = plan("gemma-4-e2b-it-int8-self-draft", "agx-orin-64gb").models[0]
    assert (target.weight_bytes, target.kv_bytes) == (self_draft.weight_bytes, self_draft.kv_bytes)
    assert target.kv_bytes == 2 * 15 * CONTEXT * 1 * 512 * 4
    assert any("owns no K/V cache" in n and "13, 14" in n for n in report.notes), report.notes


def test_a_downloaded_assistant_folder_is_read_not_assumed(tmp_path):
    """A local assistant folder: its own config.json sizes it; the graph the build's writer makes of
    it holds what the plan counts (up to its small constants: rotary tables, shape vectors)."""
    from specexport.build.eagle import target_embedding
    from specexport.graphs.assistant import build_assistant
    from specexport.models.assistant import check_pair

    target = make_model("gemma4_text")
    tfolder = save_hf_folder(target, tmp_path / "target", make_tokenizer())
    assistant = make_assistant()
    folder = save_assistant(assistant, tmp_path / "gemma-4-e2b-it-assistant")  # the known entry's name
    config, source = assistant_config(ModelSpec(str(folder)))
    assert source.endswith("config.json") and config.get_text_config().hidden_size == 32
    norm = normalize(target.config, 64)
    facts = check_pair(assistant.config, target.config, norm)
    result = build_assistant(
        assistant, target_embedding(target), facts, tmp_path / "graph", kv_heads=1, head_dim=norm.head_dim
    )
    stored = _initializer_bytes(result.path)
    planned = assistant_weight_bytes(config)
    # by hand: V 320, Hb 64, H 32, MLP 64, 4 heads of 16 (sliding) and 32 (full), 16 centroids
    own = 2 * 64 * 32 + sum(2 * 32 * 4 * d + d + 4 * 32 + 3 * 32 * 64 for d in (16, 32)) + 32 + 32 * 64 + 320 * 32
    assert planned == 4 * (own + 16 * 32 + 320 * 64) + 8 * 320
    assert planned <= stored <= planned + 4096, (planned, stored)

    recipe = parse_recipe(
        {
            "name": "t",
            "max_context": 64,
            "graph": "fused",
            "target": {"model": str(tfolder)},
            "draft": {"model": str(folder)},
        },
        "t",
    )
    draft = plan(recipe, "orin-nano-8gb").models[1]
    assert draft.config_source == f"{folder}/config.json" and draft.weight_bytes == planned and draft.kv_bytes == 0


def test_other_draft_models_are_not_taken_for_assistants(tmp_path):
    folder = save_hf_folder(make_model("gemma4_text"), tmp_path / "d", make_tokenizer())
    assert assistant_config(ModelSpec(str(folder))) is None
    assert assistant_config(ModelSpec("google/gemma-3-270m-it")) is None
    assert set(KNOWN_ASSISTANTS) == {"google/gemma-4-e2b-it-assistant"}


# --------------------------------------------------------------------------- MTP layer

# Qwen3.5 published text shapes: hidden, MLP, query heads, K/V heads (head_dim 256, vocabulary 248320, tied)
QWEN = {"qwen3.5-2b-mtp": (2048, 6144, 8, 2), "qwen3.5-4b-mtp": (2560, 9216, 16, 4)}


def _mtp_by_hand(H: int, M: int, heads: int, kv: int, V: int = 248320, D: int = 256) -> int:
    """Weight bytes of a Qwen3.5 MTP graph: the embedding copy (the tied head reads it), fc [H, 2H],
    two pre-fc norms, one gated full-attention layer (q_proj holds q and its gate), its two norms,
    q / k norms and MLP, and the final norm, float32."""
    layer = H * heads * D * 2 + 2 * H * kv * D + heads * D * H + 2 * D + 2 * H + 3 * H * M
    return 4 * (V * H + 2 * H * H + 2 * H + layer + H)


@pytest.mark.parametrize("name", sorted(QWEN))
def test_the_mtp_recipes_count_the_layer_and_its_cache(name):
    H, M, heads, kv = QWEN[name]
    report = plan(name, "agx-orin-32gb")
    assert report.fits
    target, draft = report.models
    assert draft.weight_bytes == _mtp_by_hand(H, M, heads, kv)
    assert draft.kv_bytes == 2 * 1 * CONTEXT * kv * 256 * 4  # its own cache, one layer, float32
    assert draft.state_bytes == 0  # a full-attention layer: no recurrent state
    assert draft.logits_buffer_bytes == 64 * 248320 * 4
    assert target.state_bytes > 0
    assert any(n.startswith("the MTP layer keeps its own K/V cache") for n in report.notes), report.notes


def test_the_2b_mtp_recipe_fits_the_orin_nx_and_the_4b_does_not():
    assert plan("qwen3.5-2b-mtp", "orin-nx-16gb").fits
    assert not plan("qwen3.5-4b-mtp", "orin-nx-16gb").fits


def test_the_mtp_graph_holds_what_the_plan_counts(tmp_path):
    """The MTP graph the build's writer makes of a tiny Qwen3.5 checkpoint: its initializers are the
    planned weights (up to its small constants)."""
    from mtp_checkpoints import add_mtp

    from specexport.graphs.mtp import build_mtp
    from specexport.models.mtp import mtp_model

    target = make_model("qwen3_5_text")
    folder = save_hf_folder(target, tmp_path / "hf", make_tokenizer())
    add_mtp(folder, target.config.get_text_config())
    result = build_mtp(mtp_model(target, folder), tmp_path / "mtp", 64, "head_major_inplace")
    stored = _initializer_bytes(result.path)
    c = normalize(target.config, 64)
    planned = mtp_weight_bytes(c)
    assert planned == _mtp_by_hand(c.hidden, c.intermediate, c.heads, c.kv_heads, c.vocab, c.head_dim)
    assert planned <= stored <= planned + 8192, (planned, stored)
