"""GGUF files of the Mamba2 hybrids: Granite 4.0-H (`granitehybrid`) and Falcon-H1 (`falcon-h1`).

The files are written here as llama.cpp's converter writes them (its Mamba2Model, GraniteHybridModel
and FalconH1Model), independently of the reader: names from gguf-py's TensorNameMap after the
converter's rename of `dt_bias` to `dt_proj.bias`; A stored as ssm_a = -exp(A_log) [H, 1], D as
[H, 1], the conv kernel [C, 1, K] squeezed to [C, K], the gated norm as [G, inner / G]; Granite's
shared MLP input_linear split into ffn_gate | ffn_up and q / k rows permuted (LlamaModel.permute);
Falcon-H1's muP multipliers multiplied into the weights; the ssm.* metadata keys. The reference is
the original transformers model (F32 files): the logits through the GGUF path must match it
within an explicit tolerance (A round-trips through exp / log and the multipliers through a
product, so equality is not bitwise).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map
from gguf_support import fused_graph_logits, hybrid_ids, permute
from tiny import make_model

from specexport.build.validate import reference_logits
from specexport.formats.blocks import FormatError
from specexport.formats.gguf_config import hf_config, read_header
from specexport.models.config import normalize
from specexport.models.gguf_source import open_gguf
from specexport.models.streaming import source_of

MAX_CONTEXT = 128
EPS = float(np.float32(1e-5))  # the metadata holds float32
# |logit| diff from the original transformers model's, over its max |logit| (measured: 5e-6, 3e-6)
STREAM_TOL = 2e-5  # the GGUF-streamed transformers model
GRAPH_TOL = 5e-5  # its fused graph
_ARCH = {"granitehybrid": MODEL_ARCH.GRANITE_HYBRID, "falcon-h1": MODEL_ARCH.FALCON_H1}


def _falcon_scale(c, name: str, value: np.ndarray) -> np.ndarray:
    """FalconH1Model.modify_tensors: each weight times its multipliers (in_proj rows by part)."""
    mlp, ssm = c.mlp_multipliers, c.ssm_multipliers
    if "down_proj" in name:
        return value * mlp[1]
    if "gate_proj" in name:
        return value * mlp[0]
    if "k_proj" in name:
        return value * c.key_multiplier * c.attention_in_multiplier
    if "q_proj" in name or "v_proj" in name:
        return value * c.attention_in_multiplier
    if "o_proj" in name:
        return value * c.attention_out_multiplier
    if "out_proj" in name:
        return value * c.ssm_out_multiplier
    if "in_proj" in name:
        inner, gs = c.mamba_d_ssm, c.mamba_n_groups * c.mamba_d_state
        bounds = [0, inner, 2 * inner, 2 * inner + gs, 2 * inner + 2 * gs, value.shape[0]]  # z | x | B | C | dt
        value = value * c.ssm_in_multiplier
        for m, lo, hi in zip(ssm, bounds, bounds[1:]):
            value[lo:hi] *= m
        return value
    if "lm_head" in name:
        return value * c.lm_head_multiplier
    if "embed_tokens" in name:
        return value * c.embedding_multiplier
    return value


def write_mamba2_gguf(model, path, arch: str) -> None:
    """`model` (transformers GraniteMoeHybridForCausalLM / FalconH1ForCausalLM) as llama.cpp's
    converter writes it, every tensor F32."""
    c = model.config
    names = get_tensor_name_map(_ARCH[arch], c.num_hidden_layers)
    granite = arch == "granitehybrid"
    heads, head_dim = c.mamba_n_heads, c.mamba_d_head
    inner, groups = heads * head_dim, c.mamba_n_groups
    w = GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_ssm_conv_kernel(c.mamba_d_conv)
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(c.mamba_d_state)
    w.add_ssm_time_step_rank(heads)
    w.add_ssm_group_count(groups)
    if granite:
        w.add_head_count_kv(
            [c.num_key_value_heads if "attention" in t and t != "linear_attention" else 0 for t in c.layer_types]
        )
        w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
        w.add_rope_scaling_finetuned(c.position_embedding_type == "rope")
    else:
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    for name, p in model.named_parameters():  # a tied head appears once, as the embedding
        value = p.detach().float().numpy().copy()
        if not granite:
            value = _falcon_scale(c, name, value)
        if name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        if granite and "shared_mlp.input_linear" in name:
            gate, up = np.split(value, 2)
            bid = name.split(".")[2]
            w.add_tensor(f"blk.{bid}.ffn_gate.weight", gate)
            w.add_tensor(f"blk.{bid}.ffn_up.weight", up)
            continue
        if granite and "shared_mlp.output_linear" in name:
            w.add_tensor(f"blk.{name.split('.')[2]}.ffn_down.weight", value)
            continue
        whole = names.get_name(name)
        if whole is None:
            stem, _, suffix = name.rpartition(".")
            assert names.get_name(stem) is not None, name
            gguf = f"{names.get_name(stem)}.{suffix}"
        else:
            gguf = whole
        kind = gguf.split(".")[2] if gguf.startswith("blk.") else ""
        if kind == "ssm_conv1d" and value.ndim == 3:
            value = value.squeeze(1)  # [C, 1, K] -> [C, K]
        elif kind in ("ssm_a", "ssm_d"):
            value = value.reshape(-1, 1)  # [H] -> [H, 1]
        elif kind == "ssm_norm":
            value = value.reshape(groups, inner // groups)
        if kind == "ssm_a":
            value = -np.exp(value)
        if granite and kind in ("attn_q", "attn_k"):
            value = permute(value, c.num_attention_heads if kind == "attn_q" else c.num_key_value_heads)
        w.add_tensor(gguf, np.ascontiguousarray(value, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# (arch, tiny model, overrides): llama.cpp normalizes Mamba2 after the gate (Falcon-H1's
# mamba_norm_before_gate has no GGUF key), so the original models here do too
CASES = {
    "granitehybrid": ("granitemoehybrid", {}),
    "granitehybrid-rope": ("granitemoehybrid", dict(position_embedding_type="rope", mamba_n_groups=2)),
    "falcon-h1": ("falcon_h1", dict(mamba_norm_before_gate=False)),
    "falcon-h1-gate": ("falcon_h1", dict(mamba_rms_norm=False)),
}


def _model(case: str):
    family, overrides = CASES[case]
    return make_model(family, rms_norm_eps=EPS, **overrides)


def _arch(case: str) -> str:
    return case.removesuffix("-rope").removesuffix("-gate")


@pytest.mark.parametrize("case", sorted(CASES))
def test_mamba2_config_from_metadata(tmp_path, case):
    """The file's config normalizes like the original's: layer kinds, Mamba2 shapes, attention;
    Falcon-H1's multipliers are 1 (they are in the weights)."""
    model = _model(case)
    write_mamba2_gguf(model, tmp_path / "m.gguf", _arch(case))
    got = normalize(hf_config(read_header(tmp_path / "m.gguf")), MAX_CONTEXT)
    want = normalize(model.config, MAX_CONTEXT)
    assert [layer.kind for layer in got.layers] == [layer.kind for layer in want.layers]
    assert (got.hidden, got.intermediate, got.heads, got.kv_heads, got.head_dim, got.vocab, got.tied) == (
        want.hidden,
        want.intermediate,
        want.heads,
        want.kv_heads,
        want.head_dim,
        want.vocab,
        want.tied,
    )
    g, m = got.mamba, want.mamba
    assert (g.heads, g.head_dim, g.groups, g.state_size, g.conv_kernel, g.conv_bias, g.norm) == (
        m.heads,
        m.head_dim,
        m.groups,
        m.state_size,
        m.conv_kernel,
        m.conv_bias,
        m.norm,
    )
    assert got.ropes == want.ropes
    if case.startswith("falcon"):
        assert got.mup is not None and set(vars(got.mup).values()) == {1.0}
        assert (
            got.embedding_multiplier in (None, 1.0)
            and g.in_multiplier == 1.0
            and g.projection_multipliers in (None, (1.0,) * 5)
        )
    else:
        assert (got.embedding_multiplier, got.residual_multiplier, got.logits_divisor, got.attn_scale) == pytest.approx(
            (want.embedding_multiplier, want.residual_multiplier, want.logits_divisor, want.attn_scale)
        )


