"""The Mamba2 mixer (Granite 4.0-H's; feature recurrent_state), written once in ONNX standard ops
for both graph forms. Two state sites per layer: the conv window (conv.causal_conv) and the scan
state h [H, P, N]. For a call of S rows (t, s index rows; all scan math in float32):

    gate [I] | xBC [I + 2 G N] | dt [H] = in_proj(u)
    x | B | C = silu(causal_conv(xBC))                  x [S, H, P]; B, C [S, G, N], head h reads group h / (H / G)
    dt  = clip(softplus(dt + dt_bias), lo, hi)          [S, H]
    a   = dt * A,  A = -exp(A_log);  cum = cumsum_t(a)  [S, H]
    L[h, t, s] = exp(a[s + 1, h] + ... + a[t, h]) for s <= t, else 0 (a masked cumsum, as transformers)
    y_t = sum_{s <= t} L[h, t, s] (C_t . B_s) dt_s x_s + exp(cum_t) C_t . h0 + D x_t
    h_r = sum_{s <= r} L[h, r, s] dt_s x_s B_s^T + exp(cum_r) h0      the state after row r (state_index rows)
    out = out_proj(gated_rmsnorm(y, gate))              y * silu(gate), RMS over G groups of I / G, times w

That is transformers' chunked scan (mamba2_chunk_scan) over one chunk of S rows ([H, S, S]
matrices, so the runtime splits long calls: recurrent.MAX_CALL_ROWS), run for calls of more than
recurrent.STEP_ROWS rows; shorter calls (every decode and verify call) run the step recurrence
h <- exp(a_t) h + dt_t x_t B_t^T, y_t = h C_t + D x_t as a Scan, bitwise the same row whatever
the call's size (scan.step_or_chunk).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from onnx import TensorProto

from specexport_runtime import contract

from ..models.mixers import MambaSpec
from .conv import causal_conv, per_slot, state_out
from .scan import decay, repeat_heads, scan_rows, step_or_chunk
from .scan import f32 as _f32
from .scan import i64 as _i64
from .writer import Graph, Linear


@dataclass(frozen=True)
class MambaWeights:
    in_proj: Linear
    in_b: torch.Tensor | None
    kernel: torch.Tensor  # [conv_dim, L]
    kernel_b: torch.Tensor | None
    dt_bias: torch.Tensor  # [H]
    a_log: torch.Tensor  # [H]
    d: torch.Tensor  # [H]
    norm: torch.Tensor | None  # [I]; None: no output norm (MambaSpec.norm "gate")
    norm_eps: float
    out: Linear
    out_b: torch.Tensor | None


def mamba_weights(w, mixer: torch.nn.Module, i: int) -> MambaWeights:
    """Layer i's Mamba2 weights from the source (streaming.Weights `w`)."""
    kernel = w.of(mixer.conv1d)  # [conv_dim, 1, L]
    normed = getattr(mixer.norm, "weight", None) is not None
    return MambaWeights(
        Linear(f"l{i}_mamba_in", (w.part(mixer.in_proj),)),
        w.bias(mixer.in_proj),
        kernel.reshape(kernel.shape[0], kernel.shape[-1]).float(),
        w.bias(mixer.conv1d),
        w.of(mixer, "dt_bias").float(),
        w.of(mixer, "A_log").float(),
        w.of(mixer, "D").float(),
        w.of(mixer.norm).float() if normed else None,  # Falcon-H1 without mamba_rms_norm: nn.Identity
        float(mixer.norm.variance_epsilon) if normed else 0.0,
        Linear(f"l{i}_mamba_out", (w.part(mixer.out_proj),)),
        w.bias(mixer.out_proj),
    )


def _heads(g: Graph, t: str, m: MambaSpec) -> str:
    """[S, G, N] -> [H, S, N]: head h reads group h // (H / G)."""
    return repeat_heads(g, g.op("Transpose", [t], perm=[1, 0, 2])[0], m.groups, m.heads, m.state_size)


