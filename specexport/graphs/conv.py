"""LFM2's gated short convolution, the decoder writer's CONV mixer (feature recurrent_state), written
once in ONNX standard ops for both graph forms:

    B | C | x = in_proj(h)                      [1, S, 3 C] split in three [1, S, C]
    bx        = B * x                           the conv inputs
    win       = concat(past_state_j, bx)        [1, L - 1 + S, C]: the last L - 1 inputs, then the call's
    conv[t]   = sum_k w[:, k] * win[t + k]      depthwise causal conv, k = 0 the oldest tap (+ bias)
    out       = out_proj(C * conv)              [1, S, C]
    new_state_j = win[r + 1 .. r + L - 1] for each r in state_index   [1, Rs, L - 1, C]

Every output row is elementwise over its own window, so a row is the same whatever the call's
size (row-invariant, bitwise), and the state after a row never depends on later rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from onnx import TensorProto, helper

from specexport_runtime import contract

from .scan import i64 as _i64
from .writer import Graph, Linear

INT64_MAX = np.iinfo(np.int64).max


@dataclass(frozen=True)
class ConvWeights:
    """One CONV layer's weights: in_proj [3 C, C], the depthwise kernel [C, L], out_proj [C, C]."""

    in_proj: Linear
    in_b: torch.Tensor | None
    kernel: torch.Tensor  # [C, L]
    kernel_b: torch.Tensor | None
    out: Linear
    out_b: torch.Tensor | None


def causal_conv(
    g: Graph, x: str, site: int, kernel: torch.Tensor, bias: torch.Tensor | None, slot: int | None = None
) -> str:
    """x [1, S, C] -> the causal depthwise conv of kernel [C, L] over (state site j's last L - 1
    rows, x) [1, S, C] (+ bias); the state after each state_index row leaves as new_state_{site}
    (float32, as every state; a slots graph's rows of `slot`, with its names). Shared by LFM2's
    conv and the Mamba2 and Gated DeltaNet mixers."""
    C, L = kernel.shape
    past = contract.past_state(site, slot)
    if g.dtype_name != "float32":  # states are float32; a model-dtype value converts back exactly
        (past,) = g.op("Cast", [past], to=g.elem)
    (win,) = g.op("Concat", [past, x], axis=1)  # [1, L - 1 + S, C]
    axis = _i64(g, "axis", [1])
    total = None
    for k in range(L):  # tap k reads win[k : k + S] = win[k : len - (L - 1 - k)]
        end = _i64(g, "end", [-(L - 1 - k) if k < L - 1 else INT64_MAX])
        (tap,) = g.op("Slice", [win, _i64(g, "start", [k]), end, axis])
        (term,) = g.op("Mul", [tap, g.weight("conv_w", kernel[:, k].contiguous())])
        total = term if total is None else g.op("Add", [total, term])[0]
    if bias is not None:
        (total,) = g.op("Add", [total, g.weight("conv_b", bias)])
    # new_state: rows r + 1 .. r + L - 1 of win for each requested row r
    (idx,) = g.op(
        "Add",
        [
            g.op("Unsqueeze", [contract.state_index(slot), _i64(g, "axes", [1])])[0],  # [Rs, 1]
            _i64(g, "taps", np.arange(1, L, dtype=np.int64)[None, :]),  # [1, L - 1]
        ],
    )
    state_out(g, g.op("Gather", [win, idx], axis=1)[0], site, slot)  # [1, Rs, L - 1, C]
    return total


def state_out(g: Graph, value: str, site: int, slot: int | None = None) -> None:
    """Name `value` [1, Rs, *s_j] the output new_state_{site} (of `slot`), in float32."""
    if g.dtype_name != "float32":
        g.op("Cast", [value], [contract.new_state(site, slot)], to=TensorProto.FLOAT)
    else:
        g.op("Identity", [value], [contract.new_state(site, slot)])


