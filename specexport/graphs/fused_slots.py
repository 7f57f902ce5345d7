"""GroupQueryAttention of the fused graph, for one cache or for several cache slots, and the
graph's inputs and outputs in the contract's order (`interface`).

A slots graph (feature cache_slots) serves K sequences in one call: their rows are packed one slot
after another in input_ids [1, N] (slot_rows [K] says how many each has), so every MatMul reads
its weights once for all of them, while attention runs per slot: one GroupQueryAttention node
per slot and layer, on that slot's rows, cursor and in-place cache [1, H_kv, T_max, D]. ONNX
Runtime's CPU GroupQueryAttention refuses batch > 1 with more than one new row per sequence once
a past exists, which a verify call needs; per-slot nodes also keep each sequence's attention
exactly the computation of a 1-slot call (row invariance across the batch).

With feature idle_slots an idle slot has 0 rows in input_ids: the MatMuls see the real rows only.
Each layer gathers the attention rows of every slot from the packed rows once (a slot's rows,
then a copy of its last row when the attention is padded; an idle slot: one throwaway row taken
from any packed row, written past its cursor and never read), and gathers the real rows' outputs
back after the per-slot attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec

from .writer import MS, Graph


def _append_last_row(g: Graph, x: str) -> str:
    """x [1, S, C] -> [1, S + 1, C], the last row repeated (one Pad node, edge mode)."""
    return g.op("Pad", [x, g.const("pads", np.array([0, 0, 0, 0, 1, 0], np.int64))], mode="edge")[0]


def _drop_last_row(g: Graph, x: str) -> str:
    """x [1, S + 1, C] -> [1, S, C]."""
    start, end, axis = (g.const(n, np.array([v], np.int64)) for n, v in (("start", 0), ("end", -1), ("axis", 1)))
    return g.op("Slice", [x, start, end, axis])[0]


@dataclass(frozen=True)
class Layout:
    """Where attention finds its rows and cursors, computed once per graph (layout())."""

    cursor: list[tuple[str, str]]  # (seqlens_k, total_sequence_length) of each slot's attention
    rows: tuple[str, str, str] | None  # slot_rows() of a slots graph; None for one cache
    pad: bool  # the attention appends a copy of each slot's last row (row_padding's cache_pad)


def layout(g: Graph, slots: int, pad: bool) -> Layout:
    rows = slot_rows(g, slots, pad) if slots > 1 else None
    return Layout(cursors(g, slots, pad, rows), rows, pad)


def cursors(g: Graph, slots: int, pad: bool, rows: tuple[str, str, str] | None) -> list[tuple[str, str]]:
    """(seqlens_k [1], total_sequence_length []) of each slot's attention, from the graph's cursor
    inputs ([1] and [] for one cache, [K] and [K] for K slots: P + n - 1 and P + n for n packed
    rows), moved on by the attention's extra rows (the pad row; an idle slot's throwaway row).
    rows: slot_rows() of a slots graph, None for one cache."""
    if rows is None:
        if not pad:
            return [(contract.SEQLENS_K, contract.TOTAL_SEQUENCE_LENGTH)]
        one, one1 = g.const("one", np.array(1, np.int32)), g.const("one", np.array([1], np.int32))
        return [(g.op("Add", [contract.SEQLENS_K, one1])[0], g.op("Add", [contract.TOTAL_SEQUENCE_LENGTH, one])[0])]
    (extra,) = g.op("Cast", [g.op("Sub", [rows[1], contract.SLOT_ROWS])[0]], to=TensorProto.INT32)  # [K]
    (seqlens,) = g.op("Add", [contract.SEQLENS_K, extra])
    (totals,) = g.op("Add", [contract.TOTAL_SEQUENCE_LENGTH, extra])
    pairs = []
    for b in range(slots):
        (seq,) = g.op("Gather", [seqlens, g.const("slot", np.array([b], np.int64))], axis=0)
        (total,) = g.op("Gather", [totals, g.const("slot", np.array(b, np.int64))], axis=0)
        pairs.append((seq, total))
    return pairs


def slot_rows(g: Graph, slots: int, pad: bool) -> tuple[str, str, str]:
    """The attention rows of a slots graph, computed once per call from slot_rows [K] (N packed
    rows in all): (gather [M] packed row of each attention row, attn_rows [K] how many attention
    rows each slot has, back [N] the attention row of each packed row).
    Slot b (packed rows start_b .. start_b + n_b - 1) attends with a_b = n_b + pad rows, padded
    with its last row, or max(n_b, 1) unpadded; an idle slot's one row is packed row start_b - 1
    (any row would do: its output is dropped and its K/V lie past the slot's cursor)."""
    i64 = lambda name, v: g.const(name, np.array(v, np.int64))  # noqa: E731
    rows = contract.SLOT_ROWS
    (start,) = g.op("CumSum", [rows, i64("axis", 0)], exclusive=1)  # [K]
    (attn,) = g.op("Add", [rows, i64("pad", 1)]) if pad else g.op("Max", [rows, i64("one", [1] * slots)])
    (offset,) = g.op("CumSum", [attn, i64("axis", 0)], exclusive=1)  # [K] first attention row of each slot
    (last,) = g.op("Sub", [g.op("Add", [start, rows])[0], i64("one", 1)])  # [K] a slot's last packed row
    gather, back = [], []
    for b in range(slots):
        at = i64("slot", b)
        s_b, a_b, l_b, o_b, n_b = (g.op("Gather", [t, at], axis=0)[0] for t in (start, attn, last, offset, rows))
        (span,) = g.op("Range", [s_b, g.op("Add", [s_b, a_b])[0], i64("step", 1)])
        gather.append(g.op("Min", [span, l_b])[0])  # the pad row (or an idle slot's row) repeats the last one
        back.append(g.op("Range", [o_b, g.op("Add", [o_b, n_b])[0], i64("step", 1)])[0])
    return g.op("Concat", gather, axis=0)[0], attn, g.op("Concat", back, axis=0)[0]


def tree_inputs(g: Graph, elem: int, span: bool = False) -> list[str]:
    """A tree graph's (feature tree_verify) position_ids [1, S] and GroupQueryAttention's additive
    attention_bias [1, 1, S, P + S] of the model dtype: 0 over the past rows, tree_bias [S, S]
    over the call's own rows. span (a head's tree graph, feature eagle3_head_tree): tree_bias is [S, M],
    M >= S, over the last M cache rows, and 0 before them. Built once per call; every layer
    reads them."""
    return [contract.POSITION_IDS, _tree_bias(g, elem, span)[0]]


def _tree_bias(g: Graph, elem: int, span: bool) -> tuple[str, str]:
    """(tree_inputs()'s attention_bias [1, 1, S, P + S], the rows before its tree_bias [1] =
    P + S - M: P unless span)."""
    (s,) = g.op("Shape", [contract.INPUT_IDS], start=1, end=2)  # [1] = S
    (m,) = g.op("Shape", [contract.TREE_BIAS], start=1, end=2) if span else (s,)  # [1] = M (S unless span)
    (total,) = g.op("Cast", [contract.TOTAL_SEQUENCE_LENGTH], to=TensorProto.INT64)  # [] = P + S
    (past,) = g.op("Sub", [g.op("Reshape", [total, g.const("shape", np.array([1], np.int64))])[0], m])  # [1] P + S - M
    zero = helper.make_tensor("zero", elem, [1], [0.0])
    (zeros,) = g.op("ConstantOfShape", [g.op("Concat", [s, past], axis=0)[0]], value=zero)  # [S, P + S - M]
    (own,) = g.op("Cast", [contract.TREE_BIAS], to=elem)  # [S, M]
    (bias,) = g.op("Concat", [zeros, own], axis=1)  # [S, P + S]
    (bias4,) = g.op("Unsqueeze", [bias, g.const("axes", np.array([0, 1], np.int64))])  # [1, 1, S, P + S]
    return bias4, past


TreeInputs = dict[int | None, list[str]]  # window (None: none) -> tree_inputs() of its layers; {} outside a tree graph


def tree_inputs_by_window(g: Graph, elem: int, windows: tuple[int, ...]) -> TreeInputs:
    """tree_inputs() of a target's tree graph, and for each attention window W a bias that also
    hides the keys W or more positions before a row's own position P + depth (cache row j < P at
    position j, the call's rows at their position_ids), as a chain decoding of the row's path
    would: GroupQueryAttention's local_window_size would count cache rows, and tree rows lie at
    rows P + i, not P + depth. Windowed layers then run without local_window_size."""
    bias4, past1 = _tree_bias(g, elem, span=False)  # [1, 1, S, P + S], [1] = P
    base = [contract.POSITION_IDS, bias4]
    out: TreeInputs = {None: base}
    if not windows:
        return out
    i64 = lambda stem, v: g.const(stem, np.array(v, np.int64))  # noqa: E731
    (past,) = g.op("Squeeze", [past1, i64("axes", [0])])  # [] = P
    (rows,) = g.op("Unsqueeze", [g.op("Range", [i64("zero", 0), past, i64("one", 1)])[0], i64("axes", [0])])  # [1, P]
    (keys,) = g.op("Concat", [rows, contract.POSITION_IDS], axis=1)  # [1, P + S] each key's position
    (query,) = g.op("Unsqueeze", [contract.POSITION_IDS, i64("axes", [2])])  # [1, S, 1]
    (gap,) = g.op("Sub", [query, g.op("Unsqueeze", [keys, i64("axes", [1])])[0]])  # [1, S, P + S] query - key
    (gap4,) = g.op("Unsqueeze", [gap, i64("axes", [1])])  # [1, 1, S, P + S]
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    lowest = g.const("lowest", np.array(np.finfo(dtype).min, dtype))
    for w in windows:
        (far,) = g.op("GreaterOrEqual", [gap4, i64("window", w)])
        out[w] = [base[0], g.op("Where", [far, lowest, base[1]])[0]]
    return out


def attention(
    g: Graph,
    layer: int,
    qkv: list[str],
    at: Layout,
    rotary: list[str],
    attrs: dict,
    tree: list[str] = (),
    shared: bool = False,
) -> str:
    """qkv: [packed q|k|v, "", ""] or [q, k, v], each [1, N, C] -> attention output [1, N, H D],
    K/V written in place into each slot's cache. A padded attention gets a copy of its last row
    after the real ones (row_padding's cache_pad) and drops its output. tree: tree_inputs() of a
    tree graph (one slot, unpadded): positions and bias follow the tree, not the row order.
    shared (K/V sharing, Gemma 4): k, v are those the cache's owner writes this call; the node reads
    rows 0 .. P - 1 of the owner's past_key_{layer} and appends them again, into a present of its own
    that nothing reads (GroupQueryAttention has no read-only form), so the owner's cache is untouched."""
    rows, cursor, pad = at.rows, at.cursor, at.pad
    if tree:
        rotary = list(rotary) or ["", ""]  # cos/sin come before position_ids (empty on a NoPE layer)
    if rows is None:
        pieces = [[_append_last_row(g, t) if t and pad else t for t in qkv]]
    else:  # [1, N, C] -> [1, M, C] attention rows -> K pieces [1, a_b, C]
        gather, attn, _ = rows
        K = len(cursor)
        split = [
            g.op("Split", [g.op("Gather", [t, gather], axis=1)[0], attn], K, axis=1) if t else [""] * K for t in qkv
        ]
        pieces = [[parts[b] for parts in split] for b in range(K)]
    outs = []
    for b, inputs in enumerate(pieces):
        slot = None if rows is None else b
        caches = [contract.past_key(layer, slot), contract.past_value(layer, slot)]
        presents = (
            [g.name("shared_k"), g.name("shared_v")]
            if shared
            else [contract.present_key(layer, slot), contract.present_value(layer, slot)]
        )
        a, _, _ = g.op(
            "GroupQueryAttention",
            [*inputs, *caches, *cursor[b], *rotary, *tree],
            [g.name("attn"), *presents],
            domain=MS,
            **attrs,
        )
        outs.append(a)
    if rows is None:
        return _drop_last_row(g, outs[0]) if pad else outs[0]
    (joined,) = g.op("Concat", outs, axis=1)  # [1, M, H D]
    return g.op("Gather", [joined, rows[2]], axis=1)[0]  # [1, N, H D]


def interface(spec: GraphSpec, elem: int, features: bool) -> tuple[list, list]:
    """Graph inputs and outputs in the contract's order (GraphSpec), which the runtime checks by name."""
    cache = [1, spec.num_kv_heads, "cache_rows", spec.head_dim]  # the runtime binds T_max rows (in place)
    K = spec.slots
    inputs = [
        helper.make_tensor_value_info(contract.INPUT_IDS, TensorProto.INT64, [1, "seq"]),
        helper.make_tensor_value_info(contract.LOGITS_INDEX, TensorProto.INT64, ["rows"]),
        helper.make_tensor_value_info(contract.SEQLENS_K, TensorProto.INT32, [K]),
        helper.make_tensor_value_info(contract.TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, [K] if K > 1 else []),
    ]
    if K > 1:
        inputs.append(helper.make_tensor_value_info(contract.SLOT_ROWS, TensorProto.INT64, [K]))
    if spec.tree:
        inputs += [
            helper.make_tensor_value_info(contract.POSITION_IDS, TensorProto.INT64, [1, "seq"]),
            helper.make_tensor_value_info(contract.TREE_BIAS, TensorProto.FLOAT, ["seq", "seq"]),
        ]
    outputs = [helper.make_tensor_value_info(contract.LOGITS, TensorProto.FLOAT, [1, "rows", spec.embedding_rows])]
    if features:
        outputs.append(
            helper.make_tensor_value_info(contract.HIDDEN_STATES, TensorProto.FLOAT, [1, "seq", spec.feature_width])
        )
    for i in range(spec.num_layers):
        for b in spec.slot_ids:
            inputs += [
                helper.make_tensor_value_info(n, elem, cache)
                for n in (contract.past_key(i, b), contract.past_value(i, b))
            ]
            outputs += [helper.make_tensor_value_info(n, elem, cache) for n in spec.layout.kv_outputs(i, b)]
    order_in = {n: k for k, n in enumerate(spec.input_names())}
    order_out = {n: k for k, n in enumerate(spec.output_names())}
    return sorted(inputs, key=lambda v: order_in[v.name]), sorted(outputs, key=lambda v: order_out[v.name])
