"""The Gated DeltaNet mixer (Qwen3.5's linear-attention layers; feature recurrent_state), written
once in ONNX standard ops for both graph forms. Two state sites per layer: the conv window over
q|k|v (conv.causal_conv) and the delta-rule state S [Hv, dk, dv]. For a call of S rows (all
delta-rule math in float32; t, s index rows; k-heads repeat to the Hv value heads):

    qkv | z | b | a = in_proj_qkv | in_proj_z | in_proj_b | in_proj_a (u)
    q | k | v = silu(causal_conv(qkv));  q, k l2-normalized per head, q times dk^-1/2
    beta = sigmoid(b);  g = -exp(A_log) softplus(a + dt_bias);  cum = cumsum_t(g)      [S, Hv]
    D[t, s] = exp(g_{s+1} + ... + g_t) for s <= t, else 0 (a masked cumsum)            [Hv, S, S]
    U = I + strict_lower((beta k) k^T * D);  W = U^-1 (beta v);  Kc = U^-1 (beta k exp(cum))
    V' = W - Kc S0
    o_t = exp(cum_t) q_t S0 + sum_{s <= t} (q_t . k_s) D[t, s] V'_s
    S_r = exp(cum_r) S0 + sum_{s <= r} D[r, s] k_s V'_s^T          the state after row r (state_index)
    out = out_proj(rmsnorm_head(o) w * silu(z))

That is transformers' torch_chunk_gated_delta_rule over one chunk of S rows, run for calls of more
than recurrent.STEP_ROWS rows. U^-1 (unit lower triangular) is built by doubling diagonal blocks
(_inverse: no triangular solve in ONNX; the product (I + N)(I + N^2)(I + N^4)... of N = I - U
equals it in exact arithmetic, but its powers of N reach ~1e7 on slow decays and float32 loses
the rows to cancellation). Shorter calls (every decode and verify call) run the step recurrence
S <- exp(g_t) S, S <- S + k_t ((v_t - S^T k_t) beta_t)^T, o_t = S^T q_t as a Scan, bitwise the
same row whatever the call's size (scan.step_or_chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from onnx import TensorProto

from specexport_runtime import contract
from specexport_runtime.recurrent import MAX_CALL_ROWS

from ..models.mixers import DeltaNetSpec
from .conv import causal_conv, per_slot, state_out
from .scan import by_rows, decay, repeat_heads, scan_rows, step_or_chunk
from .scan import f32 as _f32
from .scan import i64 as _i64
from .writer import Graph, Linear

assert MAX_CALL_ROWS & (MAX_CALL_ROWS - 1) == 0  # _inverse doubles blocks up to it


@dataclass(frozen=True)
class DeltaNetWeights:
    proj: Linear  # qkv | z | b | a rows
    kernel: torch.Tensor  # [conv_dim, L]
    dt_bias: torch.Tensor  # [Hv]
    a_log: torch.Tensor  # [Hv]
    norm: torch.Tensor  # [dv]
    norm_eps: float
    out: Linear


def deltanet_weights(w, mixer: torch.nn.Module, i: int) -> DeltaNetWeights:
    """Layer i's Gated DeltaNet weights from the source (streaming.Weights `w`)."""
    kernel = w.of(mixer.conv1d)  # [conv_dim, 1, L]
    parts = tuple(w.part(m) for m in (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a))
    return DeltaNetWeights(
        Linear(f"l{i}_gdn_in", parts),
        kernel.reshape(kernel.shape[0], kernel.shape[-1]).float(),
        w.of(mixer, "dt_bias").float(),
        w.of(mixer, "A_log").float(),
        w.of(mixer.norm).float(),
        float(mixer.norm.variance_epsilon),
        Linear(f"l{i}_gdn_out", (w.part(mixer.out_proj),)),
    )


def _unsq(g: Graph, x: str, *axes: int) -> str:
    return g.op("Unsqueeze", [x, _i64(g, "axes", list(axes))])[0]


def _t(g: Graph, x: str, *perm: int) -> str:
    return g.op("Transpose", [x], perm=list(perm))[0]