@pytest.mark.parametrize("case", sorted(CASES))
def test_mamba2_file_gives_the_original_logits(tmp_path, case):
    """The streamed model's parameters have the original's shapes (A back as A_log, the gate|up
    rows stacked, q/k rows un-permuted), and its logits and its fused graph's match the original
    transformers model's within STREAM_TOL / GRAPH_TOL of the largest logit."""
    model = _model(case)
    write_mamba2_gguf(model, tmp_path / "m.gguf", _arch(case))
    streamed = open_gguf(read_header(tmp_path / "m.gguf"))
    source = source_of(streamed)
    for name, p in model.named_parameters():
        got = source.get(name)
        assert got.shape == p.shape, name
        if name.endswith("A_log"):  # log(-(-exp(x))) in float32
            assert torch.allclose(got, p.detach(), rtol=0, atol=1e-6), name
    ids = hybrid_ids()
    ref = reference_logits(model, ids)
    scale = max(1.0, float(np.abs(ref).max()))
    streamed_logits = reference_logits(streamed, ids)
    assert np.abs(streamed_logits - ref).max() <= STREAM_TOL * scale
    graph = fused_graph_logits(streamed, tmp_path / "g", ids)
    assert np.abs(graph - ref).max() <= GRAPH_TOL * scale
    assert (graph.argmax(-1) == ref.argmax(-1)).all()


def test_granite_hybrid_file_with_experts_is_refused(tmp_path):
    model = _model("granitehybrid")
    write_mamba2_gguf(model, tmp_path / "m.gguf", "granitehybrid")
    path = tmp_path / "e.gguf"
    from gguf import GGUFReader

    reader = GGUFReader(tmp_path / "m.gguf")
    w = GGUFWriter(str(path), "granitehybrid")
    for field in reader.fields.values():
        if field.name.startswith("granitehybrid."):
            key = field.name.removeprefix("granitehybrid.")
            value = field.contents()
            if key == "attention.head_count_kv":
                w.add_head_count_kv(value)
            elif isinstance(value, float):
                w.add_float32(field.name, value)
            elif isinstance(value, bool):
                w.add_bool(field.name, value)
            elif isinstance(value, int):
                w.add_uint32(field.name, value)
    w.add_expert_count(4)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data).reshape([int(n) for n in reversed(t.shape.tolist())]))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()
    with pytest.raises(FormatError, match="granitehybrid file has experts") as info:
        read_header(path)
    assert "\n" not in str(info.value)
