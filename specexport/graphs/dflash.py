"""A DFlash block drafter as one ONNX graph (feature dflash_block, time_major; docs/graph-contract.md):
standard ops at opset 17, float32.

One call holds C context rows and B block rows at positions P .. P+C+B-1 (P: the drafter's
cache rows). With E the target's input embedding, W_out its output head:

    ctx      = norm_ctx(context @ fc)                           [1, C, H]  the same for every layer
    x        = E[input_ids]                                     [1, B, H]  anchor, then masks
    per layer l:
      h      = input_layernorm(x)                               [1, B, H]
      kv_in  = [ctx, h]                                         [1, C+B, H]
      q      = rope(q_norm(h @ Wq))                             [1, B, Hq, D]    at P+C .. P+C+B-1
      k, v   = rope(k_norm(kv_in @ Wk)), kv_in @ Wv             [1, C+B, Hkv, D]  at P .. P+C+B-1 (new_*_l)
      x      = x + softmax(q [past_k, k]^T / sqrt(D)) [past_v, v] @ Wo     every key visible (no mask)
      x      = x + down(silu(gate(y)) * up(y)),  y = post_attention_layernorm(x)
    logits   = norm(x[logits_index]) @ W_out^T                  [1, R, V]

    input_ids      int64    [1, B]
    context        float32  [1, C, F]          F = len(target_layer_ids) x H; C may be 0
    logits_index   int64    [R]
    past_key_{l}   float32  [1, P, Hkv, D]
 -> logits         float32  [1, R, V]
    new_key_{l}    float32  [1, C+B, Hkv, D]
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from onnx import TensorProto, helper

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec

from ..models.dflash import DFlashDrafter
from .ops_portable import PortableOps
from .scan import f32, i64
from .writer import ExportResult, Graph, save_graph


def dflash_spec(drafter: DFlashDrafter, vocab_rows: int) -> GraphSpec:
    """The drafter graph's cache facts: its own layers and K/V heads, the target's vocabulary."""
    c = drafter.config
    return GraphSpec(
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        vocab_rows,
        kv_layout=contract.TIME_MAJOR,
        feature_width=c.feature_width,
        kind=contract.DFLASH_BLOCK,
    )


def _rope_tables(g: Graph, positions: str, theta: float, D: int) -> tuple[str, str]:
    """cos, sin [N, 1, D] float32 of positions [N] (transformers' default rotary)."""
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))  # [D/2]
    (p,) = g.op("Unsqueeze", [g.op("Cast", [positions], to=TensorProto.FLOAT)[0], i64(g, "axes", [1])])  # [N, 1]
    (freqs,) = g.op("Mul", [p, g.const("inv_freq", inv.numpy()[None, :])])  # [N, D/2]
    (emb,) = g.op("Unsqueeze", [g.op("Concat", [freqs, freqs], axis=-1)[0], i64(g, "axes", [1])])  # [N, 1, D]
    return g.op("Cos", [emb])[0], g.op("Sin", [emb])[0]


def _rope(g: Graph, x: str, cos: str, sin: str, D: int) -> str:
    """x [1, N, heads, D] -> x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1]."""
    half = D // 2
    axis = i64(g, "axis", [3])
    (x1,) = g.op("Slice", [x, i64(g, "s", [0]), i64(g, "e", [half]), axis])
    (x2,) = g.op("Slice", [x, i64(g, "s", [half]), i64(g, "e", [D]), axis])
    (rot,) = g.op("Concat", [g.op("Neg", [x2])[0], x1], axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos])[0], g.op("Mul", [rot, sin])[0]])[0]