def _heads(g: Graph, x: str, d: DeltaNetSpec, dim: int) -> str:
    """[S, Hk * dim] -> [Hv, S, dim]: value head h reads key head h // (Hv / Hk), l2-normalized."""
    (x,) = g.op("Reshape", [x, _i64(g, "shape", [-1, d.key_heads, dim])])
    (x,) = g.op("Mul", [x, g.op("Reciprocal", [_sqrt_sum_sq(g, x)])[0]])  # x * rsqrt(sum x^2 + 1e-6)
    return repeat_heads(g, _t(g, x, 1, 0, 2), d.key_heads, d.value_heads, dim)  # [Hk, S, dim] -> [Hv, S, dim]


def _sqrt_sum_sq(g: Graph, x: str) -> str:
    (ss,) = g.op("ReduceSum", [g.op("Mul", [x, x])[0], _i64(g, "axes", [-1])], keepdims=1)
    return g.op("Sqrt", [g.op("Add", [ss, _f32(g, "eps", 1e-6)])[0]])[0]


def deltanet_mixer(c, site: int, u: str, dw: DeltaNetWeights, d: DeltaNetSpec) -> str:
    """u [1, S, hidden] (the layer's normed input) -> the mixer output [1, S, hidden]; the conv
    window leaves as new_state_{site}, the delta-rule state as new_state_{site + 1}."""
    g = c.g
    Hv, dv, vd = d.value_heads, d.value_dim, d.value_heads * d.value_dim
    proj = c.linear(u, dw.proj, None)  # [1, S, conv_dim + vd + 2 Hv]
    qkv, z, b, a = g.op("Split", [proj, _i64(g, "split", [d.conv_dim, vd, Hv, Hv])], 4, axis=-1)
    (o,) = per_slot(g, c.slot_rows, c.slots, [qkv, b, a], lambda p, slot: [_rule(c, site, *p, dw, d, slot)])
    (o,) = g.op("Reshape", [o, _i64(g, "shape", [-1, Hv, dv])])  # [S, Hv, dv]
    y = _gated_norm(g, o, z, dw, d)
    return c.linear(y, dw.out, None)


def _rule(c, site: int, qkv: str, b: str, a: str, dw: DeltaNetWeights, d: DeltaNetSpec, slot: int | None) -> str:
    """One sequence's rows: qkv [1, S, conv_dim], b, a [1, S, Hv] (model dtype) -> o [1, S, Hv dv]
    float32, its conv window and delta-rule state leaving as new_state_{site}, new_state_{site + 1}."""
    g = c.g
    Hv, dk, dv, kd, vd = d.value_heads, d.key_dim, d.value_dim, d.key_heads * d.key_dim, d.value_heads * d.value_dim
    qkv = c.ops.activation(g, causal_conv(g, qkv, site, dw.kernel, None, slot), "silu")
    if g.dtype_name != "float32":
        qkv, b, a = (g.op("Cast", [t], to=TensorProto.FLOAT)[0] for t in (qkv, b, a))
    (qkv,) = g.op("Reshape", [qkv, _i64(g, "shape", [-1, d.conv_dim])])  # [S, conv_dim]
    q, k, v = g.op("Split", [qkv, _i64(g, "split", [kd, kd, vd])], 3, axis=-1)
    q, k = _heads(g, q, d, dk), _heads(g, k, d, dk)  # [Hv, S, dk]
    (q,) = g.op("Mul", [q, _f32(g, "scale", dk**-0.5)])
    v = _t(g, g.op("Reshape", [v, _i64(g, "shape", [-1, Hv, dv])])[0], 1, 0, 2)  # [Hv, S, dv]
    (beta,) = g.op("Sigmoid", [g.op("Reshape", [b, _i64(g, "shape", [-1, Hv])])[0]])  # [S, Hv]
    (sp,) = g.op(
        "Softplus",
        [g.op("Add", [g.op("Reshape", [a, _i64(g, "shape", [-1, Hv])])[0], _f32(g, "dt_bias", dw.dt_bias.numpy())])[0]],
    )
    (gate,) = g.op("Mul", [sp, _f32(g, "neg_A", (-torch.exp(dw.a_log)).numpy())])  # g [S, Hv]
    (s0,) = g.op("Reshape", [contract.past_state(site + 1, slot), _i64(g, "shape", [Hv, dk, dv])])
    idx = contract.state_index(slot)
    o, states = step_or_chunk(
        g,
        beta,
        lambda sub: _step(sub, q, k, v, beta, gate, s0, idx),
        lambda sub: _chunk(sub, q, k, v, beta, gate, s0, idx, Hv),
        2,
    )  # o [S, Hv, dv]; states [1, Rs, Hv, dk, dv]
    state_out(g, states, site + 1, slot)
    return g.op("Reshape", [o, _i64(g, "shape", [1, -1, vd])])[0]