Core = Callable[[list[str], int | None], list[str]]  # (a slot's rows of each input, slot) -> its outputs


def per_slot(g: Graph, rows: tuple[str, str, str] | None, slots: int, xs: list[str], core: Core) -> list[str]:
    """core over each slot's rows of the packed xs [1, N, C_i] (a recurrence runs per sequence),
    its outputs [1, a_b, C'] packed back to [1, N, C']. rows: fused_slots.slot_rows(pad=False) of
    a slots graph (gather [M], a_b [K], back [N]: an idle slot gets one throwaway row, whose
    output is dropped and whose state nobody asks for); None: one slot, core(xs, None)."""
    if rows is None:
        return core(xs, None)
    gather, sizes, back = rows
    parts = [g.op("Split", [g.op("Gather", [x, gather], axis=1)[0], sizes], slots, axis=1) for x in xs]
    outs = [core([p[b] for p in parts], b) for b in range(slots)]  # per slot: [1, a_b, C'] each
    return [g.op("Gather", [g.op("Concat", list(o), axis=1)[0], back], axis=1)[0] for o in zip(*outs)]


def conv_mixer(c, site: int, h: str, cw: ConvWeights) -> str:
    """h [1, S, C] (the layer's normed input) -> the mixer output [1, S, C]; the layer's state
    leaves as new_state_{site} (module docstring). c: the writer's per-graph context (linear())."""
    g = c.g
    C = cw.kernel.shape[0]
    bcx = c.linear(h, cw.in_proj, cw.in_b)  # [1, S, 3 C]
    b, gate, x = g.op("Split", [bcx, _i64(g, "split", [C, C, C])], 3, axis=-1)
    (bx,) = g.op("Mul", [b, x])  # [1, S, C]: the conv inputs
    (conv,) = per_slot(
        g, c.slot_rows, c.slots, [bx], lambda p, slot: [causal_conv(g, p[0], site, cw.kernel, cw.kernel_b, slot)]
    )
    (y,) = g.op("Mul", [gate, conv])
    return c.linear(y, cw.out, cw.out_b)


def conv_weights(w, conv: torch.nn.Module, i: int) -> ConvWeights:
    """Layer i's conv mixer weights from the source (streaming.Weights `w`)."""
    kernel = w.of(conv.conv)  # [C, 1, L]
    return ConvWeights(
        Linear(f"l{i}_conv_in", (w.part(conv.in_proj),)),
        w.bias(conv.in_proj),
        kernel.reshape(kernel.shape[0], kernel.shape[-1]).float(),
        w.bias(conv.conv),
        Linear(f"l{i}_conv_out", (w.part(conv.out_proj),)),
        w.bias(conv.out_proj),
    )


def state_interface(spec, inputs: list, outputs: list) -> tuple[list, list]:
    """The operators' graph inputs and outputs plus (feature recurrent_state) state_index and each
    site's past_state / new_state, in the contract's order (GraphSpec.input_names / output_names)."""
    if not spec.states:
        return inputs, outputs
    info = helper.make_tensor_value_info
    for b in spec.slot_ids:  # a slot's state rows: state_rows (one slot), state_rows_slot{b}
        rows = contract.state_index(b).replace(contract.STATE_INDEX, "state_rows")
        inputs.append(info(contract.state_index(b), TensorProto.INT64, [rows]))
        for j, shape in enumerate(spec.states):  # float32 whatever the graph dtype
            inputs.append(info(contract.past_state(j, b), TensorProto.FLOAT, [1, *shape]))
            outputs.append(info(contract.new_state(j, b), TensorProto.FLOAT, [1, rows, *shape]))
    order_in = {n: k for k, n in enumerate(spec.input_names())}
    order_out = {n: k for k, n in enumerate(spec.output_names())}
    return sorted(inputs, key=lambda v: order_in[v.name]), sorted(outputs, key=lambda v: order_out[v.name])
