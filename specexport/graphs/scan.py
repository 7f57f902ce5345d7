"""What the scan mixers (mamba.py, gdn.py) share, in ONNX standard ops: integer and float32
constants, grouped heads repeated to the heads that read them, and the decay matrix of a call's
rows as a masked cumulative sum (transformers' segment_sum: no difference of two long sums)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .writer import Graph


def i64(g: Graph, stem: str, value) -> str:
    return g.const(stem, np.array(value, np.int64))


def f32(g: Graph, stem: str, value) -> str:
    return g.const(stem, np.asarray(value, np.float32))


def repeat_heads(g: Graph, x: str, groups: int, heads: int, dim: int) -> str:
    """x [G, S, dim] -> [H, S, dim]: head h reads group h // (H / G)."""
    rep = heads // groups
    if rep == 1:
        return x
    (x,) = g.op("Unsqueeze", [x, i64(g, "axes", [1])])  # [G, 1, S, dim]
    (x,) = g.op("Expand", [x, i64(g, "shape", [1, rep, 1, 1])])  # [G, rep, S, dim]
    return g.op("Reshape", [x, i64(g, "shape", [heads, -1, dim])])[0]


@dataclass(frozen=True)
class Decay:
    cum: str  # [H, S]: a[0] + ... + a[t], the decay of the call's initial state to row t (log)
    matrix: str  # [H, S, S]: exp(a[s + 1] + ... + a[t]) for s <= t, else 0
    strict: str  # [S, S] bool: s < t


def decay(g: Graph, a: str) -> Decay:
    """a [S, H] float32, each row's log decay -> its Decay."""
    (cum,) = g.op("Transpose", [g.op("CumSum", [a, i64(g, "axis", 0)])[0]], perm=[1, 0])
    (n,) = g.op("Squeeze", [g.op("Shape", [a], start=0, end=1)[0], i64(g, "axes", [0])])  # [] = S
    (rows,) = g.op("Range", [i64(g, "zero", 0), n, i64(g, "one", 1)])  # [S]
    (t_col,) = g.op("Unsqueeze", [rows, i64(g, "axes", [1])])  # [S, 1]
    (s_row,) = g.op("Unsqueeze", [rows, i64(g, "axes", [0])])  # [1, S]
    (lower,) = g.op("GreaterOrEqual", [t_col, s_row])  # s <= t
    (strict,) = g.op("Greater", [t_col, s_row])  # s < t
    zero = f32(g, "zero", 0.0)
    (a_t,) = g.op("Unsqueeze", [g.op("Transpose", [a], perm=[1, 0])[0], i64(g, "axes", [2])])  # [H, S(t), 1]
    (seg,) = g.op("CumSum", [g.op("Where", [strict, a_t, zero])[0], i64(g, "axis", 1)])  # [H, S, S]
    (matrix,) = g.op("Where", [lower, g.op("Exp", [seg])[0], zero])
    return Decay(cum, matrix, strict)