def _step(g: Graph, q: str, k: str, v: str, beta: str, gate: str, s0: str, idx: str) -> list[str]:
    """The delta rule row after row -> [o [S, Hv, dv], states [1, Rs, Hv, dk, dv]]:
    S <- exp(g_t) S;  S <- S + k_t ((v_t - S^T k_t) beta_t)^T;  o_t = S^T q_t."""
    (eg,) = g.op("Exp", [gate])  # [S, Hv]
    q_s, k_s, v_s = (_t(g, x, 1, 0, 2) for x in (q, k, v))  # [S, Hv, dk | dv]

    def body(bg: Graph, states: list[str], rows: list[str]) -> tuple[list[str], list[str]]:
        # st [Hv, dk, dv]; eg_r, b_r [Hv]; q_r, k_r [Hv, dk]; v_r [Hv, dv]
        (st,), (eg_r, b_r, q_r, k_r, v_r) = states, rows
        (st,) = bg.op("Mul", [st, _unsq(bg, eg_r, 1, 2)])
        (kv,) = bg.op("MatMul", [_unsq(bg, k_r, 1), st])  # [Hv, 1, dv] = S^T k
        (delta,) = bg.op("Mul", [bg.op("Sub", [_unsq(bg, v_r, 1), kv])[0], _unsq(bg, b_r, 1, 2)])  # [Hv, 1, dv]
        (st,) = bg.op("Add", [st, bg.op("MatMul", [_unsq(bg, k_r, 2), delta])[0]])  # + k delta^T
        (o,) = bg.op("MatMul", [_unsq(bg, q_r, 1), st])  # [Hv, 1, dv]
        return [st], [bg.op("Squeeze", [o, _i64(bg, "axes", [1])])[0], st]

    _, os_, ss = scan_rows(g, [s0], [eg, beta, q_s, k_s, v_s], body, 2)  # os_ [S, Hv, dv]; ss [S, Hv, dk, dv]
    (states,) = g.op("Gather", [ss, idx], axis=0)  # [Rs, Hv, dk, dv]
    return [os_, _unsq(g, states, 0)]


def _chunk(g: Graph, q: str, k: str, v: str, beta: str, gate: str, s0: str, idx: str, heads: int) -> list[str]:
    """The chunked form over the call's rows (module docstring) -> [o [S, Hv, dv], states [1, Rs, Hv, dk, dv]]."""
    dec = decay(g, gate)
    cum, decay_m, strict, zero = dec.cum, dec.matrix, dec.strict, _f32(g, "zero", 0.0)  # [Hv, S], [Hv, S, S]
    (bcol,) = g.op("Unsqueeze", [_t(g, beta, 1, 0), _i64(g, "axes", [2])])  # [Hv, S, 1]
    (kb,) = g.op("Mul", [k, bcol])
    (vb,) = g.op("Mul", [v, bcol])
    (grow,) = g.op("Exp", [cum])  # [Hv, S]
    (gcol,) = g.op("Unsqueeze", [grow, _i64(g, "axes", [2])])
    kt = _t(g, k, 0, 2, 1)  # [Hv, dk, S]
    (ut,) = g.op("Mul", [g.op("MatMul", [kb, kt])[0], decay_m])
    (nil,) = g.op("Where", [strict, g.op("Neg", [ut])[0], zero])  # N = I - U, strictly lower
    inv = _inverse(g, nil, heads)  # U^-1 [Hv, S, S]
    w_val, k_cum = g.op("MatMul", [inv, vb])[0], g.op("MatMul", [inv, g.op("Mul", [kb, gcol])[0]])[0]
    (vnew,) = g.op("Sub", [w_val, g.op("MatMul", [k_cum, s0])[0]])  # [Hv, S, dv]
    (intra,) = g.op("Mul", [g.op("MatMul", [q, kt])[0], decay_m])  # [Hv, S, S]
    (inter,) = g.op("MatMul", [g.op("Mul", [q, gcol])[0], s0])
    (o,) = g.op("Add", [inter, g.op("MatMul", [intra, vnew])[0]])  # [Hv, S, dv]
    return [_t(g, o, 1, 0, 2), _chunk_states(g, decay_m, k, vnew, grow, s0, idx)]


