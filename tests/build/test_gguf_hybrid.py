"""GGUF files of the hybrid families (formats/gguf_config.py, models/gguf_source.py).

The files are written here as llama.cpp's converter writes them, independently of the reader:
tensor names from gguf-py's TensorNameMap, and the converter's own conventions for LFM2
(convert_hf_to_gguf.py LFM2Model): attention.head_count_kv one count per layer with 0 for a conv
layer, feed_forward_length the MLP width after block_auto_adjust_ff_dim, shortconv.l_cache the
conv kernel, the conv weight [C, 1, L] squeezed to [C, L]. References are the original
transformers model (F32 files) or that model holding the file's fp16-rounded weights (F16 files);
tolerances are explicit.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map
from gguf_support import T, fused_graph_logits, hybrid_ids
from tiny import make_model

from specexport.build.validate import reference_logits
from specexport.formats.blocks import FormatError
from specexport.formats.gguf_config import hf_config, read_header
from specexport.models.config import normalize
from specexport.models.gguf_source import open_gguf
from specexport.models.streaming import source_of

MAX_CONTEXT = 128
EPS = float(np.float32(1e-5))  # the metadata holds float32: the model's epsilon as the file can say it
GRAPH_TOL = 2e-4  # |logit| diff of the fp32 graph from transformers' fp32 forward, relative to max |logit|


def write_lfm2_gguf(model, path, dtype=T.F32):
    """`model` (transformers Lfm2ForCausalLM) as llama.cpp's converter writes it; 2-D weights as
    `dtype` (F32 or F16), 1-D tensors F32. Returns {HF name: float32 value the file holds}."""
    c = model.config
    names = get_tensor_name_map(MODEL_ARCH.LFM2, c.num_hidden_layers)
    ff = model.model.layers[0].feed_forward.w1.weight.shape[0]  # the width after the auto-adjust rule
    w = GGUFWriter(str(path), "lfm2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(ff)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t != "conv" else 0 for t in c.layer_types])
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_shortconv_l_cache(c.conv_L_cache)
    held = {}
    for name, p in model.named_parameters():  # a tied head appears once, as the embedding
        stem, _, suffix = name.rpartition(".")
        gguf = names.get_name(stem)
        assert gguf is not None, name
        value = p.detach().float().numpy().copy()
        if "conv.conv" in name and value.ndim == 3:
            value = value.squeeze(1)  # [C, 1, L] -> [C, L]: the converter's "conv op requires 2d tensor"
        if value.ndim == 2 and dtype == T.F16:
            value = value.astype(np.float16)
        w.add_tensor(f"{gguf}.{suffix}", value)
        held[name] = value.astype(np.float32).reshape(p.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _holding(model, held):
    """A copy of `model` with the values the file holds."""
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, value in held.items():
            params[name].copy_(torch.from_numpy(value))
    return ref.eval()


@pytest.mark.parametrize("variant", [{}, {"conv_bias": True, "conv_L_cache": 4}], ids=["lfm2", "lfm2-bias"])
def test_lfm2_config_from_metadata_normalizes_like_the_original(tmp_path, variant):
    model = make_model("lfm2", norm_eps=EPS, **variant)
    write_lfm2_gguf(model, tmp_path / "m.gguf")
    got = normalize(hf_config(read_header(tmp_path / "m.gguf")), MAX_CONTEXT)
    want = normalize(model.config, MAX_CONTEXT)
    assert [layer.kind for layer in got.layers] == [layer.kind for layer in want.layers]
    assert got == want


@pytest.mark.parametrize("dtype", [T.F32, T.F16], ids=["F32", "F16"])
def test_lfm2_file_streams_the_model_it_holds(tmp_path, dtype):
    """Every parameter reads back as the file's value in the HF shape (the conv kernel [C, 1, L]);
    the streamed model gives the reference's logits bitwise, its fused graph within GRAPH_TOL."""
    model = make_model("lfm2", norm_eps=EPS, conv_bias=True, conv_L_cache=4)
    held = write_lfm2_gguf(model, tmp_path / "m.gguf", dtype)
    streamed = open_gguf(read_header(tmp_path / "m.gguf"))
    source = source_of(streamed)
    for name, p in model.named_parameters(remove_duplicate=False):
        got = source.get(name)
        assert got.shape == p.shape, name
        assert torch.equal(got, torch.from_numpy(held[source.canonical(name)])), name
    reference = _holding(model, held)
    ids = hybrid_ids()
    ref = reference_logits(reference, ids)
    assert np.array_equal(reference_logits(streamed, ids), ref)
    if dtype == T.F16:  # the rounding is real: the file's model is not the original
        assert np.abs(ref - reference_logits(model, ids)).max() > 0
    graph = fused_graph_logits(streamed, tmp_path / "g", ids)
    scale = max(1.0, float(np.abs(ref).max()))
    assert np.abs(graph - ref).max() <= GRAPH_TOL * scale
    assert (graph.argmax(-1) == ref.argmax(-1)).all()


def test_an_lfm2_file_without_per_layer_kv_counts_is_refused(tmp_path):
    """One shared head_count_kv says nothing about which layers are convolutions: refused in one line."""
    model = make_model("lfm2")
    c = model.config
    w = GGUFWriter(str(tmp_path / "m.gguf"), "lfm2")
    for add, value in ((w.add_block_count, 6), (w.add_embedding_length, c.hidden_size), (w.add_head_count, 4)):
        add(value)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_feed_forward_length(64)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(c.vocab_size)
    w.add_tensor("token_embd.weight", np.zeros((c.vocab_size, c.hidden_size), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()
    with pytest.raises(FormatError, match="lfm2.attention.head_count_kv must hold one count per layer") as info:
        read_header(tmp_path / "m.gguf")
    assert "\n" not in str(info.value)
