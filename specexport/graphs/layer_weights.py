"""Where a decoder layer's weight sites live (one layer's weights at a time, read lazily): q|k|v
(Qwen3.5's per-head q rows without their gate), o, the MLP's gate|up and down, with their
biases; the family's row (architectures.py) names the modules. Recurrent mixers read their own
(conv.py, mamba.py, gdn.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.architectures import ArchSpec, module_at
from ..models.config import NormalizedConfig, UnsupportedConfig
from ..models.mixers import KV_KINDS, MLP
from ..models.streaming import Part, Weights
from .writer import Linear


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weight sites: q|k|v [(H + 2 H_kv) D, hidden], o, gate|up [2 I, hidden]
    (a plain MLP: up [I, hidden] only, `gated` False), down, each with its bias or None."""

    qkv: Linear | None  # None: a CONV layer (its mixer's weights: conv.ConvWeights)
    qkv_b: torch.Tensor | None
    o: Linear | None
    o_b: torch.Tensor | None
    gate_up: Linear | None  # None: a single block of a mixer only (ArchSpec.block "single")
    gate_up_b: torch.Tensor | None
    down: Linear | None
    down_b: torch.Tensor | None
    gated: bool = True


def _bias(w: Weights, *modules: torch.nn.Module) -> torch.Tensor | None:
    if all(getattr(m, "bias", None) is None for m in modules):
        return None
    return torch.cat([w.bias(m) if m.bias is not None else torch.zeros(m.weight.shape[0]) for m in modules])


def _conv1d(w: Weights, module: torch.nn.Module) -> Part:
    """The weight [N, K] of a transformers Conv1D, which stores [K, N] (GPT-2)."""
    return w.part(module, transposed=True)


def gated_rows(whole: Part, heads: int, head_dim: int, half: int) -> Part:
    """Qwen3.5's q_proj [H 2 D, hidden] holds per head [q (D rows) | gate (D rows)]: the q rows
    (half 0) or the gate rows (half 1) as a part [H D, hidden]."""

    def read():
        w = whole.read()
        return w.reshape(heads, 2, head_dim, w.shape[-1])[:, half].reshape(heads * head_dim, w.shape[-1])

    return Part(f"{whole.name}[{'q' if half == 0 else 'gate'}]", (heads * head_dim, whole.shape[1]), read)


def layer_weights(layer: torch.nn.Module, arch: ArchSpec, cfg: NormalizedConfig, w: Weights, i: int) -> LayerWeights:
    """Layer i's weights, read from the source (one layer's weights at a time); a CONV layer's
    mixer (conv.conv_weights) has no q|k|v / o sites here."""
    mlp = module_at(layer, arch.mlp)
    part = w.part
    kind = cfg.layers[i].kind
    if kind not in KV_KINDS:  # a recurrent mixer (conv.py, mamba.py, gdn.py) reads its own weights
        qkv, mods, o, out = None, (), None, None
    elif arch.qkv == "separate":  # a K/V-sharing layer: q only; keys as values: q|k (layer_attention.py)
        attn = module_at(layer, arch.attn)
        kv = () if cfg.layers[i].kv_source is not None else (attn.k_proj, attn.v_proj)
        mods = (attn.q_proj, *(m for m in kv if m is not None))
        q = gated_rows(part(attn.q_proj), cfg.heads, cfg.head_dim, 0) if arch.attn_gate else part(attn.q_proj)
        qkv = Linear(f"l{i}_qkv", (q, *(part(m) for m in mods[1:])))
    elif arch.qkv == "fused":
        attn = module_at(layer, arch.attn)
        mods = (attn.qkv_proj,)
        qkv = Linear(f"l{i}_qkv", (part(attn.qkv_proj),))
    else:  # conv1d: c_attn, columns [q | k | v]
        attn = module_at(layer, arch.attn)
        mods = (attn.c_attn,)
        qkv = Linear(f"l{i}_qkv", (_conv1d(w, attn.c_attn),))
    H, Hkv, D = cfg.heads, cfg.kv_heads, cfg.layer_head_dim(i)
    if qkv is not None:
        kv_parts = 2 if arch.qkv != "separate" else len(mods) - 1  # 1: keys as values, 0: K/V sharing
        if qkv.out_features != (H + kv_parts * Hkv) * D:
            raise UnsupportedConfig(
                f"layer {i}: q|k|v rows {qkv.out_features} != (H + {kv_parts} H_kv) D = {(H + kv_parts * Hkv) * D}"
            )
        out = getattr(attn, arch.out_proj)
        o = _conv1d(w, out) if arch.qkv == "conv1d" else part(out)
    if arch.mlp_kind == "module":  # a plain MLP of Conv1Ds: c_fc, act, c_proj (GPT-2)
        return LayerWeights(
            qkv,
            _bias(w, *mods),
            Linear(f"l{i}_o", (o,)),
            _bias(w, out),
            Linear(f"l{i}_up", (_conv1d(w, mlp.c_fc),)),
            _bias(w, mlp.c_fc),
            Linear(f"l{i}_down", (_conv1d(w, mlp.c_proj),)),
            _bias(w, mlp.c_proj),
            gated=False,
        )
    gate_name, up_name, down_name = arch.mlp_names
    if arch.block == "single" and kind != MLP:  # a block of one mixer: no MLP of its own
        return LayerWeights(
            qkv,
            _bias(w, *mods) if mods else None,
            Linear(f"l{i}_o", (o,)) if o is not None else None,
            _bias(w, out) if out is not None else None,
            None,
            None,
            None,
            None,
        )
    if arch.mlp_kind == "plain":  # up -> activation -> down
        up, down = getattr(mlp, up_name), getattr(mlp, down_name)
        return LayerWeights(
            None,
            None,
            None,
            None,
            Linear(f"l{i}_up", (part(up),)),
            _bias(w, up),
            Linear(f"l{i}_down", (part(down),)),
            _bias(w, down),
            gated=False,
        )
    if arch.mlp_kind == "gated":
        up_mods = (getattr(mlp, gate_name), getattr(mlp, up_name))
    else:  # fused_gated: rows [gate; up] already
        up_mods = (getattr(mlp, gate_name),)
    down = getattr(mlp, down_name)
    return LayerWeights(
        qkv,
        _bias(w, *mods) if mods else None,
        Linear(f"l{i}_o", (o,)) if o is not None else None,
        _bias(w, out) if out is not None else None,
        Linear(f"l{i}_gate_up", tuple(part(m) for m in up_mods)),
        _bias(w, *up_mods),
        Linear(f"l{i}_down", (part(down),)),
        _bias(w, down),
    )