def build_dflash_graph(
    drafter: DFlashDrafter, embedding: torch.Tensor, head: torch.Tensor | None, out_dir: Path
) -> ExportResult:
    """Write out_dir/model.onnx (+ data). embedding: the target's input embedding [V, H] as its
    decoder sees it (scaled where the family scales it); head: the target's output head [V, H],
    None when it is the embedding itself (tied, stored once)."""
    start = time.perf_counter()
    c, w = drafter.config, drafter.weights
    Hq, Hkv, D, H = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size
    g = Graph(torch.float32)
    ops = PortableOps()
    spec = dflash_spec(drafter, int(embedding.shape[0]))
    eps = c.rms_norm_eps

    def rms(x: str, name: str) -> str:
        return ops.norm(g, x, g.weight("norm", w[name]), eps)

    def linear(x: str, name: str) -> str:
        return g.op("MatMul", [x, g.weight("w", w[name].t())])[0]

    # positions: context rows P .. P+C-1, block rows P+C .. P+C+B-1
    (past,) = g.op("Shape", [contract.past_key(0)], start=1, end=2)  # [1] = P
    (n_ctx,) = g.op("Shape", [contract.DFLASH_CONTEXT], start=1, end=2)  # [1] = C
    (n_blk,) = g.op("Shape", [contract.INPUT_IDS], start=1, end=2)  # [1] = B
    squeeze = i64(g, "axes", [0])
    (p0,) = g.op("Squeeze", [past, squeeze])
    (p_blk,) = g.op("Squeeze", [g.op("Add", [past, n_ctx])[0], squeeze])
    (p_end,) = g.op("Squeeze", [g.op("Add", [g.op("Add", [past, n_ctx])[0], n_blk])[0], squeeze])
    (kv_pos,) = g.op("Range", [p0, p_end, i64(g, "one", 1)])  # [C+B]
    (q_pos,) = g.op("Range", [p_blk, p_end, i64(g, "one", 1)])  # [B]
    kv_cos, kv_sin = _rope_tables(g, kv_pos, c.rope_theta, D)
    q_cos, q_sin = _rope_tables(g, q_pos, c.rope_theta, D)

    fc, fc_norm = "encoder.fc.weight", "encoder.output_norm_enc.weight"
    ctx = rms(linear(contract.DFLASH_CONTEXT, fc), fc_norm)  # [1, C, H]
    table = g.weight("embed", embedding)
    (x,) = g.op("Gather", [table, contract.INPUT_IDS])  # [1, B, H]
    heads_shape = lambda n: i64(g, "shape", [1, -1, n, D])  # noqa: E731
    kv_shape = i64(g, "shape", [-1, Hkv, D])
    rep = Hq // Hkv
    for layer in range(c.num_layers):
        pre = f"layers.{layer}."
        h = rms(x, pre + "input_layernorm.weight")  # [1, B, H]
        (kv_in,) = g.op("Concat", [ctx, h], axis=1)  # [1, C+B, H]
        (q,) = g.op("Reshape", [linear(h, pre + "self_attn.q_proj.weight"), heads_shape(Hq)])  # [1, B, Hq, D]
        (k,) = g.op("Reshape", [linear(kv_in, pre + "self_attn.k_proj.weight"), heads_shape(Hkv)])
        q = _rope(g, rms(q, pre + "self_attn.q_norm.weight"), q_cos, q_sin, D)
        new_k, new_v = contract.new_key(layer), contract.new_value(layer)
        g.op("Identity", [_rope(g, rms(k, pre + "self_attn.k_norm.weight"), kv_cos, kv_sin, D)], [new_k])
        g.op("Reshape", [linear(kv_in, pre + "self_attn.v_proj.weight"), heads_shape(Hkv)], [new_v])
        # attention: q grouped [Hkv, rep, B, D] against keys [Hkv, 1, D, T], T = P + C + B, no mask
        (k_all,) = g.op("Concat", [contract.past_key(layer), new_k], axis=1)  # [1, T, Hkv, D]
        (v_all,) = g.op("Concat", [contract.past_value(layer), new_v], axis=1)
        (qg,) = g.op("Transpose", [g.op("Reshape", [q, i64(g, "s", [-1, Hkv, rep, D])])[0]], perm=[1, 2, 0, 3])
        (kt,) = g.op("Transpose", [g.op("Reshape", [k_all, kv_shape])[0]], perm=[1, 2, 0])  # [Hkv, D, T]
        (vt,) = g.op("Transpose", [g.op("Reshape", [v_all, kv_shape])[0]], perm=[1, 0, 2])  # [Hkv, T, D]
        axes1 = i64(g, "axes", [1])
        (scores,) = g.op("MatMul", [qg, g.op("Unsqueeze", [kt, axes1])[0]])  # [Hkv, rep, B, T]
        (probs,) = g.op("Softmax", [g.op("Mul", [scores, f32(g, "scale", D**-0.5)])[0]], axis=-1)
        (out,) = g.op("MatMul", [probs, g.op("Unsqueeze", [vt, axes1])[0]])  # [Hkv, rep, B, D]
        (out,) = g.op("Reshape", [g.op("Transpose", [out], perm=[2, 0, 1, 3])[0], i64(g, "s", [1, -1, Hq * D])])
        (x,) = g.op("Add", [x, linear(out, pre + "self_attn.o_proj.weight")])
        y = rms(x, pre + "post_attention_layernorm.weight")
        gate, up = linear(y, pre + "mlp.gate_proj.weight"), linear(y, pre + "mlp.up_proj.weight")
        (act,) = g.op("Mul", [ops.activation(g, gate, "silu"), up])
        (x,) = g.op("Add", [x, linear(act, pre + "mlp.down_proj.weight")])  # [1, B, H]
    (rows,) = g.op("Gather", [x, contract.LOGITS_INDEX], axis=1)  # [1, R, H]
    (rows,) = g.op("Reshape", [rms(rows, "norm.weight"), i64(g, "s", [-1, H])])  # [R, H]
    out_table = table if head is None else g.weight("lm_head", head)
    (logits,) = g.op("Gemm", [rows, out_table], transB=1)  # [R, V]
    g.op("Unsqueeze", [logits, i64(g, "axes", [0])], [contract.LOGITS])
    inputs, outputs = _interface(spec)
    version = contract.version_for(contract.TIME_MAJOR, dflash=True)
    return save_graph(g, "specexport_dflash_block", inputs, outputs, spec, version, out_dir, start)


def _interface(spec: GraphSpec) -> tuple[list, list]:
    """Inputs and outputs in the contract's order (GraphSpec.input_names / output_names)."""
    info = helper.make_tensor_value_info
    Hkv, D, F = spec.num_kv_heads, spec.head_dim, spec.feature_width
    shapes = {
        contract.INPUT_IDS: (TensorProto.INT64, [1, "block"]),
        contract.DFLASH_CONTEXT: (TensorProto.FLOAT, [1, "context", F]),
        contract.LOGITS_INDEX: (TensorProto.INT64, ["rows"]),
        contract.LOGITS: (TensorProto.FLOAT, [1, "rows", spec.embedding_rows]),
    }
    for layer in range(spec.num_layers):
        for name in (contract.past_key(layer), contract.past_value(layer)):
            shapes[name] = (TensorProto.FLOAT, [1, "past", Hkv, D])
        for name in (contract.new_key(layer), contract.new_value(layer)):
            shapes[name] = (TensorProto.FLOAT, [1, "new", Hkv, D])
    return [info(n, *shapes[n]) for n in spec.input_names()], [info(n, *shapes[n]) for n in spec.output_names()]


__all__ = ["build_dflash_graph", "dflash_spec"]
