"""specexport.plan for the hybrid checkpoints: their known configs normalize, and the recurrent
states are counted per kept position beside the K/V cache, as the runtime allocates them."""

from __future__ import annotations

import numpy as np
import pytest

from specexport.models.mixers import ATTENTION, GDN, HYBRID, MAMBA2
from specexport.plan.estimate import plan
from specexport.plan.sizes import KNOWN_CONFIGS, activation_bytes, known_config, kv_bytes, state_bytes, state_positions
from specexport_runtime.recurrent import StateHistory

# model -> (family, layers by kind) as the published config.json lays them out
HYBRIDS = {
    "Qwen/Qwen3.5-0.8B": ("qwen3_5", {GDN: 18, ATTENTION: 6}),
    "Qwen/Qwen3.5-2B": ("qwen3_5", {GDN: 18, ATTENTION: 6}),
    "Qwen/Qwen3.5-4B": ("qwen3_5", {GDN: 24, ATTENTION: 8}),
    "ibm-granite/granite-4.0-h-1b": ("granitemoehybrid", {MAMBA2: 36, ATTENTION: 4}),
    "tiiuae/Falcon-H1-0.5B-Instruct": ("falcon_h1", {HYBRID: 36}),
}


@pytest.mark.parametrize("model", sorted(HYBRIDS))
def test_known_hybrid_configs_normalize_as_published(model):
    family, kinds = HYBRIDS[model]
    c = known_config(model, 4096)  # config_from_dict + normalize: a refused key raises here
    assert c.family == family
    assert {k: sum(layer.kind == k for layer in c.layers) for k in kinds} == kinds
    assert c.num_layers == sum(kinds.values())


def test_qwen3_5_4b_states_and_kv_by_hand():
    """From the config's numbers: a Gated DeltaNet layer keeps its conv window [K - 1, 2 Hk Dk + Hv Dv]
    and its state [Hv, Dk, Dv]; only the 8 full-attention layers have K/V."""
    text = KNOWN_CONFIGS["Qwen/Qwen3.5-4B"]["text_config"]
    hk, hv = text["linear_num_key_heads"], text["linear_num_value_heads"]
    dk, dv, k = text["linear_key_head_dim"], text["linear_value_head_dim"], text["linear_conv_kernel_dim"]
    assert (hk, hv, dk, dv, k) == (16, 32, 128, 128, 4)
    per_layer = (k - 1) * (2 * hk * dk + hv * dv) + hv * dk * dv  # 3 x 8192 + 32 x 128 x 128 floats
    assert per_layer == 548_864
    c = known_config("Qwen/Qwen3.5-4B")
    assert state_bytes(c, 1) == 24 * per_layer * 4 == 52_690_944
    assert state_positions(8) == 20  # R = 9 rows: 10 kept, 9 for a call's outputs, the zeros
    assert state_bytes(c, 20) == 52_690_944 * 20
    assert kv_bytes(c, "fp32", 4096) == 2 * 8 * 4096 * 4 * 256 * 4


def test_granite_4_0_h_1b_states_and_kv_by_hand():
    """A Mamba2 layer keeps its conv window [K - 1, inner + 2 G N] and its scan state [H, P, N];
    inner = H x P = expand x hidden."""
    cfg = KNOWN_CONFIGS["ibm-granite/granite-4.0-h-1b"]
    keys = ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups", "mamba_d_conv")
    H, P, N, G, K = (cfg[k] for k in keys)
    assert H * P == cfg["mamba_expand"] * cfg["hidden_size"] == 3072
    per_layer = (K - 1) * (H * P + 2 * G * N) + H * P * N  # 3 x 3328 + 48 x 64 x 128 floats
    assert per_layer == 403_200
    c = known_config("ibm-granite/granite-4.0-h-1b")
    assert state_bytes(c, 1) == 36 * per_layer * 4 == 58_060_800
    assert kv_bytes(c, "fp32", 4096) == 2 * 4 * 4096 * 4 * 128 * 4


@pytest.mark.parametrize("model", ["Qwen/Qwen3.5-0.8B", "ibm-granite/granite-4.0-h-1b", "LiquidAI/LFM2-1.2B"])
def test_planned_states_are_what_the_runtime_allocates(model):
    """The planner's positions per sequence are the bytes of the StateHistory a recurrent model
    opened by the runtime keeps (max_rows 1 + max_gamma, depth max_rows + 1), on real arrays."""
    c = known_config(model)
    max_rows = 8 + 1
    history = StateHistory(c.state_shapes, np.float32, max_rows + 1, max_rows)
    assert state_bytes(c, state_positions(8)) == history.nbytes()


def test_the_report_counts_states_beside_kv_for_each_model():
    report = plan("qwen3.5-4b-qwen3.5-0.8b-draft", "agx-orin-32gb")
    target, draft = report.models
    assert target.kv_bytes == 2 * 8 * 4096 * 4 * 256 * 4
    assert target.state_bytes == 52_690_944 * state_positions(8)
    assert draft.state_bytes == state_bytes(known_config("Qwen/Qwen3.5-0.8B"), state_positions(8))
    parts = (target.weight_bytes, target.kv_bytes, target.state_bytes, target.activation_bytes)
    assert target.total_bytes == sum(parts) + target.logits_buffer_bytes
    text = "\n".join(report.lines())
    assert "recurrent state 0.98 GiB" in text and "per kept position target 50.25 MiB" in text
    assert report.to_dict()["models"][0]["state_bytes"] == target.state_bytes


def test_a_plain_model_has_no_state_line():
    report = plan("smollm2-135m", "orin-nano-8gb")
    assert all(m.state_bytes == 0 for m in report.models)
    assert "recurrent state" not in "\n".join(report.lines())


def test_a_recurrent_prefill_is_sized_in_calls_of_256_rows():
    """Granite 4.0-H-1B fp32, a 4096-token prompt: the last prefill call has 256 rows over 4096
    positions (scores, MLP, hidden, repeated K/V, one logits row, the scan's [H, S, S])."""
    c = known_config("ibm-granite/granite-4.0-h-1b")
    S, T, heads, D, inter, hidden, V, H = 256, 4096, 12, 128, 4096, 1536, 100352, 48
    prefill = 2 * heads * S * T * 4 + 3 * S * inter * 4 + 4 * S * hidden * 4 + 2 * heads * T * D * 4 + V * 4
    prefill += H * S * S * 4
    assert activation_bytes(c, "fp32", 4096, 4096, 8) == prefill