def _inverse(g: Graph, nil: str, heads: int) -> str:
    """(I - N)^-1 [Hv, S, S] for N [Hv, S, S] strictly lower, S <= MAX_CALL_ROWS: _inverse_in
    padded to half of MAX_CALL_ROWS for calls that fit it (its work grows with the padded size)."""
    half = MAX_CALL_ROWS // 2
    return by_rows(
        g, nil, 1, half, lambda sub: [_inverse_in(sub, nil, heads, half)], lambda sub: [_inverse_in(sub, nil, heads)], 1
    )[0]


def _inverse_in(g: Graph, nil: str, heads: int, P: int = MAX_CALL_ROWS) -> str:
    """(I - N)^-1 [Hv, S, S] for N [Hv, S, S] strictly lower, S <= P (a power of two), by doubling
    blocks: N is padded to P rows, the inverse's diagonal blocks start at 1 x 1
    and each level joins two of size b into one of 2b,

        [[A, 0], [L, B]],  L = B N_ll A     (A, B the inverses of the diagonal blocks, N_ll the
                                              block of N below A and left of B)

    so every intermediate is a block of the final inverse, bounded by it (no power of N is formed)."""
    (n,) = g.op("Shape", [nil], start=1, end=2)  # [1] = S
    (room,) = g.op("Sub", [_i64(g, "max_rows", [P]), n])
    zeros4 = _i64(g, "zeros", [0, 0, 0, 0])
    (pads,) = g.op("Concat", [zeros4, room, room], axis=0)  # [0, 0, 0, 0, P - S, P - S]
    (full,) = g.op("Pad", [nil, pads])  # [Hv, P, P]
    inv = g.op("Expand", [_f32(g, "one", 1.0), _i64(g, "shape", [heads, P, 1, 1])])[0]  # [Hv, P, 1, 1]
    b = 1
    while b < P:
        m = P // (2 * b)  # pairs of blocks at this level
        n_ll = _below_blocks(g, full, heads, m, b, P)  # [Hv, m, b, b]
        (pair,) = g.op("Reshape", [inv, _i64(g, "shape", [heads, m, 2, b, b])])
        a, bb = g.op("Split", [pair, _i64(g, "halves", [1, 1])], 2, axis=2)  # [Hv, m, 1, b, b] each
        a, bb = (g.op("Reshape", [x, _i64(g, "shape", [heads, m, b, b])])[0] for x in (a, bb))
        (ll,) = g.op("MatMul", [g.op("MatMul", [bb, n_ll])[0], a])
        (zero,) = g.op("Expand", [_f32(g, "zero", 0.0), _i64(g, "shape", [heads, m, b, b])])
        (top,) = g.op("Concat", [a, zero], axis=3)
        (bottom,) = g.op("Concat", [ll, bb], axis=3)
        (inv,) = g.op("Concat", [top, bottom], axis=2)  # [Hv, m, 2b, 2b]
        b *= 2
    (inv,) = g.op("Reshape", [inv, _i64(g, "shape", [heads, P, P])])
    starts = _i64(g, "starts", [0, 0])
    (ends,) = g.op("Concat", [n, n], axis=0)
    return g.op("Slice", [inv, starts, ends, _i64(g, "axes", [1, 2])])[0]  # [Hv, S, S]