def mamba_mixer(c, site: int, u: str, mw: MambaWeights, m: MambaSpec) -> str:
    """u [1, S, hidden] (the layer's normed input) -> the mixer output [1, S, hidden]; the conv
    window leaves as new_state_{site}, the scan state as new_state_{site + 1}."""
    g = c.g
    H, N, G, inner = m.heads, m.state_size, m.groups, m.inner
    if m.in_multiplier != 1.0:  # Falcon-H1: ssm_in_multiplier
        (u,) = g.op("Mul", [u, g.scalar("ssm_in", m.in_multiplier)])
    proj = c.linear(u, mw.in_proj, mw.in_b)  # [1, S, I + conv_dim + H]
    if m.projection_multipliers is not None:  # Falcon-H1's muP vector over z | x | B | C | dt
        widths = (inner, inner, G * N, G * N, H)
        vector = np.concatenate([np.full(w, f) for w, f in zip(widths, m.projection_multipliers)])
        (proj,) = g.op("Mul", [proj, g.const("mup_vector", vector.astype(g.np_dtype))])
    gate, xbc, dt = g.op("Split", [proj, _i64(g, "split", [inner, m.conv_dim, H])], 3, axis=-1)
    (y,) = per_slot(g, c.slot_rows, c.slots, [xbc, dt], lambda p, slot: [_ssm(c, site, p[0], p[1], mw, m, slot)])
    y = _gated_norm(g, y, gate, mw, m)
    return c.linear(y, mw.out, mw.out_b)


def _ssm(c, site: int, xbc: str, dt: str, mw: MambaWeights, m: MambaSpec, slot: int | None) -> str:
    """One sequence's rows: xbc [1, S, conv_dim], dt [1, S, H] (model dtype) -> y [1, S, I]
    float32, its conv window and scan state leaving as new_state_{site}, new_state_{site + 1}."""
    g = c.g
    H, P, N, G, inner = m.heads, m.head_dim, m.state_size, m.groups, m.inner
    xbc = causal_conv(g, xbc, site, mw.kernel, mw.kernel_b, slot)
    xbc = c.ops.activation(g, xbc, "silu")
    if g.dtype_name != "float32":
        (xbc,) = g.op("Cast", [xbc], to=TensorProto.FLOAT)
        (dt,) = g.op("Cast", [dt], to=TensorProto.FLOAT)
    x, b, cc = g.op("Split", [xbc, _i64(g, "split", [inner, G * N, G * N])], 3, axis=-1)
    (x,) = g.op("Reshape", [x, _i64(g, "shape", [-1, H, P])])  # [S, H, P]

    (dt,) = g.op("Reshape", [dt, _i64(g, "shape", [-1, H])])  # [S, H]
    (dt,) = g.op("Softplus", [g.op("Add", [dt, _f32(g, "dt_bias", mw.dt_bias.numpy())])[0]])
    lo, hi = m.dt_limit
    if lo > 0.0 or hi != float("inf"):
        (dt,) = g.op("Clip", [dt, _f32(g, "dt_lo", lo), _f32(g, "dt_hi", min(hi, 3.0e38))])
    (a,) = g.op("Mul", [dt, _f32(g, "A", (-torch.exp(mw.a_log)).numpy())])  # [S, H]: log decay of each row
    (dtx,) = g.op("Mul", [x, g.op("Unsqueeze", [dt, _i64(g, "axes", [2])])[0]])  # [S, H, P]
    (b,) = g.op("Reshape", [b, _i64(g, "shape", [-1, G, N])])  # [S, G, N]
    (cc,) = g.op("Reshape", [cc, _i64(g, "shape", [-1, G, N])])
    (h0,) = g.op("Reshape", [contract.past_state(site + 1, slot), _i64(g, "shape", [H, P, N])])
    idx = contract.state_index(slot)
    y, states = step_or_chunk(
        g, dt, lambda sub: _step(sub, a, dtx, b, cc, h0, idx, m), lambda sub: _chunk(sub, a, dtx, b, cc, h0, idx, m), 2
    )  # y [S, H, P]; states [1, Rs, H, P, N]
    (y,) = g.op("Add", [y, g.op("Mul", [x, _f32(g, "D", mw.d.numpy()[:, None])])[0]])  # + D x
    state_out(g, states, site + 1, slot)
    return g.op("Reshape", [y, _i64(g, "shape", [1, -1, inner])])[0]


