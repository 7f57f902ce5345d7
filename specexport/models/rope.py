"""Rotary tables in the normalized config: the tables a family's config asks for (one, or one per
layer type) and which one each layer reads (or none: NoPE), from transformers' standardized
rope_parameters. Kinds whose tables switch past a bound are exact only below it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .architectures import ArchSpec
from .errors import UnsupportedConfig
from .errors import show as _show

# proportional (Gemma 4): a table over the whole head whose frequencies past partial_rotary_factor
# are zero (cos 1, sin 0): a full-width rotation, read from transformers' table like the others
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
BOUNDED_ROPE_TYPES = ("dynamic", "longrope")  # exact while max_context <= the bound (rope_bound)


@dataclass(frozen=True)
class RopeSpec:
    """One rotary table (a family has one, Gemma 3 one per layer type)."""

    kind: str  # transformers' rope_type
    theta: float
    bound: int | None = None  # positions up to which a bounded kind equals its static tables
    dims: int = 0  # rotated dims of each q/k head of the layers reading it (its inv_freq has dims / 2)


def layer_rope(raw: Mapping[str, Any], arch: ArchSpec, i: int, ropes: tuple) -> str | None:
    """Layer i's rope key, or None for a NoPE layer (SmolLM3's no_rope_layers; EXAONE 4's
    full-attention layers of a windowed model)."""
    if not ropes:
        return None
    nope = raw.get("no_rope_layers")
    if nope is not None and not nope[i]:
        return None
    types = raw.get("layer_types")
    if arch.global_nope and raw.get("sliding_window") is not None and types and types[i] != "sliding_attention":
        return None
    keys = dict(ropes)
    if "all" in keys:
        return "all"
    layer_type = raw["layer_types"][i]
    if layer_type not in keys:
        raise UnsupportedConfig(f"layer {i} has layer type {layer_type!r} but rope_parameters has only {sorted(keys)}")
    return layer_type


def ropes(
    raw: Mapping[str, Any],
    arch: ArchSpec,
    head_dim: int,
    max_context: int | None,
    type_dims: Mapping[str, int] | None = None,
):
    """((key, RopeSpec), ...), rotary_dim (the widest table's) from transformers' standardized
    rope_parameters: one flat dict, or (Gemma 3) one dict per layer type. type_dims: the head_dim
    of each layer type's layers where it differs from head_dim (Gemma 4's global_head_dim)."""
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise UnsupportedConfig(f"config key 'rope_parameters' = {_show(params)} is not a mapping")
    per_type = all(isinstance(v, Mapping) for v in params.values()) and bool(params)
    if per_type and "rope_per_layer_type" not in arch.features:
        raise UnsupportedConfig(
            f"config key 'rope_parameters' has one table per layer type ({sorted(params)}),"
            f" which {arch.model_type!r} does not implement"
        )
    tables = dict(params) if per_type else {"all": params}
    factors = {float(t.get("partial_rotary_factor", 1.0)) for t in tables.values() if not _proportional(t)}
    factor = factors.pop() if factors else 1.0
    if factors:
        raise UnsupportedConfig(f"rotary tables with different partial_rotary_factor {sorted(factors | {factor})}")
    if factor != 1.0 and "partial_rotary" not in arch.features:
        raise UnsupportedConfig(
            f"config key 'partial_rotary_factor' = {factor} is not implemented for "
            f"{arch.model_type!r}; only families with partial rotary (phi3) take it"
        )
    out = []
    for key, table in tables.items():
        width = (type_dims or {}).get(key, head_dim)
        dims = width if _proportional(table) else int(width * factor)
        if dims % 2 or dims <= 0:
            raise UnsupportedConfig(
                f"partial_rotary_factor {factor} gives {dims} rotary dims of {width}; need an even number > 0"
            )
        kind = table.get("rope_type", table.get("type", "default"))
        theta = float(table.get("rope_theta", 10000.0))
        bound = None
        if kind in BOUNDED_ROPE_TYPES:
            name = "original_max_position_embeddings" if kind == "longrope" else "max_position_embeddings"
            value = table.get(name) or raw.get(name) or raw.get("max_position_embeddings")
            bound = int(value)
            if max_context is not None and max_context > bound:
                raise UnsupportedConfig(
                    f"rope_type {kind!r} switches its tables past {name} = {bound} positions and max_context is"
                    f" {max_context}; build with max_context <= {bound} (exact there) or use another checkpoint"
                )
        elif kind not in STATIC_ROPE_TYPES:
            raise UnsupportedConfig(
                f"config key 'rope_parameters' (rope_scaling in transformers 4 files) has rope_type {kind!r}, which is"
                f" not supported; supported: {', '.join(STATIC_ROPE_TYPES + BOUNDED_ROPE_TYPES)}"
                f" ({'/'.join(BOUNDED_ROPE_TYPES)} only up to their original context)"
            )
        out.append((key, RopeSpec(kind, theta, bound, dims)))
    return tuple(out), max(spec.dims for _, spec in out)


def _proportional(table: Mapping[str, Any]) -> bool:
    return table.get("rope_type") == "proportional"
