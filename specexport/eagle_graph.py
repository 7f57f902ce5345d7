"""The EAGLE-3 head as one fused ONNX graph (contract 1.2, docs/graph-contract.md; its portable
form, standard ops and a time-major cache, is eagle_portable.py).

One graph serves the catch-up call (rows whose input is the target's features) and the chained
draft steps (rows whose input is the head's own previous hidden state): the row input is
h = fc(features) + draft_hidden, and the caller zeroes the side it does not use (fc has no bias,
so this is exact). Per row, with e the target's embedding of the row's token:

    x      = [input_layernorm(e), hidden_norm(h)]                 [1, S, 2H]
    r      = attention(x) + h                                     rotary, own in-place KV cache
    hidden = r + mlp(post_attention_layernorm(r))                 [1, S, H]
    logits = lm_head(norm(hidden[rows]))                          [1, R, V_draft]

    input_ids              int64    [1, S]        the token paired with each row
    features               float32  [1, S, F]     the target's hidden_states rows (F = 3 H_t)
    draft_hidden           float32  [1, S, H]     the head's own earlier hidden_out rows
    logits_index           int64    [R]
    seqlens_k, total_sequence_length, past_key_0, past_value_0: as the fused target (one layer)
 -> logits                 float32  [1, R, V_draft]   over the draft vocabulary (d2t maps to target ids)
    hidden_out             float32  [1, R, H]
    present_key_0, present_value_0

Precision (recipe draft.eagle3.precision): fp32; fp16 (every weight, activation and the KV cache
in float16, the I/O above stays float32 through Casts; for CUDA); int8 (weight-only: every MatMul
a MatMulNBits over int8 round-to-nearest blocks of 32 inputs at accuracy level 4, the embedding
copy a GatherBlockQuantized int8 table: a quarter of the fp32 head's memory). A draft's numerics
never touch exactness: rejection sampling keeps the target's distribution whatever q is.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from onnx import TensorProto, helper

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec

from .export import ExportResult
from .formats.blocks import rtn_quantize
from .fused_slots import tree_inputs
from .graph_writer import MS, Graph, activation, save_graph
from .nbits import gather_nbits, matmul_nbits

HEAD_FEATURES, HEAD_HIDDEN, HEAD_HIDDEN_OUT = contract.HEAD_FEATURES, contract.HEAD_HIDDEN, contract.HEAD_HIDDEN_OUT
HEAD_PRECISIONS = ("fp32", "fp16", "int8")
INT8_BLOCK = 32  # inputs per quantization block of an int8 head
INT8_ACCURACY_LEVEL = 4  # int8 activations: ONNX Runtime's fast CPU path


def _rotary(theta: float, head_dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [T, D/2] of the default rotary embedding (fp32 products, as transformers)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [D/2]
    freqs = (inv_freq[:, None] @ torch.arange(positions, dtype=torch.float32)[None, :]).t()
    return freqs.cos().numpy(), freqs.sin().numpy()


def head_spec(
    config, precision: str = "fp32", kv_layout: str = contract.HEAD_MAJOR_INPLACE, tree: bool = False
) -> GraphSpec:
    """The head graph's cache facts (one layer, the head's own KV heads); kv_layout: this fused
    graph's, or time_major for the portable head (eagle_portable.py); tree: its tree graph (1.8)."""
    kv_dtype = "float16" if precision == "fp16" else "float32"
    return GraphSpec(
        1,
        config.num_key_value_heads,
        config.head_dim,
        config.draft_vocab_size,
        kv_dtype,
        kv_layout=kv_layout,
        feature_width=3 * config.target_hidden_size,
        kind=contract.EAGLE3_HEAD,
        hidden_width=config.hidden_size,
        tree=tree,
    )


