"""Attention of a layer whose shapes differ from the graph's caches, or which owns no cache
(Gemma 4), written for both forms through the operators' attention():

- a layer of head_dim D narrower than the caches' D_max (cfg.head_dim: the widest layer's)
  pads q, k and v with zeros to D_max per head: q.k and the softmax are unchanged, the padded value
  dims come out 0 and are sliced off before o_proj; rotary over the layer's own table rotates its
  first dims only (the table's rotary dims), so the padding stays 0;
- values through a weightless RMSNorm per head (ArchSpec.v_norm);
- keys as values (attention_k_eq_v): a layer without v_proj uses k_proj's output, before k_norm
  and rotary, as its values;
- K/V sharing (LayerSpec.kv_source): the layer projects q only and attends over the past and new
  rows of its source's cache (the operators' `shared` attention), writing none.

    q|k|v [1, S, (H + 2 H_kv) D] (q|k: keys as values; q: a sharing layer) -> [1, S, H D]
"""

from __future__ import annotations

import numpy as np
import torch

from ..models.config import UnsupportedConfig


def head_norm(c, x: str, module: torch.nn.Module | None, heads: int, head_dim: int) -> str:
    """RMSNorm over head_dim of x [1, S, heads D] -> [1, S, heads D]; module None: weightless
    (a weight of ones, with the model's eps)."""
    g = c.g
    (y,) = g.op("Reshape", [x, g.const("shape", np.array([1, -1, heads, head_dim], np.int64))])
    if module is None:
        y = c.ops.norm(g, y, g.weight("ones", torch.ones(head_dim)), c.cfg.norm_eps)
    else:
        y = c.rms(y, module, "head_norm")
    return g.op("Reshape", [y, g.const("shape", np.array([1, -1, heads * head_dim], np.int64))])[0]


def _pad_heads(c, x: str, heads: int, head_dim: int) -> str:
    """[1, S, heads D] -> [1, S, heads D_max], each head's dims D .. D_max - 1 zero."""
    g, width = c.g, c.cfg.head_dim
    if head_dim == width:
        return x
    (y,) = g.op("Reshape", [x, g.const("shape", np.array([1, -1, heads, head_dim], np.int64))])
    (y,) = g.op("Pad", [y, g.const("pads", np.array([0, 0, 0, 0, 0, 0, 0, width - head_dim], np.int64))])
    return g.op("Reshape", [y, g.const("shape", np.array([1, -1, heads * width], np.int64))])[0]


def _unpad_heads(c, x: str, heads: int, head_dim: int) -> str:
    """[1, S, heads D_max] -> [1, S, heads D] (the first D dims of each head)."""
    g, width = c.g, c.cfg.head_dim
    if head_dim == width:
        return x
    (y,) = g.op("Reshape", [x, g.const("shape", np.array([1, -1, heads, width], np.int64))])
    i64 = lambda stem, v: g.const(stem, np.array(v, np.int64))  # noqa: E731
    (y,) = g.op("Slice", [y, i64("start", [0]), i64("end", [head_dim]), i64("axis", [3])])
    return g.op("Reshape", [y, g.const("shape", np.array([1, -1, heads * head_dim], np.int64))])[0]


def layer_attention(c, i: int, attn: torch.nn.Module, qkv: str) -> str:
    """Layer i's attention on its projections qkv (module docstring) -> [1, S, H D] before o_proj.
    The k, v it gives its cache's attention are kept in c.kv_rows[i] for the layers sharing it."""
    g, cfg, arch = c.g, c.cfg, c.cfg.arch
    spec = cfg.layers[i]
    H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.layer_head_dim(i)
    shared = spec.kv_source is not None
    kv_parts = 0 if shared else (1 if getattr(attn, "v_proj", None) is None else 2)
    widths = [H * D] + [Hkv * D] * kv_parts
    parts = g.op("Split", [qkv, g.const("split", np.array(widths, np.int64))], len(widths), axis=-1)
    q = _pad_heads(c, head_norm(c, parts[0], getattr(attn, arch.q_norm), H, D), H, D)
    if shared:
        if spec.kv_source not in c.kv_rows:
            raise UnsupportedConfig(f"layer {i} reads layer {spec.kv_source}'s K/V, which no earlier layer wrote")
        inputs = [q, *c.kv_rows[spec.kv_source]]
    else:
        k_raw = parts[1]
        v = k_raw if kv_parts == 1 else parts[2]  # keys as values: k_proj's output before its norm
        k = head_norm(c, k_raw, getattr(attn, arch.k_norm), Hkv, D)
        if arch.v_norm:
            v = head_norm(c, v, None, Hkv, D)
        k, v = _pad_heads(c, k, Hkv, D), _pad_heads(c, v, Hkv, D)
        c.kv_rows[i] = (k, v)
        inputs = [q, k, v]
    out = c.ops.attention(g, cfg.kv_layer(i), inputs, c.call, c.shape, spec.rope, spec.window, shared=shared)
    return _unpad_heads(c, out, H, D)
