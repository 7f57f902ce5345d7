"""Per-layer inputs (Gemma 4): a second embedding, packed [V_pl, L P] for L layers of width P,
mixed with a projection of the main embedding into one input per layer, which each layer gates
into its residual stream after its MLP; then each layer's output is scaled by its layer_scalar.

    e = table_pl[ids] sqrt(P)                                  [1, S, L, P]
    p = rmsnorm(reshape(proj(x) / sqrt(hidden)))               [1, S, L, P]   x: the scaled embedding
    inputs = (p + e) / sqrt(2)                                 [1, S, L, P]
    layer i, after its MLP:  x = x + norm(proj_i(act(gate_i(x)) * inputs[:, :, i]));  x = x * scalar_i
"""

from __future__ import annotations

import numpy as np

from specexport_runtime import contract

from ..models.architectures import module_at
from .writer import Linear

PROJECTION, TABLE, TABLE_NORM = "per_layer_model_projection", "embed_tokens_per_layer", "per_layer_projection_norm"


def per_layer_inputs(c, base, x: str) -> str:
    """The per-layer inputs [1, S, L, P] of the call's tokens (module docstring); x [1, S, hidden]
    is the scaled main embedding."""
    g, cfg, ws = c.g, c.cfg, c.ws
    L, P = cfg.num_layers, cfg.per_layer_input
    table = module_at(base, TABLE)
    (e,) = g.op("Gather", [g.weight("per_layer_table", ws.of(table)), contract.INPUT_IDS])  # [1, S, L P]
    (e,) = g.op("Mul", [e, g.scalar("per_layer_scale", float(table.embed_scale))])
    shape = g.const("shape", np.array([1, -1, L, P], np.int64))
    (e,) = g.op("Reshape", [e, shape])
    p = c.linear(x, Linear("per_layer_projection", (ws.part(module_at(base, PROJECTION)),)), None)  # [1, S, L P]
    (p,) = g.op("Mul", [p, g.scalar("per_layer_projection_scale", cfg.hidden**-0.5)])
    p = c.rms(g.op("Reshape", [p, shape])[0], module_at(base, TABLE_NORM), "per_layer_norm")
    return g.op("Mul", [g.op("Add", [p, e])[0], g.scalar("per_layer_input_scale", 2.0**-0.5)])[0]


def per_layer_branch(c, i: int, layer, x: str, inputs: str) -> str:
    """Layer i's addend norm(proj(act(gate(x)) * inputs[:, :, i])) [1, S, hidden] of x [1, S, hidden]."""
    g, ws = c.g, c.ws
    gate, proj, norm = (module_at(layer, name) for name in c.cfg.arch.per_layer_inputs)
    (own,) = g.op("Gather", [inputs, g.const("layer", np.array([i], np.int64))], axis=2)  # [1, S, 1, P]
    (own,) = g.op("Squeeze", [own, g.const("axes", np.array([2], np.int64))])  # [1, S, P]
    h = c.linear(x, Linear(f"l{i}_per_layer_gate", (ws.part(gate),)), None)  # [1, S, P]
    (h,) = g.op("Mul", [c.ops.activation(g, h, c.cfg.activation), own])
    h = c.linear(h, Linear(f"l{i}_per_layer_projection", (ws.part(proj),)), None)  # [1, S, hidden]
    return c.rms(h, norm, "post_norm")


def layer_scalar(c, layer) -> float | None:
    """The layer's output scale (None: absent or exactly 1, no node)."""
    name = c.cfg.arch.layer_scalar
    if not name:
        return None
    value = c.ws.of(layer, name).float().reshape(-1)
    scale = float(value[0])
    return None if scale == 1.0 else scale