def _below_blocks(g: Graph, full: str, heads: int, m: int, b: int, P: int) -> str:
    """full [Hv, P, P] -> [Hv, m, b, b]: block i is full[(2i+1)b : (2i+2)b, 2ib : (2i+1)b]. The
    lower rows of each pair, flat, are read with a row stride of bP + 2b (a skewed view), so
    block i's columns start at 0 in every row: copies, no mask."""
    (rows,) = g.op("Reshape", [full, _i64(g, "shape", [heads, m, 2, b, P])])
    (rows,) = g.op("Slice", [rows, _i64(g, "one", [1]), _i64(g, "two", [2]), _i64(g, "axes", [2])])  # [Hv, m, 1, b, P]
    (flat,) = g.op("Reshape", [rows, _i64(g, "shape", [heads, m * b * P])])
    (flat,) = g.op("Pad", [flat, _i64(g, "pads", [0, 0, 0, m * 2 * b])])  # [Hv, m (bP + 2b)]
    (skew,) = g.op("Reshape", [flat, _i64(g, "shape", [heads, m, b * P + 2 * b])])
    (skew,) = g.op("Slice", [skew, _i64(g, "zero", [0]), _i64(g, "end", [b * P]), _i64(g, "axes", [2])])
    (skew,) = g.op("Reshape", [skew, _i64(g, "shape", [heads, m, b, P])])  # row r of block i: col 2ib + c at c
    return g.op("Slice", [skew, _i64(g, "zero", [0]), _i64(g, "end", [b]), _i64(g, "axes", [3])])[0]


def _chunk_states(g: Graph, decay: str, k: str, vnew: str, grow: str, s0: str, idx: str) -> str:
    """[1, Rs, Hv, dk, dv]: S_r for each row r of state_index `idx`."""
    (dr,) = g.op("Gather", [decay, idx], axis=1)  # [Hv, Rs, S]
    (kd,) = g.op("Mul", [_unsq(g, dr, 3), _unsq(g, k, 1)])  # [Hv, Rs, S, dk]
    (sr,) = g.op("MatMul", [_t(g, kd, 0, 1, 3, 2), _unsq(g, vnew, 1)])  # [Hv, Rs, dk, dv]
    (g0,) = g.op("Unsqueeze", [g.op("Gather", [grow, idx], axis=1)[0], _i64(g, "axes", [2, 3])])  # [Hv, Rs, 1, 1]
    (sr,) = g.op("Add", [sr, g.op("Mul", [g0, _unsq(g, s0, 1)])[0]])
    return _unsq(g, _t(g, sr, 1, 0, 2, 3), 0)  # [1, Rs, Hv, dk, dv]


def _gated_norm(g: Graph, o: str, z: str, dw: DeltaNetWeights, d: DeltaNetSpec) -> str:
    """o [S, Hv, dv] float32, z [1, S, vd] model dtype -> [1, S, vd] model dtype: per head
    rmsnorm(o) w (in the model dtype) * silu(z) (transformers' Qwen3_5RMSNormGated)."""
    (var,) = g.op("ReduceMean", [g.op("Mul", [o, o])[0]], axes=[-1], keepdims=1)
    (normed,) = g.op("Div", [o, g.op("Sqrt", [g.op("Add", [var, _f32(g, "eps", dw.norm_eps)])[0]])[0]])
    if g.dtype_name != "float32":
        (normed,) = g.op("Cast", [normed], to=g.elem)
    (normed,) = g.op("Mul", [normed, g.weight("gdn_norm", dw.norm)])
    if g.dtype_name != "float32":
        (normed,) = g.op("Cast", [normed], to=TensorProto.FLOAT)
        (z,) = g.op("Cast", [z], to=TensorProto.FLOAT)
    (zh,) = g.op("Reshape", [z, _i64(g, "shape", [-1, d.value_heads, d.value_dim])])
    (y,) = g.op("Mul", [normed, g.op("Mul", [zh, g.op("Sigmoid", [zh])[0]])[0]])
    (y,) = g.op("Reshape", [y, _i64(g, "shape", [1, -1, d.value_heads * d.value_dim])])
    if g.dtype_name != "float32":
        (y,) = g.op("Cast", [y], to=g.elem)
    return y
