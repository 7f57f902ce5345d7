"""GGUF files of Qwen3.5 (`qwen35`: Gated DeltaNet layers and gated full attention).

The files are written here as llama.cpp's converter writes them (convert_hf_to_gguf's
Qwen3_5TextModel: _LinearAttentionVReorderBase, then Qwen3NextModel, then the name table),
independently of the reader:
- value heads, grouped by key head in Hugging Face (k0v0, k0v1, k1v0, k1v1), tiled
  (k0v0, k1v0, k0v1, k1v1) in in_proj_qkv's v rows, in_proj_z rows, in_proj_a / in_proj_b rows,
  A_log, dt_bias, the conv's v channels and out_proj's inputs (`_tile`: its `_reorder_v_heads`);
- A stored as -exp(A_log), dt_bias renamed dt_proj.bias, the conv [C, 1, K] squeezed to [C, K];
- every `*norm.weight` stored as 1 + w except the gated DeltaNet norm (linear_attn.norm);
- metadata: ssm.conv_kernel / state_size (key head dim) / group_count (key heads) /
  time_step_rank (value heads) / inner_size (value width), attention.recurrent_layers and
  full_attention_interval, rope.dimension_count (the rotated quarter), rope.dimension_sections;
  MTP blocks appended after the decoder with nextn_predict_layers.
The reference is the original transformers model (F32 files; A round-trips through exp / log and
the norms through + 1 - 1, so equality is within a tolerance) or that model holding the file's
Q8_0 weights (quantizing rows of blocks commutes with the converter's row moves and with moves
of whole 32-input blocks, so the reference needs no reordering).
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from gguf import MODEL_ARCH, GGUFWriter, get_tensor_name_map
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from gguf_support import T, fused_graph_logits, hybrid_ids
from tiny import make_model

from specexport.build.validate import FeedRunner, reference_logits
from specexport.formats.blocks import FormatError
from specexport.formats.gguf_config import hf_config, read_header
from specexport.graphs.decoder import build_decoder
from specexport.graphs.quantized_target import QuantizedWeights
from specexport.models.config import normalize
from specexport.models.gguf_source import open_gguf, read_gguf_blocks
from specexport.models.streaming import source_of

MAX_CONTEXT = 128
EPS = float(np.float32(1e-6))  # the metadata holds float32
# |logit| diff from the reference transformers model's, over its max |logit| (measured: 7e-7, 1e-5)
STREAM_TOL = 1e-5  # the GGUF-streamed transformers model
GRAPH_TOL = 5e-5  # its fused graph
MROPE_SECTIONS = [11, 11, 10, 0]  # the converter's default when rope_parameters has no mrope_section


def _tile(t: np.ndarray, axis: int, key_heads: int, per_key: int, dim: int) -> np.ndarray:
    """The converter's `_reorder_v_heads`: the axis viewed as [key_heads, per_key, dim], the first
    two swapped."""
    shape = list(t.shape)
    view = t.reshape(shape[:axis] + [key_heads, per_key, dim] + shape[axis + 1 :])
    return np.swapaxes(view, axis, axis + 1).reshape(shape)


def _converted(c, name: str, value: np.ndarray) -> tuple[str, np.ndarray]:
    """(checkpoint name after the converter's renames, value) of one Hugging Face parameter."""
    kh, vh = c.linear_num_key_heads, c.linear_num_value_heads
    r, dk, dv = vh // kh, c.linear_key_head_dim, c.linear_value_head_dim
    if "linear_attn." in name and kh != vh:
        if ".in_proj_qkv." in name:
            qk = 2 * kh * dk
            value = np.concatenate([value[:qk], _tile(value[qk:], 0, kh, r, dv)])
        elif ".in_proj_z." in name:
            value = _tile(value, 0, kh, r, dv)
        elif ".in_proj_a." in name or ".in_proj_b." in name:
            value = _tile(value, 0, kh, r, 1)
        elif name.endswith((".A_log", ".dt_bias")):
            value = _tile(value, 0, kh, r, 1)
        elif ".conv1d." in name:
            value = value.squeeze()
            qk = 2 * kh * dk
            value = np.concatenate([value[:qk], _tile(value[qk:], 0, kh, r, dv)])
        elif ".out_proj." in name:
            value = _tile(value, 1, kh, r, dv)
    if name.endswith(".A_log"):
        value = -np.exp(value)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        value = value.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        value = value + np.float32(1.0)
    return name, value


def write_qwen35_gguf(model, path, qtype=T.F32, recurrent_layers=True, mtp_layers=0) -> dict[str, np.ndarray]:
    """`model` (transformers Qwen3_5ForCausalLM) as llama.cpp's converter writes it: 2-D weights
    as `qtype` (F32 or Q8_0), the rest F32; `mtp_layers` blocks of random MTP tensors appended.
    Returns {HF name: float32 value the file's 2-D weight holds, dequantized, in HF order}."""
    c = model.config
    n = c.num_hidden_layers
    names = get_tensor_name_map(MODEL_ARCH.QWEN35, n + mtp_layers)
    w = GGUFWriter(str(path), "qwen35")
    w.add_block_count(n + mtp_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_sections(MROPE_SECTIONS)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    if recurrent_layers:  # newer converters; llama.cpp falls back to the interval without it
        recurrent = [t == "linear_attention" for t in c.layer_types] + [False] * mtp_layers
        w.add_array("qwen35.attention.recurrent_layers", recurrent)
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    if mtp_layers:
        w.add_uint32("qwen35.nextn_predict_layers", mtp_layers)
    held = {}
    for hf, p in model.named_parameters():  # a tied head appears once, as the embedding
        name, value = _converted(c, hf, p.detach().float().numpy().copy())
        gguf = names.get_name(name)
        if gguf is None:
            stem, _, suffix = name.rpartition(".")
            assert names.get_name(stem) is not None, name
            gguf = f"{names.get_name(stem)}.{suffix}"
        if value.ndim == 2 and qtype != T.F32 and "conv1d" not in name:
            raw = gguf_quantize(value, qtype)
            w.add_tensor(gguf, raw, raw_dtype=qtype)
            held[hf] = gguf_dequantize(gguf_quantize(p.detach().float().numpy(), qtype), qtype)  # HF order
            continue
        w.add_tensor(gguf, np.ascontiguousarray(value, np.float32))
    rng = np.random.default_rng(1)
    for i in range(n, n + mtp_layers):  # an MTP block: a full-attention layer with its own projections
        for kind, shape in (("attn_norm.weight", [c.hidden_size]), ("nextn.eh_proj.weight", [c.hidden_size, 128])):
            w.add_tensor(f"blk.{i}.{kind}", rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _model(**overrides):
    return make_model("qwen3_5_text", rms_norm_eps=EPS, **overrides)


def _holding(model, held):
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, value in held.items():
            params[name].copy_(torch.from_numpy(value))
    return ref.eval()


# (writer options, model overrides): the layer kinds from recurrent_layers or from the interval,
# trailing MTP blocks, as many value heads as key heads (no reorder)
CASES = {
    "qwen35": (dict(), {}),
    "qwen35-interval": (dict(recurrent_layers=False), {}),
    "qwen35-mtp": (dict(mtp_layers=1), {}),
    "qwen35-equal-heads": (dict(), dict(linear_num_value_heads=2)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_qwen35_config_from_metadata_normalizes_like_the_original(tmp_path, case):
    options, overrides = CASES[case]
    model = _model(**overrides)
    write_qwen35_gguf(model, tmp_path / "m.gguf", **options)
    header = read_header(tmp_path / "m.gguf")
    assert header.config["num_hidden_layers"] == model.config.num_hidden_layers
    got = normalize(hf_config(header), MAX_CONTEXT)
    want = normalize(model.config, MAX_CONTEXT)
    assert [layer.kind for layer in got.layers] == [layer.kind for layer in want.layers]
    assert got == want


@pytest.mark.parametrize("case", ["qwen35", "qwen35-mtp"])
def test_qwen35_file_gives_the_original_logits(tmp_path, case):
    """Every parameter reads back in the HF shape and order (value heads regrouped, A back as
    A_log, norms without the + 1); the streamed model's logits and its fused graph's match the
    original transformers model's within STREAM_TOL / GRAPH_TOL of the largest logit."""
    options, overrides = CASES[case]
    model = _model(**overrides)
    write_qwen35_gguf(model, tmp_path / "m.gguf", **options)
    streamed = open_gguf(read_header(tmp_path / "m.gguf"))
    source = source_of(streamed)
    for name, p in model.named_parameters():
        got = source.get(name)
        assert got.shape == p.shape, name
        assert torch.allclose(got, p.detach(), rtol=0, atol=1e-6), name  # log(-(-exp(x))), (1 + w) - 1
    ids = hybrid_ids()
    ref = reference_logits(model, ids)
    scale = max(1.0, float(np.abs(ref).max()))
    assert np.abs(reference_logits(streamed, ids) - ref).max() <= STREAM_TOL * scale
    graph = fused_graph_logits(streamed, tmp_path / "g", ids)
    assert np.abs(graph - ref).max() <= GRAPH_TOL * scale
    assert (graph.argmax(-1) == ref.argmax(-1)).all()


def test_qwen35_q8_0_blocks_come_back_in_hugging_face_order(tmp_path):
    """Q8_0 weights: the exact blocks of every reordered projection (rows, and out_proj's inputs
    moved a whole head of 32 = one block at a time) dequantize to what `get` reads, which is the
    original weight's own Q8_0 round trip; the streamed model's logits equal those of the model
    holding those values."""
    model = _model(linear_key_head_dim=32, linear_value_head_dim=32)
    held = write_qwen35_gguf(model, tmp_path / "m.gguf", qtype=T.Q8_0)
    streamed = open_gguf(read_header(tmp_path / "m.gguf"))
    source = source_of(streamed)
    layer = "model.layers.0.linear_attn."
    for name in (f"{layer}{p}.weight" for p in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj")):
        blocks = source.blocks.get(name)
        assert blocks is not None, name
        assert np.array_equal(blocks.dequantize(), held[name]), name
        assert np.array_equal(source.get(name).numpy(), held[name]), name
    for name, value in held.items():
        assert np.array_equal(source.get(name).numpy(), value), name
    reference = _holding(model, held)
    ids = hybrid_ids()
    ref = reference_logits(reference, ids)
    assert np.abs(ref - reference_logits(model, ids)).max() > 0  # the rounding is real
    scale = max(1.0, float(np.abs(ref).max()))
    assert np.abs(reference_logits(streamed, ids) - ref).max() <= STREAM_TOL * scale


def test_qwen35_q8_0_blocks_in_the_quantized_target_compute_the_file(tmp_path):
    """The file's own Q8_0 blocks (read_gguf_blocks: every 2-D weight, value heads regrouped) as
    the fused graph's MatMulNBits at accuracy_level 1: a prefill and a 5-token verify call give
    the logits of the model holding the file's values, within GRAPH_TOL, argmax equal."""
    model = _model(linear_key_head_dim=32, linear_value_head_dim=32)
    held = write_qwen35_gguf(model, tmp_path / "m.gguf", qtype=T.Q8_0)
    blocks = read_gguf_blocks(tmp_path / "m.gguf")
    assert set(blocks) == set(held)
    streamed = open_gguf(read_header(tmp_path / "m.gguf"))
    result = build_decoder(
        streamed, tmp_path / "g", 128, weights=QuantizedWeights("gguf", 32, 1, "checkpoint", "fp32", blocks)
    )
    assert any(
        node.op_type == "MatMulNBits" for node in onnx.load(str(result.path), load_external_data=False).graph.node
    )
    runner = FeedRunner(result.path, result.spec)
    ids = hybrid_ids()
    n0 = len(ids) - 5
    got = np.concatenate([runner.run(ids[:n0], list(range(n0))), runner.run(ids[n0:], list(range(5)))])
    ref = reference_logits(_holding(model, held), ids)
    assert np.abs(got - ref).max() <= GRAPH_TOL * max(1.0, float(np.abs(ref).max()))
    assert (got.argmax(-1) == ref.argmax(-1)).all()


def test_qwen35_out_proj_heads_narrower_than_a_block_fall_back_to_dequantized(tmp_path):
    """Value heads of 16 inputs cannot move as whole Q8_0 blocks of 32: out_proj has no exact
    blocks (None: a quantized target dequantizes it) while `get` still reads it in HF order."""
    model = _model()  # linear_value_head_dim 16
    held = write_qwen35_gguf(model, tmp_path / "m.gguf", qtype=T.Q8_0)
    source = source_of(open_gguf(read_header(tmp_path / "m.gguf")))
    name = "model.layers.0.linear_attn.out_proj.weight"
    assert source.blocks.get(name) is None
    assert source.blocks.get("model.layers.0.linear_attn.in_proj_z.weight") is not None
    # the file's Q8_0 blocks hold the tiled columns: dequantized and regrouped, they are not the
    # HF-order round trip, so compare with the tiled weight's round trip regrouped by the test
    c = model.config
    tiled = _tile(model.get_parameter(name).detach().numpy(), 1, 2, 2, 16)
    file_value = gguf_dequantize(gguf_quantize(tiled, T.Q8_0), T.Q8_0)
    regrouped = _tile(file_value, 1, 2, 2, 16)  # the 2 x 2 swap is its own inverse
    assert c.linear_num_value_heads // c.linear_num_key_heads == c.linear_num_key_heads == 2
    assert np.array_equal(source.get(name).numpy(), regrouped)
    assert not np.array_equal(regrouped, held[name])


@pytest.mark.parametrize("arch", ["qwen35moe", "nemotron_h_moe"])
def test_moe_hybrid_architectures_are_refused_in_one_line(tmp_path, arch):
    w = GGUFWriter(str(tmp_path / "f.gguf"), arch)
    w.add_expert_count(4)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()
    with pytest.raises(FormatError, match=f"GGUF architecture '{arch}' is not supported") as info:
        read_header(tmp_path / "f.gguf")
    message = str(info.value)
    assert "qwen35" in message and "nemotron_h" in message and "\n" not in message
