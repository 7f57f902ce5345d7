"""What the scan mixers (mamba.py, gdn.py) share, in ONNX standard ops: integer and float32
constants, grouped heads repeated to the heads that read them, the decay matrix of a call's rows
as a masked cumulative sum (transformers' segment_sum: no difference of two long sums), and the
choice between a mixer's two forms:

    S <= STEP_ROWS   the step recurrence, a Scan over the rows: row t's state is computed from
                     row t - 1's by the same nodes in every call, so a row's bits never depend on
                     how many rows its call had, nor on where earlier calls ended (bitwise rows:
                     speculation's verify rows equal target-only decoding's one-row calls)
    S >  STEP_ROWS   the chunked form over the call's rows ([H, S, S] matrices): a prompt
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from specexport_runtime.recurrent import STEP_ROWS

from .writer import Graph

Builder = Callable[[Graph], list[str]]  # writes a branch into its graph -> its outputs
Body = Callable[[Graph, list[str], list[str]], tuple[list[str], list[str]]]  # (states, rows) -> (states, outputs)


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


def _sub(g: Graph) -> Graph:
    """A subgraph writer that shares g's names and weights file (its constants move to g)."""
    return Graph(g.dtype, data=g.data, _n=g._n)


def _close(g: Graph, sub: Graph, name: str, inputs: list, outputs: list[str]) -> onnx.GraphProto:
    """sub's nodes as a subgraph (float32 outputs of any shape); its constants join g's (a
    subgraph reads them from the enclosing scope)."""
    g._n = sub._n
    g.inits.extend(sub.inits)
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    return helper.make_graph(sub.nodes, g.name(name), inputs, outs)


def step_or_chunk(g: Graph, rows: str, step: Builder, chunk: Builder, n_out: int) -> list[str]:
    """The outputs of step(g') when rows [S, ...] has S <= recurrent.STEP_ROWS rows, else of
    chunk(g'): an If over two branches, each writing its nodes into its own g' and returning
    n_out float32 tensors."""
    return by_rows(g, rows, 0, STEP_ROWS, step, chunk, n_out)


def by_rows(g: Graph, x: str, axis: int, limit: int, small: Builder, large: Builder, n_out: int) -> list[str]:
    """small(g')'s outputs when x has at most `limit` rows along `axis`, else large(g')'s (an If)."""
    (n,) = g.op("Shape", [x], start=axis, end=axis + 1)  # [1]
    (small_rows,) = g.op("LessOrEqual", [n, i64(g, "limit", [limit])])
    (cond,) = g.op("Squeeze", [small_rows, i64(g, "axes", [0])])
    branches = {}
    for key, build in (("then_branch", small), ("else_branch", large)):
        sub = _sub(g)
        outs = build(sub)
        assert len(outs) == n_out
        branches[key] = _close(g, sub, key, [], outs)
    return g.op("If", [cond], n_out, **branches)


def scan_rows(g: Graph, states: list[str], rows: list[str], body: Body, n_rows_out: int) -> list[str]:
    """A Scan over axis 0 of each of `rows` ([S, ...] float32) carrying `states` (float32):
    body(g', states', rows') writes one step -> (next states, per-row outputs). Returns the
    final states, then each per-row output stacked [S, ...]."""
    sub = _sub(g)
    s_in = [sub.name("state") for _ in states]
    r_in = [sub.name("row") for _ in rows]
    nxt, per_row = body(sub, s_in, r_in)
    assert len(nxt) == len(states) and len(per_row) == n_rows_out
    # a body output is a distinct name: a value that is both a state and a row output is copied
    per_row = [sub.op("Identity", [o])[0] if o in nxt else o for o in per_row]
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in (*s_in, *r_in)]
    proto = _close(g, sub, "step", info, [*nxt, *per_row])
    return g.op("Scan", [*states, *rows], len(states) + n_rows_out, body=proto, num_scan_inputs=len(rows))
