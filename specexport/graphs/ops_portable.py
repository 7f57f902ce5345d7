"""The portable operators: the decoder writer's (decoder_graph.py) attention, norms and activations
as ONNX standard ops at opset 17, for the `time_major` layout (docs/graph-contract.md, with its
tree_verify and cache_slots graphs), so that every ONNX Runtime provider and TensorRT
run it.

Per call, computed once from the inputs and read by every layer:
  - positions: P .. P+S-1 from the past's length (P = the past key's rows; a slot's own past),
    or `position_ids` in a tree graph;
  - rotary: per rope key, cos/sin [N, heads, D] over the packed q|k|v heads (heads = H + 2 H_kv):
    cos on q and k heads, 1 on v heads and past rotary_dim, with the attention scale folded into
    q's heads, so that one signed-permutation MatMul rotates q|k|v at once (v passes exactly);
  - masks: per slot and window, an additive float32 [n_b, P_b + n_b] (causal over past and new
    rows; a window hides keys `window` or more positions back; a tree adds its tree_bias).

    input_ids      int64    [1, S]             (K slots: [1, N], slot after slot)
    logits_index   int64    [R]
    slot_rows      int64    [K]                K slots only
    position_ids   int64    [1, S]             tree graphs only (P + depth), with tree_bias [S, S]
    past_key_{i}   kv_dtype [1, P, H_kv, D]    valid cache prefix (a slot's: _slot{b})
 -> logits         float32  [1, R, V]
    new_key_{i}    kv_dtype [1, S, H_kv, D]    the S new rows (rotary applied), bound at P
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec

from .scan import f32 as _f32
from .scan import i64 as _i64
from .writer import AttentionShape, Graph

LOWEST = float(np.finfo(np.float32).min)


@dataclass(frozen=True)
class SlotCall:
    """One slot's part of a call: its packed rows [start, end) (None: all rows), masks by window."""

    span: tuple[str, str] | None
    masks: dict[int | None, str]  # window (None: none) -> additive mask [n_b, T_b] float32


@dataclass(frozen=True)
class PortableCall:
    positions: str  # [N] int64: each packed row's position
    rotary: dict[str, tuple[str, str]]  # rope key -> (cos, sin) [N, heads, D] graph dtype
    slots: list[SlotCall]
    rot_matrix: dict[str, str]  # rope key -> [D, D]: x @ R = rotate_half(x) over that table's rotary dims


