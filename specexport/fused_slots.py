"""GroupQueryAttention of the fused graph, for one cache or for several cache slots.

A slots graph (contract 1.5) serves K sequences in one call: their rows are packed one slot
after another in input_ids [1, N] (slot_rows [K] says how many each has, every slot >= 1), so
every MatMul reads its weights once for all of them, while attention runs per slot: one
GroupQueryAttention node per slot and layer, on that slot's rows, cursor and in-place cache
[1, H_kv, T_max, D]. ONNX Runtime's CPU GroupQueryAttention refuses batch > 1 with more than one
new row per sequence once a past exists, which a verify call needs; per-slot nodes also keep
each sequence's attention exactly the computation of a 1-slot call (row invariance across the
batch).
"""

from __future__ import annotations

import numpy as np

from specexport_runtime import contract

from .graph_writer import MS, Graph


def _append_last_row(g: Graph, x: str) -> str:
    """x [1, S, C] -> [1, S + 1, C], the last row repeated (one Pad node, edge mode)."""
    return g.op("Pad", [x, g.const("pads", np.array([0, 0, 0, 0, 1, 0], np.int64))], mode="edge")[0]


def _drop_last_row(g: Graph, x: str) -> str:
    """x [1, S + 1, C] -> [1, S, C]."""
    start, end, axis = (g.const(n, np.array([v], np.int64)) for n, v in (("start", 0), ("end", -1), ("axis", 1)))
    return g.op("Slice", [x, start, end, axis])[0]


def cursors(g: Graph, slots: int, pad: bool) -> list[tuple[str, str]]:
    """(seqlens_k [1], total_sequence_length []) of each slot's attention, from the graph's cursor
    inputs ([1] and [] for one slot, [K] and [K] for K slots), one more when the attention is padded."""
    if slots == 1:
        pairs = [(contract.SEQLENS_K, contract.TOTAL_SEQUENCE_LENGTH)]
    else:
        pairs = []
        for b in range(slots):
            (seq,) = g.op("Gather", [contract.SEQLENS_K, g.const("slot", np.array([b], np.int64))], axis=0)
            (total,) = g.op("Gather", [contract.TOTAL_SEQUENCE_LENGTH, g.const("slot", np.array(b, np.int64))], axis=0)
            pairs.append((seq, total))
    if not pad:
        return pairs
    one, one1 = g.const("one", np.array(1, np.int32)), g.const("one", np.array([1], np.int32))
    return [(g.op("Add", [seq, one1])[0], g.op("Add", [total, one])[0]) for seq, total in pairs]


def attention(
    g: Graph, layer: int, qkv: list[str], cursor: list[tuple[str, str]], rotary: list[str], pad: bool, attrs: dict
) -> str:
    """qkv: [packed q|k|v, "", ""] or [q, k, v], each [1, N, C] -> attention output [1, N, H D],
    K/V written in place into each slot's cache. pad: every attention gets a copy of its last row
    after the real ones (contract 1.2 cache_pad) and drops its output."""
    slots = len(cursor)
    if slots == 1:
        pieces = [qkv]
    else:  # [1, N, C] -> K pieces [1, S_b, C]
        split = [g.op("Split", [t, contract.SLOT_ROWS], slots, axis=1) if t else [""] * slots for t in qkv]
        pieces = [[parts[b] for parts in split] for b in range(slots)]
    outs = []
    for b, inputs in enumerate(pieces):
        slot = None if slots == 1 else b
        if pad:
            inputs = [_append_last_row(g, t) if t else t for t in inputs]
        caches = [contract.past_key(layer, slot), contract.past_value(layer, slot)]
        a, _, _ = g.op(
            "GroupQueryAttention",
            [*inputs, *caches, *cursor[b], *rotary],
            [g.name("attn"), contract.present_key(layer, slot), contract.present_value(layer, slot)],
            domain=MS,
            **attrs,
        )
        outs.append(_drop_last_row(g, a) if pad else a)
    return outs[0] if slots == 1 else g.op("Concat", outs, axis=1)[0]
