"""GGUF files of Nemotron-H dense (`nemotron_h`: Mamba2, attention and MLP blocks, one mixer each).

The files are written here as llama.cpp's converter writes them (convert_hf_to_gguf's
NemotronHModel over GraniteHybridModel and Mamba2Model), independently of the reader: the
checkpoint's names (backbone.layers.N.mixer.*, backbone.embeddings, backbone.norm_f, lm_head)
through gguf-py's name table after the rename of dt_bias to dt_proj.bias; A stored as
ssm_a = -exp(A_log) [H, 1], D as [H, 1], the conv [C, 1, K] squeezed to [C, K], the gated norm as
[G, inner / G]; q / k rows permuted (LlamaModel.permute, which the attention blocks inherit);
metadata: head_count_kv and feed_forward_length one count per block (0 where the block lacks
the part), attention.layer_norm_epsilon, the ssm.* keys (inner_size = heads x head_dim,
time_step_rank = heads), no rotary (rope.scaling.finetuned false, context_length 2**20). The
reference is the original transformers model (F32 files): A round-trips through exp / log, so
equality is within an explicit tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, GGUFReader, GGUFWriter, get_tensor_name_map
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
# |logit| diff from the original transformers model's, over its max |logit| (measured: 0, 8e-7)
STREAM_TOL = 1e-5  # the GGUF-streamed transformers model
GRAPH_TOL = 1e-5  # its fused graph


def _checkpoint_name(name: str) -> str:
    """A transformers parameter name as the Nemotron-H checkpoint spells it."""
    return "backbone." + name.removeprefix("model.") if name.startswith("model.") else name


def write_nemotron_h_gguf(model, path) -> None:
    """`model` (transformers NemotronHForCausalLM) as llama.cpp's converter writes it, every tensor F32."""
    c = model.config
    kinds = c.layers_block_type
    names = get_tensor_name_map(MODEL_ARCH.NEMOTRON_H, c.num_hidden_layers)
    heads, head_dim, groups = c.mamba_num_heads, c.mamba_head_dim, c.n_groups
    inner = heads * head_dim
    w = GGUFWriter(str(path), "nemotron_h")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(2**20)  # GraniteHybridModel: no rotary
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length([c.intermediate_size if k == "mlp" else 0 for k in kinds])
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if k == "full_attention" else 0 for k in kinds])
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_state_size(c.ssm_state_size)
    w.add_ssm_group_count(groups)
    w.add_ssm_inner_size(inner)
    w.add_ssm_time_step_rank(heads)
    w.add_rope_scaling_finetuned(False)
    w.add_vocab_size(c.vocab_size)
    for hf, p in model.named_parameters():
        name = _checkpoint_name(hf)
        if name.endswith(".dt_bias"):
            name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
        value = p.detach().float().numpy().copy()
        whole = names.get_name(name)
        if whole is None:
            stem, _, suffix = name.rpartition(".")
            assert names.get_name(stem) is not None, name
            gguf = f"{names.get_name(stem)}.{suffix}"
        else:
            gguf = whole
        kind = gguf.split(".")[2] if gguf.startswith("blk.") else ""
        if kind == "ssm_conv1d" and value.ndim == 3:
            value = value.squeeze()
        elif kind in ("ssm_a", "ssm_d"):
            value = value.reshape(-1, 1)
        elif kind == "ssm_norm":
            value = value.reshape(groups, inner // groups)
        if kind == "ssm_a":
            value = -np.exp(value)
        if kind in ("attn_q", "attn_k"):
            value = permute(value, c.num_attention_heads if kind == "attn_q" else c.num_key_value_heads)
        w.add_tensor(gguf, np.ascontiguousarray(value, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# the tiny family (Mamba2, MLP, attention, MLP, Mamba2, MLP: 2 groups, a conv bias), and one with
# one group and no conv bias
CASES = {"nemotron_h": {}, "nemotron_h-plain": dict(n_groups=1, use_conv_bias=False)}


def _model(case: str):
    return make_model("nemotron_h", layer_norm_epsilon=EPS, **CASES[case])


@pytest.mark.parametrize("case", sorted(CASES))
def test_nemotron_h_config_from_metadata(tmp_path, case):
    """The file's config normalizes like the original's but for the context bound (no rotary:
    llama.cpp's converter writes 2**20 positions)."""
    model = _model(case)
    write_nemotron_h_gguf(model, tmp_path / "m.gguf")
    got = normalize(hf_config(read_header(tmp_path / "m.gguf")), MAX_CONTEXT)
    want = normalize(model.config, MAX_CONTEXT)
    assert [layer.kind for layer in got.layers] == [layer.kind for layer in want.layers]
    assert got.max_positions == 2**20
    got_fields, want_fields = dict(vars(got)), dict(vars(want))
    got_fields.pop("max_positions"), want_fields.pop("max_positions")
    assert got_fields == want_fields


@pytest.mark.parametrize("case", sorted(CASES))
def test_nemotron_h_file_gives_the_original_logits(tmp_path, case):
    """The streamed model's parameters have the original's shapes (A back as A_log, q / k rows
    un-permuted: equal to the original's), and its logits and its fused graph's match the original
    transformers model's within STREAM_TOL / GRAPH_TOL of the largest logit."""
    model = _model(case)
    write_nemotron_h_gguf(model, tmp_path / "m.gguf")
    streamed = open_gguf(read_header(tmp_path / "m.gguf"))
    source = source_of(streamed)
    for name, p in model.named_parameters():
        got = source.get(name)
        assert got.shape == p.shape, name
        assert torch.allclose(got, p.detach(), rtol=0, atol=1e-6), name  # log(-(-exp(x))) in float32
        if not name.endswith("A_log"):
            assert torch.equal(got, p.detach()), name
    ids = hybrid_ids()
    ref = reference_logits(model, ids)
    scale = max(1.0, float(np.abs(ref).max()))
    assert np.abs(reference_logits(streamed, ids) - ref).max() <= STREAM_TOL * scale
    graph = fused_graph_logits(streamed, tmp_path / "g", ids)
    assert np.abs(graph - ref).max() <= GRAPH_TOL * scale
    assert (graph.argmax(-1) == ref.argmax(-1)).all()


def _rewrite(src, path, **changes) -> None:
    """A copy of the GGUF file at src with some nemotron_h.* keys replaced (value None: dropped)."""
    reader = GGUFReader(src)
    w = GGUFWriter(str(path), "nemotron_h")
    for field in reader.fields.values():
        if not field.name.startswith("nemotron_h."):
            continue
        key = field.name.removeprefix("nemotron_h.")
        value = changes.pop(key, field.contents())
        if value is None:
            continue
        if isinstance(value, list):
            w.add_array(field.name, value)
        elif isinstance(value, float):
            w.add_float32(field.name, value)
        elif isinstance(value, bool):
            w.add_bool(field.name, value)
        else:
            w.add_uint32(field.name, value)
    for key, value in changes.items():
        w.add_uint32(f"nemotron_h.{key}", value)
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data).reshape([int(n) for n in reversed(t.shape.tolist())]))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(expert_count=4), "nemotron_h file has experts"),
        (dict(feed_forward_length=128), "nemotron_h.feed_forward_length must hold one count per layer"),
    ],
    ids=["experts", "one-mlp-width"],
)
def test_nemotron_h_files_it_cannot_read_are_refused_in_one_line(tmp_path, changes, message):
    write_nemotron_h_gguf(_model("nemotron_h"), tmp_path / "m.gguf")
    _rewrite(tmp_path / "m.gguf", tmp_path / "e.gguf", **changes)
    with pytest.raises(FormatError, match=message) as info:
        read_header(tmp_path / "e.gguf")
    assert "\n" not in str(info.value)
