"""The EAGLE-3 head as one ONNX graph in either KV layout (feature eagle3_head;
docs/graph-contract.md), written with the decoder's operators (ops_fused.py: GroupQueryAttention
and an in-place cache; ops_portable.py: standard ops and a time-major prefix view).

One graph serves the catch-up call (rows whose input is the target's features) and the chained
draft steps (rows whose input is the head's own previous hidden state): the row input is
h = fc(features) + draft_hidden, and the caller zeroes the side it does not use (fc has no bias,
so this is exact). Per row, with e the target's embedding of the row's token:

    x      = [input_layernorm(e), hidden_norm(h)]                 [1, S, 2H]
    r      = attention(x) + h                                     rotary, own KV cache
    hidden = r + mlp(post_attention_layernorm(r))                 [1, S, H]
    logits = lm_head(norm(hidden[rows]))                          [1, R, V_draft]

    input_ids              int64    [1, S]        the token paired with each row
    features               float32  [1, S, F]     the target's hidden_states rows (F = 3 H_t)
    draft_hidden           float32  [1, S, H]     the head's own earlier hidden_out rows
    logits_index           int64    [R]
    the layout's cursor and cache inputs for one layer (fused: seqlens_k, total_sequence_length,
    past_* [1, H_kv, T_max, D]; portable: past_* [1, P, H_kv, D])
 -> logits                 float32  [1, R, V_draft]   over the draft vocabulary (d2t maps to target ids)
    hidden_out             float32  [1, R, H]
    present_key_0, present_value_0 (fused) | new_key_0, new_value_0 [1, S, H_kv, D] (portable)

Precision (recipe draft.eagle3.precision): fp32; fp16 (every weight, activation and the KV cache
in float16, the I/O above stays float32 through Casts; the portable form keeps norms and scores
in float32); int8, fused only (weight-only: every MatMul a MatMulNBits over int8 round-to-nearest
blocks of 32 inputs at accuracy level 4, the embedding copy a GatherBlockQuantized int8 table: a
quarter of the fp32 head's memory). A draft's numerics never touch exactness: rejection sampling
keeps the target's distribution whatever q is.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from onnx import TensorProto, helper

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec

from ..formats.blocks import rtn_quantize
from .nbits import gather_nbits, matmul_nbits
from .ops_fused import ops_for
from .writer import AttentionShape, ExportResult, Graph, save_graph

HEAD_FEATURES, HEAD_HIDDEN, HEAD_HIDDEN_OUT = contract.HEAD_FEATURES, contract.HEAD_HIDDEN, contract.HEAD_HIDDEN_OUT
HEAD_PRECISIONS = ("fp32", "fp16", "int8")
PORTABLE_HEAD_PRECISIONS = ("fp32", "fp16")  # int8 heads use MatMulNBits, a contrib op
INT8_BLOCK = 32  # inputs per quantization block of an int8 head
INT8_ACCURACY_LEVEL = 4  # int8 activations: ONNX Runtime's fast CPU path


def _inv_freq(theta: float, head_dim: int) -> torch.Tensor:
    """inv_freq [D/2] of the default rotary embedding (fp32, as transformers)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def head_spec(
    config, precision: str = "fp32", kv_layout: str = contract.HEAD_MAJOR_INPLACE, tree: bool = False
) -> GraphSpec:
    """The head graph's cache facts (one layer, the head's own KV heads) in kv_layout; tree: its
    tree graph (eagle3_head_tree)."""
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
    head,
    embedding: torch.Tensor,
    out_dir: Path,
    max_context: int,
    precision: str = "fp32",
    tree: bool = False,
    kv_layout: str = contract.HEAD_MAJOR_INPLACE,
) -> ExportResult:
    """Write out_dir/model.onnx (+ data) for `head` (formats.eagle3.Eagle3Head) in `kv_layout`;
    `embedding` is the target's input embedding [V_target, H] (a published head usually ships
    none). tree (fused): the head's tree graph (feature eagle3_head_tree): two more inputs after the cursor
    inputs, position_ids [1, S] (each row's rotary position) and tree_bias [S, M] (additive, over
    the last M cache rows, the call's S rows last; fused_slots.tree_inputs), same weights."""
    ops = ops_for(kv_layout)
    allowed = HEAD_PRECISIONS if ops.layout.contrib_attention else PORTABLE_HEAD_PRECISIONS
    if precision not in allowed:
        portable = not ops.layout.contrib_attention
        raise ValueError(
            f"{'portable ' if portable else ''}head precision {precision!r}: expected one of {', '.join(allowed)}"
            + (" (int8 heads use MatMulNBits: graph: fused)" if portable else "")
        )
    if tree and not ops.layout.contrib_attention:
        raise ValueError("an EAGLE-3 head's tree graph needs the fused layout (graph: fused)")
    start = time.perf_counter()
    c, w = head.config, head.weights
    Hq, Hkv, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    g = Graph(torch.float16 if precision == "fp16" else torch.float32)
    spec = head_spec(c, precision, kv_layout, tree=tree)
    shape = AttentionShape(Hq, Hkv, D, D**-0.5, None, {"all": (_inv_freq(c.rope_theta, D), 1.0)}, D)
    call = ops.prepare(g, shape, 1, tree, table_rows=max_context, span=True)
    eps = float(c.rms_norm_eps)

    def rms(x: str, name: str) -> str:
        return ops.norm(g, x, g.weight("norm", w[name]), eps)

    def linear(x: str, *names: str) -> str:  # weights [N_i, K] stacked along N
        weight = torch.cat([w[n] for n in names], 0)  # [N, K]
        if precision == "int8":
            blocks = rtn_quantize(weight.float().numpy(), 8, INT8_BLOCK)
            return matmul_nbits(g, x, blocks, g.name("w"), INT8_ACCURACY_LEVEL)
        return g.op("MatMul", [x, g.weight("w", weight.t())])[0]

    def to_float(name: str) -> str:  # float32 graph input -> the graph's float type
        return g.op("Cast", [name], to=g.elem)[0] if precision == "fp16" else name

    if precision == "int8":  # [1, S, H] rows of an int8 table
        e = gather_nbits(g, contract.INPUT_IDS, rtn_quantize(embedding.float().numpy(), 8, INT8_BLOCK), "embed")
    else:
        (e,) = g.op("Gather", [g.weight("embed", embedding), contract.INPUT_IDS])  # [1, S, H]
    (h,) = g.op("Add", [linear(to_float(HEAD_FEATURES), "fc.weight"), to_float(HEAD_HIDDEN)])  # [1, S, H]
    (x,) = g.op("Concat", [rms(e, "midlayer.input_layernorm.weight"), rms(h, "midlayer.hidden_norm.weight")], axis=-1)
    qkv = linear(x, *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkv"))  # [1, S, (Hq + 2 Hkv) D]
    a = ops.attention(g, 0, [qkv, "", ""], call, shape, "all", None)  # [1, S, Hq D]
    (r,) = g.op("Add", [linear(a, "midlayer.self_attn.o_proj.weight"), h])
    y = rms(r, "midlayer.post_attention_layernorm.weight")
    gate, up = linear(y, "midlayer.mlp.gate_proj.weight"), linear(y, "midlayer.mlp.up_proj.weight")
    (act,) = g.op("Mul", [ops.activation(g, gate, "silu"), up])
    (hidden,) = g.op("Add", [linear(act, "midlayer.mlp.down_proj.weight"), r])  # [1, S, H]
    (rows,) = g.op("Gather", [hidden, contract.LOGITS_INDEX], axis=1)  # [1, R, H]
    logits = linear(rms(rows, "norm.weight"), "lm_head.weight")  # [1, R, V_draft]
    if precision == "fp16":  # float32 outputs
        g.op("Cast", [rows], [HEAD_HIDDEN_OUT], to=TensorProto.FLOAT)
        g.op("Cast", [logits], [contract.LOGITS], to=TensorProto.FLOAT)
    else:
        g.op("Identity", [rows], [HEAD_HIDDEN_OUT])
        g.op("Identity", [logits], [contract.LOGITS])
    inputs, outputs = _interface(spec, g.elem, c)
    version = contract.version_for(kv_layout, head=True, tree=tree)
    return save_graph(g, "specexport_eagle3_head", inputs, outputs, spec, version, out_dir, start)


def _interface(spec: GraphSpec, elem: int, c) -> tuple[list, list]:
    """The head's inputs and outputs in the contract's order (GraphSpec.input_names)."""
    info = helper.make_tensor_value_info
    Hkv, D = c.num_key_value_heads, c.head_dim
    in_place = spec.layout.in_place
    past = [1, Hkv, "cache_rows", D] if in_place else [1, "past", Hkv, D]
    new = past if in_place else [1, "seq", Hkv, D]
    shapes = {
        contract.INPUT_IDS: (TensorProto.INT64, [1, "seq"]),
        HEAD_FEATURES: (TensorProto.FLOAT, [1, "seq", 3 * c.target_hidden_size]),
        HEAD_HIDDEN: (TensorProto.FLOAT, [1, "seq", c.hidden_size]),
        contract.LOGITS_INDEX: (TensorProto.INT64, ["rows"]),
        contract.SEQLENS_K: (TensorProto.INT32, [1]),
        contract.TOTAL_SEQUENCE_LENGTH: (TensorProto.INT32, []),
        contract.POSITION_IDS: (TensorProto.INT64, [1, "seq"]),
        contract.TREE_BIAS: (TensorProto.FLOAT, ["seq", "span"]),
        contract.past_key(0): (elem, past),
        contract.past_value(0): (elem, past),
        contract.LOGITS: (TensorProto.FLOAT, [1, "rows", c.draft_vocab_size]),
        HEAD_HIDDEN_OUT: (TensorProto.FLOAT, [1, "rows", c.hidden_size]),
    }
    for name in spec.layout.kv_outputs(0):
        shapes[name] = (elem, new)
    return [info(n, *shapes[n]) for n in spec.input_names()], [info(n, *shapes[n]) for n in spec.output_names()]