class PortableOps:
    """Operators of the time_major layout (ONNX standard ops)."""

    layout = contract.LAYOUTS[contract.TIME_MAJOR]
    pads_attention = False

    # --- norms and activations ------------------------------------------------------------
    def norm(self, g: Graph, x: str, weight: str, eps: float, bias: str | None = None) -> str:
        """RMSNorm over the last axis in float32, times the weight (offset folded in), back in the
        graph dtype; LayerNormalization with `bias` (GPT-2)."""
        if bias is not None:
            return g.op("LayerNormalization", [x, weight, bias], axis=-1, epsilon=eps, stash_type=1)[0]
        xf = g.op("Cast", [x], to=TensorProto.FLOAT)[0] if g.dtype_name != "float32" else x
        (sq,) = g.op("Pow", [xf, _f32(g, "two", 2.0)])
        (var,) = g.op("ReduceMean", [sq], axes=[-1], keepdims=1)
        (std,) = g.op("Sqrt", [g.op("Add", [var, _f32(g, "eps", eps)])[0]])
        (y,) = g.op("Mul", [xf, g.op("Div", [_f32(g, "one", 1.0), std])[0]])
        if g.dtype_name != "float32":
            (y,) = g.op("Cast", [y], to=g.elem)
        return g.op("Mul", [y, weight])[0]

    def add_norm(self, g: Graph, addend: str, residual: str, weight: str, eps: float, bias: str | None = None):
        """(norm(residual + addend), residual + addend)."""
        (total,) = g.op("Add", [residual, addend])
        return self.norm(g, total, weight, eps, bias), total

    def activation(self, g: Graph, x: str, act: str) -> str:
        if act == "silu":
            return g.op("Mul", [x, g.op("Sigmoid", [x])[0]])[0]
        if act == "relu2":  # relu(x)^2 (Nemotron-H)
            (r,) = g.op("Relu", [x])
            return g.op("Mul", [r, r])[0]
        half = g.scalar("half", 0.5)
        if act in ("gelu_pytorch_tanh", "gelu_new"):  # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
            (cube,) = g.op("Mul", [g.op("Pow", [x, g.scalar("three", 3.0)])[0], g.scalar("c", 0.044715)])
            (inner,) = g.op("Mul", [g.op("Add", [x, cube])[0], g.scalar("k", float(np.sqrt(2.0 / np.pi)))])
            (t,) = g.op("Add", [g.op("Tanh", [inner])[0], g.scalar("one", 1.0)])
        else:  # exact GELU: 0.5 x (1 + erf(x / sqrt 2))
            (t,) = g.op(
                "Add",
                [g.op("Erf", [g.op("Div", [x, g.scalar("r2", float(np.sqrt(2.0)))])[0]])[0], g.scalar("one", 1.0)],
            )
        return g.op("Mul", [g.op("Mul", [x, half])[0], t])[0]

    # --- per call ---------------------------------------------------------------------------
    def prepare(self, g: Graph, shape: AttentionShape, slots: int, tree: bool, **_) -> PortableCall:
        """Positions, rotary tables and masks of this call (module docstring)."""
        first = [contract.past_key(0, None if slots == 1 else b) for b in range(slots)]
        calls, positions = [], []
        if slots > 1:
            (ends,) = g.op("CumSum", [contract.SLOT_ROWS, _i64(g, "axis", 0)])  # [K]
        for b in range(slots):
            (past,) = g.op("Shape", [first[b]], start=1, end=2)  # [1] = P_b
            if slots == 1:
                (n,) = g.op("Shape", [contract.INPUT_IDS], start=1, end=2)  # [1] = S
                span = None
            else:
                at = _i64(g, "slot", [b])
                (n,) = g.op("Gather", [contract.SLOT_ROWS, at], axis=0)  # [1] = n_b
                (end,) = g.op("Gather", [ends, at], axis=0)
                span = (g.op("Sub", [end, n])[0], end)
            (p0,) = g.op("Squeeze", [past, _i64(g, "axes", [0])])
            (total,) = g.op("Squeeze", [g.op("Add", [past, n])[0], _i64(g, "axes", [0])])  # [] = P_b + n_b
            one = _i64(g, "one", 1)
            (past_pos,) = g.op("Range", [_i64(g, "zero", 0), p0, one])  # [P_b]
            if tree:
                (q_pos,) = g.op("Reshape", [contract.POSITION_IDS, _i64(g, "shape", [-1])])  # [S] = P + depth
            else:
                (q_pos,) = g.op("Range", [p0, total, one])  # [n_b] = P_b .. P_b + n_b - 1
            positions.append(q_pos)
            calls.append(SlotCall(span, self._masks(g, past_pos, q_pos, shape.windows, tree)))
        (pos,) = g.op("Concat", positions, axis=0) if slots > 1 else (positions[0],)
        rotary = {key: self._rotary(g, pos, inv, scale, shape) for key, (inv, scale) in shape.ropes.items()}
        by_half: dict[int, str] = {}
        for inv, _ in shape.ropes.values():
            half = inv.shape[0]
            if half not in by_half:
                by_half[half] = self._rot_matrix(g, shape.head_dim, half)
        rot = {key: by_half[inv.shape[0]] for key, (inv, _) in shape.ropes.items()}
        return PortableCall(pos, rotary, calls, rot)

    def _masks(self, g: Graph, past_pos: str, q_pos: str, windows: tuple[int, ...], tree: bool) -> dict:
        """window -> additive mask [S, P + S] float32 (module docstring)."""
        (keys,) = g.op("Concat", [past_pos, q_pos], axis=0)  # [T] each key's position
        (k_row,) = g.op("Unsqueeze", [keys, _i64(g, "axes", [0])])  # [1, T]
        (q_col,) = g.op("Unsqueeze", [q_pos, _i64(g, "axes", [1])])  # [S, 1]
        zero, lowest = _f32(g, "zero", 0.0), _f32(g, "lowest", LOWEST)
        if tree:  # the whole past, then tree_bias over the call's rows
            (p_row,) = g.op("Unsqueeze", [past_pos, _i64(g, "axes", [0])])  # [1, P]
            (past,) = g.op("Where", [g.op("LessOrEqual", [p_row, q_col])[0], zero, lowest])  # [S, P]
            (base,) = g.op("Concat", [past, contract.TREE_BIAS], axis=1)  # [S, T]
            masks = {None: base}
            for w in windows:  # Min, not a sum: two lowest values would overflow to -inf
                (inside,) = g.op("Greater", [k_row, g.op("Sub", [q_col, _i64(g, "window", w)])[0]])
                masks[w] = g.op("Min", [base, g.op("Where", [inside, zero, lowest])[0]])[0]
            return masks
        (causal,) = g.op("LessOrEqual", [k_row, q_col])  # [S, T]
        masks = {None: g.op("Where", [causal, zero, lowest])[0]}
        for w in windows:  # a query sees the `w` most recent keys, itself included
            (inside,) = g.op("Greater", [k_row, g.op("Sub", [q_col, _i64(g, "window", w)])[0]])
            masks[w] = g.op("Where", [g.op("And", [causal, inside])[0], zero, lowest])[0]
        return masks

    def _rotary(self, g: Graph, pos: str, inv_freq, scale: float, shape: AttentionShape) -> tuple[str, str]:
        """cos, sin [N, heads, D] of positions pos [N] (module docstring), in the graph dtype."""
        H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
        (p,) = g.op("Unsqueeze", [g.op("Cast", [pos], to=TensorProto.FLOAT)[0], _i64(g, "axes", [1])])  # [N, 1]
        inv = g.const("inv_freq", inv_freq.numpy().astype(np.float32)[None, :])  # [1, rot/2]
        (freqs,) = g.op("Mul", [p, inv])  # [N, rot/2] fp32
        (emb,) = g.op("Unsqueeze", [g.op("Concat", [freqs, freqs], axis=-1)[0], _i64(g, "axes", [1])])  # [N, 1, rot]
        cos, sin = (g.op(op, [emb])[0] for op in ("Cos", "Sin"))
        if scale != 1.0:
            cos, sin = (g.op("Mul", [t, _f32(g, "rope_scale", scale)])[0] for t in (cos, sin))
        pad = D - 2 * inv_freq.shape[0]
        if pad:  # partial rotary: the pass-through dims get cos 1, sin 0
            pads = _i64(g, "pads", [0, 0, 0, 0, 0, pad])
            (cos,) = g.op("Pad", [cos, pads, _f32(g, "one", 1.0)])
            (sin,) = g.op("Pad", [sin, pads, _f32(g, "zero", 0.0)])
        is_qk = np.concatenate([np.ones(H + Hkv), np.zeros(Hkv)]).astype(np.float32)[None, :, None]  # [1, heads, 1]
        q_scale = np.concatenate([np.full(H, shape.scale), np.ones(2 * Hkv)]).astype(np.float32)[None, :, None]
        a = g.const("qk_scale", is_qk * q_scale)  # cos on q (scaled) and k heads
        (cos,) = g.op("Add", [g.op("Mul", [cos, a])[0], g.const("v_one", 1.0 - is_qk)])  # 1 on v heads
        (sin,) = g.op("Mul", [sin, a])
        if g.dtype_name != "float32":
            cos, sin = (g.op("Cast", [t], to=g.elem)[0] for t in (cos, sin))
        return cos, sin

    def _rot_matrix(self, g: Graph, D: int, half: int) -> str:
        """R [D, D]: (x @ R)[j] = -x[j + rot/2] (j < rot/2), x[j - rot/2] (rot/2 <= j < rot), 0 after."""
        R = np.zeros((D, D), g.np_dtype)
        for j in range(half):
            R[j + half, j], R[j, j + half] = -1.0, 1.0
        return g.const("rot_matrix", R)

    # --- attention ----------------------------------------------------------------------------
    def attention(
        self,
        g: Graph,
        layer: int,
        qkv: list[str],
        call: PortableCall,
        shape: AttentionShape,
        rope,
        window,
        shared: bool = False,
    ) -> str:
        """qkv: [packed q|k|v, "", ""] or [q, k, v], each [1, N, C] -> [1, N, H D]; the new K/V rows
        leave as new_key_{i} / new_value_{i} (a slot's: _slot{b}). shared: qkv[0] is q alone, which
        attends over layer `layer`'s past and the new rows that layer has just written."""
        if shared:
            return self._shared_attention(g, layer, qkv[0], call, shape, rope, window)
        H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
        packed = qkv[0] if not qkv[1] else g.op("Concat", qkv, axis=-1)[0]
        (x,) = g.op("Reshape", [packed, _i64(g, "shape", [1, -1, H + 2 * Hkv, D])])  # [1, N, heads, D]
        scaling = shape.scale
        if rope is not None:  # x cos + rotate_half(x) sin on q|k, identity on v; scale folded into q
            cos, sin = call.rotary[rope]
            (rot,) = g.op("Mul", [g.op("MatMul", [x, call.rot_matrix[rope]])[0], sin])
            (x,) = g.op("Add", [g.op("Mul", [x, cos])[0], rot])
            scaling = None
        slots = call.slots
        split = _i64(g, "split", [H, Hkv, Hkv])
        if len(slots) == 1:
            q, k, v = g.op("Split", [x, split], [g.name("q"), *self.layout.kv_outputs(layer)], axis=2)
            parts = [(q, k, v)]
        else:
            q_all, k_all, v_all = g.op("Split", [x, split], 3, axis=2)
            parts = []
            for b, slot in enumerate(slots):
                start, end, axis = slot.span[0], slot.span[1], _i64(g, "axis", [1])
                names = [g.name("q"), *self.layout.kv_outputs(layer, b)]
                parts.append(
                    tuple(g.op("Slice", [t, start, end, axis], [n])[0] for t, n in zip((q_all, k_all, v_all), names))
                )
        outs = []
        for b, (q, k, v) in enumerate(parts):
            slot = None if len(slots) == 1 else b
            past_k, past_v = contract.past_key(layer, slot), contract.past_value(layer, slot)
            outs.append(self._attend(g, q, past_k, k, past_v, v, slots[b].masks[window], shape, scaling))
        return outs[0] if len(outs) == 1 else g.op("Concat", outs, axis=1)[0]

    def _shared_attention(
        self, g: Graph, layer: int, q: str, call: PortableCall, shape: AttentionShape, rope, window
    ) -> str:
        """q [1, N, H D] over cache `layer`'s past_key / new_key (a slot's: _slot{b}) -> [1, N, H D];
        rotary on q alone: the first H heads of the q|k|v tables (the scale folded into them)."""
        H, D = shape.heads, shape.head_dim
        (x,) = g.op("Reshape", [q, _i64(g, "shape", [1, -1, H, D])])  # [1, N, H, D]
        scaling = shape.scale
        if rope is not None:
            start, end, axis = _i64(g, "start", [0]), _i64(g, "end", [H]), _i64(g, "axis", [1])
            cos, sin = (g.op("Slice", [t, start, end, axis])[0] for t in call.rotary[rope])  # [N, H, D]
            (rot,) = g.op("Mul", [g.op("MatMul", [x, call.rot_matrix[rope]])[0], sin])
            (x,) = g.op("Add", [g.op("Mul", [x, cos])[0], rot])
            scaling = None
        outs = []
        for b, slot in enumerate(call.slots):
            at = None if len(call.slots) == 1 else b
            q_b = x if slot.span is None else g.op("Slice", [x, *slot.span, _i64(g, "axis", [1])])[0]
            past_k, past_v = contract.past_key(layer, at), contract.past_value(layer, at)
            new_k, new_v = contract.new_key(layer, at), contract.new_value(layer, at)
            outs.append(self._attend(g, q_b, past_k, new_k, past_v, new_v, slot.masks[window], shape, scaling))
        return outs[0] if len(outs) == 1 else g.op("Concat", outs, axis=1)[0]

    def _attend(self, g: Graph, q, past_k, k, past_v, v, mask, shape: AttentionShape, scaling) -> str:
        """q [1, n, H, D]; past [1, P, H_kv, D] then k, v [1, n, H_kv, D]; mask [n, T] -> [1, n, H D].
        KV heads are not repeated: q is grouped [H_kv, rep, n, D] against k [H_kv, 1, D, T]."""
        H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
        rep = H // Hkv
        (k_all,) = g.op("Concat", [past_k, k], axis=1)  # [1, T, H_kv, D]
        (v_all,) = g.op("Concat", [past_v, v], axis=1)
        (qg,) = g.op("Transpose", [g.op("Reshape", [q, _i64(g, "shape", [-1, Hkv, rep, D])])[0]], perm=[1, 2, 0, 3])
        kv_shape = _i64(g, "shape", [-1, Hkv, D])  # 3-D permutes hit ONNX Runtime's fast transposes
        (kt,) = g.op("Transpose", [g.op("Reshape", [k_all, kv_shape])[0]], perm=[1, 2, 0])  # [H_kv, D, T]
        (vt,) = g.op("Transpose", [g.op("Reshape", [v_all, kv_shape])[0]], perm=[1, 0, 2])  # [H_kv, T, D]
        axes1 = _i64(g, "axes", [1])
        (scores,) = g.op("MatMul", [qg, g.op("Unsqueeze", [kt, axes1])[0]])  # [H_kv, rep, n, T]
        if g.dtype_name != "float32":
            (scores,) = g.op("Cast", [scores], to=TensorProto.FLOAT)
        if scaling is not None:  # None: q arrives pre-scaled (folded into rotary)
            (scores,) = g.op("Mul", [scores, _f32(g, "scale", scaling)])
        if shape.softcap is not None:
            cap = _f32(g, "cap", shape.softcap)
            (scores,) = g.op("Mul", [g.op("Tanh", [g.op("Div", [scores, cap])[0]])[0], cap])
        (probs,) = g.op("Softmax", [g.op("Add", [scores, mask])[0]], axis=-1)
        if g.dtype_name != "float32":
            (probs,) = g.op("Cast", [probs], to=g.elem)
        (out,) = g.op("MatMul", [probs, g.op("Unsqueeze", [vt, axes1])[0]])  # [H_kv, rep, n, D]
        (out,) = g.op("Transpose", [out], perm=[2, 0, 1, 3])  # [n, H_kv, rep, D]
        return g.op("Reshape", [out, _i64(g, "shape", [1, -1, H * D])])[0]

    # --- interface ----------------------------------------------------------------------------
    def interface(self, spec: GraphSpec, elem: int, features: bool) -> tuple[list, list]:
        """Graph inputs and outputs in the contract's order (GraphSpec)."""
        info = helper.make_tensor_value_info
        H, D = spec.num_kv_heads, spec.head_dim
        inputs = [
            info(contract.INPUT_IDS, TensorProto.INT64, [1, "seq"]),
            info(contract.LOGITS_INDEX, TensorProto.INT64, ["rows"]),
        ]
        if spec.slots > 1:
            inputs.append(info(contract.SLOT_ROWS, TensorProto.INT64, [spec.slots]))
        if spec.tree:
            inputs += [
                info(contract.POSITION_IDS, TensorProto.INT64, [1, "seq"]),
                info(contract.TREE_BIAS, TensorProto.FLOAT, ["seq", "seq"]),
            ]
        outputs = [info(contract.LOGITS, TensorProto.FLOAT, [1, "rows", spec.embedding_rows])]
        if features:
            outputs.append(info(contract.HIDDEN_STATES, TensorProto.FLOAT, [1, "seq", spec.feature_width]))
        for i in range(spec.num_layers):
            for b in spec.slot_ids:
                tag = "" if b is None else f"_slot{b}"
                inputs += [
                    info(n, elem, [1, f"past{tag}", H, D]) for n in (contract.past_key(i, b), contract.past_value(i, b))
                ]
                outputs += [
                    info(n, elem, [1, f"seq{tag}", H, D]) for n in (contract.new_key(i, b), contract.new_value(i, b))
                ]
        order_in = {n: k for k, n in enumerate(spec.input_names())}
        order_out = {n: k for k, n in enumerate(spec.output_names())}
        return sorted(inputs, key=lambda v: order_in[v.name]), sorted(outputs, key=lambda v: order_out[v.name])