def _step(g: Graph, a: str, dtx: str, b: str, cc: str, h0: str, idx: str, m: MambaSpec) -> list[str]:
    """The step recurrence over the call's rows -> [y [S, H, P], states [1, Rs, H, P, N]]:
    h <- exp(a_t) h + dtx_t B_t^T;  y_t = h C_t."""
    (da,) = g.op("Exp", [a])  # [S, H]
    b_s, c_s = (g.op("Transpose", [_heads(g, t, m)], perm=[1, 0, 2])[0] for t in (b, cc))  # [S, H, N]

    def body(bg: Graph, states: list[str], rows: list[str]) -> tuple[list[str], list[str]]:
        (h,), (da_r, dtx_r, b_r, c_r) = states, rows  # h [H, P, N]; da_r [H], dtx_r [H, P], b_r, c_r [H, N]
        (kept,) = bg.op("Mul", [h, bg.op("Unsqueeze", [da_r, _i64(bg, "axes", [1, 2])])[0]])
        (col,) = bg.op("Unsqueeze", [dtx_r, _i64(bg, "axes", [2])])  # [H, P, 1]
        (new,) = bg.op("Mul", [col, bg.op("Unsqueeze", [b_r, _i64(bg, "axes", [1])])[0]])  # [H, P, N]
        (h,) = bg.op("Add", [kept, new])
        (y,) = bg.op("MatMul", [h, bg.op("Unsqueeze", [c_r, _i64(bg, "axes", [2])])[0]])  # [H, P, 1]
        return [h], [bg.op("Squeeze", [y, _i64(bg, "axes", [2])])[0], h]

    _, ys, hs = scan_rows(g, [h0], [da, dtx, b_s, c_s], body, 2)  # ys [S, H, P]; hs [S, H, P, N]
    (states,) = g.op("Gather", [hs, idx], axis=0)  # [Rs, H, P, N]
    return [ys, g.op("Unsqueeze", [states, _i64(g, "axes", [0])])[0]]


def _chunk(g: Graph, a: str, dtx: str, b: str, cc: str, h0: str, idx: str, m: MambaSpec) -> list[str]:
    """The chunked form over the call's rows (module docstring) -> [y [S, H, P], states [1, Rs, H, P, N]]."""
    dec = decay(g, a)
    b_h, c_h = _heads(g, b, m), _heads(g, cc, m)  # [H, S, N]
    (dtx,) = g.op("Transpose", [dtx], perm=[1, 0, 2])  # [H, S, P]
    (cb,) = g.op("MatMul", [c_h, g.op("Transpose", [b_h], perm=[0, 2, 1])[0]])  # [H, S, S]
    (y,) = g.op("MatMul", [g.op("Mul", [cb, dec.matrix])[0], dtx])  # [H, S, P]
    (y_off,) = g.op("MatMul", [c_h, g.op("Transpose", [h0], perm=[0, 2, 1])[0]])  # [H, S, P]
    (grow,) = g.op("Exp", [dec.cum])  # [H, S]: exp(cum_t), decay of h0 to row t
    (y_off,) = g.op("Mul", [y_off, g.op("Unsqueeze", [grow, _i64(g, "axes", [2])])[0]])
    (y,) = g.op("Transpose", [g.op("Add", [y, y_off])[0]], perm=[1, 0, 2])
    return [y, _chunk_states(g, dec.matrix, dtx, b_h, grow, h0, idx)]