def build_eagle3_head(
    head, embedding: torch.Tensor, out_dir: Path, max_context: int, precision: str = "fp32", tree: bool = False
) -> ExportResult:
    """Write out_dir/model.onnx (+ data) for `head` (formats.eagle3.Eagle3Head); `embedding` is
    the target's input embedding [V_target, H] (a published head usually ships none).
    tree: the head's tree graph (contract 1.8): two more inputs after the cursor inputs,
    position_ids [1, S] (each row's rotary position) and tree_bias [S, M] (additive, over the
    last M cache rows, the call's S rows last; fused_slots.tree_inputs), same weights."""
    if precision not in HEAD_PRECISIONS:
        raise ValueError(f"head precision {precision!r}: expected one of {', '.join(HEAD_PRECISIONS)}")
    start = time.perf_counter()
    c, w = head.config, head.weights
    H, Hq, Hkv, D = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    g = Graph(torch.float16 if precision == "fp16" else torch.float32)
    spec = head_spec(c, precision, tree=tree)
    float_type = TensorProto.FLOAT16 if precision == "fp16" else TensorProto.FLOAT
    cos, sin = _rotary(c.rope_theta, D, max_context)
    cos_name, sin_name = g.const("cos_cache", cos.astype(g.np_dtype)), g.const("sin_cache", sin.astype(g.np_dtype))
    eps = float(c.rms_norm_eps)

    def rms(x: str, name: str) -> str:
        return g.op("SimplifiedLayerNormalization", [x, g.weight("norm", w[name])], axis=-1, epsilon=eps, stash_type=1)[
            0
        ]

    def linear(x: str, *names: str) -> str:  # weights [N_i, K] stacked along N
        weight = torch.cat([w[n] for n in names], 0)  # [N, K]
        if precision == "int8":
            blocks = rtn_quantize(weight.float().numpy(), 8, INT8_BLOCK)
            return matmul_nbits(g, x, blocks, g.name("w"), INT8_ACCURACY_LEVEL)
        return g.op("MatMul", [x, g.weight("w", weight.t())])[0]

    def to_float(name: str) -> str:  # float32 graph input -> the graph's float type
        return g.op("Cast", [name], to=float_type)[0] if precision == "fp16" else name

    if precision == "int8":  # [1, S, H] rows of an int8 table
        e = gather_nbits(g, contract.INPUT_IDS, rtn_quantize(embedding.float().numpy(), 8, INT8_BLOCK), "embed")
    else:
        (e,) = g.op("Gather", [g.weight("embed", embedding), contract.INPUT_IDS])  # [1, S, H]
    (h,) = g.op("Add", [linear(to_float(HEAD_FEATURES), "fc.weight"), to_float(HEAD_HIDDEN)])  # [1, S, H]
    (x,) = g.op("Concat", [rms(e, "midlayer.input_layernorm.weight"), rms(h, "midlayer.hidden_norm.weight")], axis=-1)
    qkv = linear(x, *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkv"))  # [1, S, (Hq + 2 Hkv) D]
    tree_in = tree_inputs(g, float_type, span=True) if tree else []  # [position_ids, bias [1, 1, S, P + S]]
    a, _, _ = g.op(
        "GroupQueryAttention",
        [
            qkv,
            "",
            "",
            contract.past_key(0),
            contract.past_value(0),
            contract.SEQLENS_K,
            contract.TOTAL_SEQUENCE_LENGTH,
            cos_name,
            sin_name,
            *tree_in,
        ],
        [g.name("attn"), contract.present_key(0), contract.present_value(0)],
        domain=MS,
        num_heads=Hq,
        kv_num_heads=Hkv,
        scale=D**-0.5,
        do_rotary=1,
        rotary_interleaved=0,
    )
    (r,) = g.op("Add", [linear(a, "midlayer.self_attn.o_proj.weight"), h])
    y = rms(r, "midlayer.post_attention_layernorm.weight")
    gate, up = linear(y, "midlayer.mlp.gate_proj.weight"), linear(y, "midlayer.mlp.up_proj.weight")
    (act,) = g.op("Mul", [activation(g, gate, "silu"), up])
    (hidden,) = g.op("Add", [linear(act, "midlayer.mlp.down_proj.weight"), r])  # [1, S, H]
    (rows,) = g.op("Gather", [hidden, contract.LOGITS_INDEX], axis=1)  # [1, R, H]
    logits = linear(rms(rows, "norm.weight"), "lm_head.weight")  # [1, R, V_draft]
    if precision == "fp16":  # float32 outputs
        g.op("Cast", [rows], [HEAD_HIDDEN_OUT], to=TensorProto.FLOAT)
        g.op("Cast", [logits], [contract.LOGITS], to=TensorProto.FLOAT)
    else:
        g.op("Identity", [rows], [HEAD_HIDDEN_OUT])
        g.op("Identity", [logits], [contract.LOGITS])

    cache = [1, Hkv, "cache_rows", D]
    inputs = [
        helper.make_tensor_value_info(contract.INPUT_IDS, TensorProto.INT64, [1, "seq"]),
        helper.make_tensor_value_info(HEAD_FEATURES, TensorProto.FLOAT, [1, "seq", 3 * c.target_hidden_size]),
        helper.make_tensor_value_info(HEAD_HIDDEN, TensorProto.FLOAT, [1, "seq", H]),
        helper.make_tensor_value_info(contract.LOGITS_INDEX, TensorProto.INT64, ["rows"]),
        helper.make_tensor_value_info(contract.SEQLENS_K, TensorProto.INT32, [1]),
        helper.make_tensor_value_info(contract.TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, []),
    ]
    if tree:
        inputs += [
            helper.make_tensor_value_info(contract.POSITION_IDS, TensorProto.INT64, [1, "seq"]),
            helper.make_tensor_value_info(contract.TREE_BIAS, TensorProto.FLOAT, ["seq", "span"]),
        ]
    inputs += [
        helper.make_tensor_value_info(contract.past_key(0), float_type, cache),
        helper.make_tensor_value_info(contract.past_value(0), float_type, cache),
    ]
    outputs = [
        helper.make_tensor_value_info(contract.LOGITS, TensorProto.FLOAT, [1, "rows", c.draft_vocab_size]),
        helper.make_tensor_value_info(HEAD_HIDDEN_OUT, TensorProto.FLOAT, [1, "rows", H]),
        helper.make_tensor_value_info(contract.present_key(0), float_type, cache),
        helper.make_tensor_value_info(contract.present_value(0), float_type, cache),
    ]
    version = contract.HEAD_TREE_VERSION if tree else contract.ROW_PADDING_VERSION
    return save_graph(g, "specexport_eagle3_head", inputs, outputs, spec, version, out_dir, start)