def _chunk_states(g: Graph, decay: str, dtx: str, b_h: str, grow: str, h0: str, idx: str) -> str:
    """[1, Rs, H, P, N]: h_r for each row r of state_index `idx` (module docstring)."""
    (lr,) = g.op("Gather", [decay, idx], axis=1)  # [H, Rs, S]
    (t,) = g.op(
        "Mul", [g.op("Unsqueeze", [lr, _i64(g, "axes", [3])])[0], g.op("Unsqueeze", [dtx, _i64(g, "axes", [1])])[0]]
    )  # [H, Rs, S, P]
    (t,) = g.op("Transpose", [t], perm=[0, 1, 3, 2])  # [H, Rs, P, S]
    (hs,) = g.op("MatMul", [t, g.op("Unsqueeze", [b_h, _i64(g, "axes", [1])])[0]])  # [H, Rs, P, N]
    (g0,) = g.op("Unsqueeze", [g.op("Gather", [grow, idx], axis=1)[0], _i64(g, "axes", [2, 3])])  # [H, Rs, 1, 1]
    (carried,) = g.op("Mul", [g0, g.op("Unsqueeze", [h0, _i64(g, "axes", [1])])[0]])  # [H, Rs, P, N]
    (hs,) = g.op("Add", [hs, carried])
    (hs,) = g.op("Transpose", [hs], perm=[1, 0, 2, 3])  # [Rs, H, P, N]
    return g.op("Unsqueeze", [hs, _i64(g, "axes", [0])])[0]


def _gated_norm(g: Graph, y: str, gate: str, mw: MambaWeights | None, m: MambaSpec) -> str:
    """y [1, S, I] float32, gate [1, S, I] model dtype -> the mixer's output norm (MambaSpec.norm),
    model dtype: w * rmsnorm_groups(y * silu(gate)) (transformers' GraniteMoeHybridRMSNormGated,
    float32 inside), w * rmsnorm_groups(y) * silu(gate) (Falcon-H1's norm_before_gate), or
    y * silu(gate) without a norm."""
    if g.dtype_name != "float32":
        (gate,) = g.op("Cast", [gate], to=TensorProto.FLOAT)
    (silu,) = g.op("Mul", [gate, g.op("Sigmoid", [gate])[0]])
    if m.norm == "gate":
        (out,) = g.op("Mul", [y, silu])
        return g.op("Cast", [out], to=g.elem)[0] if g.dtype_name != "float32" else out
    if m.norm == "norm_gate":  # float32 throughout, the weight too (FalconH1RMSNormGated)
        normed = _group_rms(g, y, mw, m)
        (normed,) = g.op("Mul", [normed, _f32(g, "mamba_norm", mw.norm.numpy())])
        (out,) = g.op("Mul", [normed, silu])
        return g.op("Cast", [out], to=g.elem)[0] if g.dtype_name != "float32" else out
    (yg,) = g.op("Mul", [y, silu])
    normed = _group_rms(g, yg, mw, m)
    if g.dtype_name != "float32":
        (normed,) = g.op("Cast", [normed], to=g.elem)
    return g.op("Mul", [normed, g.weight("mamba_norm", mw.norm)])[0]


def _group_rms(g: Graph, y: str, mw: MambaWeights, m: MambaSpec) -> str:
    """y [1, S, I] float32 -> y / rms over each of G groups of I / G channels, [1, S, I] float32."""
    (grp,) = g.op("Reshape", [y, _i64(g, "shape", [1, -1, m.groups, m.inner // m.groups])])
    (var,) = g.op("ReduceMean", [g.op("Mul", [grp, grp])[0]], axes=[-1], keepdims=1)
    (std,) = g.op("Sqrt", [g.op("Add", [var, _f32(g, "eps", mw.norm_eps)])[0]])
    (normed,) = g.op("Div", [grp, std])
    return g.op("Reshape", [normed, _i64(g, "shape", [1, -1, m.inner])])[0]
