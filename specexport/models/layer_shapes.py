"""Per-layer attention shapes beyond the family-wide ones (Gemma 4), from config.json alone:

    dims = head_dims(raw, num_layers, head_dim, kv_heads)   # each layer's head_dim
    sources = kv_sources(raw, num_layers)                   # the layer whose K/V each layer reads

- transformers' per_layer_config (written from Gemma 4's global_head_dim) gives layers their own
  head_dim; one K/V head count for every layer is required (the caches share one shape);
- num_kv_shared_layers: the last n layers own no K/V; each reads the K/V of the last earlier layer
  of its own layer type (transformers' kv_sharing_modes "reuse" / "store"), so every shared layer
  type must have an owning layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import UnsupportedConfig
from .errors import show as _show

_LAYER_KEYS = {"head_dim", "num_key_value_heads"}  # per_layer_config entries read here


def head_dims(raw: Mapping[str, Any], num_layers: int, head_dim: int, kv_heads: int) -> tuple[int, ...]:
    """Layer i's head_dim: its per_layer_config override, else the config's."""
    overrides = raw.get("per_layer_config") or {}
    if not isinstance(overrides, Mapping):
        raise UnsupportedConfig(f"config key 'per_layer_config' = {_show(overrides)} is not a mapping of layers")
    # keys: layer indices as ints, or as strings zero-padded to the widest index (transformers'
    # to_dict writes "04" for layer 4 of 35)
    by_layer = {int(key): entry for key, entry in overrides.items()}
    dims = []
    for i in range(num_layers):
        entry = by_layer.get(i) or {}
        unknown = sorted(set(entry) - _LAYER_KEYS)
        if unknown:
            raise UnsupportedConfig(
                f"config key 'per_layer_config' sets {unknown} on layer {i};"
                f" implemented: {', '.join(sorted(_LAYER_KEYS))}"
            )
        heads = entry.get("num_key_value_heads")
        if heads is not None and int(heads) != kv_heads:
            raise UnsupportedConfig(
                f"config key 'per_layer_config' gives layer {i} {heads} K/V heads, the others {kv_heads}:"
                " layers with their own K/V head count (num_global_key_value_heads) are not implemented"
            )
        dims.append(int(entry.get("head_dim") or head_dim))
    return tuple(dims)


def kv_sources(raw: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """For each layer, the earlier layer whose K/V it attends over (None: its own cache)."""
    shared = int(raw.get("num_kv_shared_layers") or 0)
    if not shared:
        return (None,) * num_layers
    first = num_layers - shared
    if first < 1:
        raise UnsupportedConfig(
            f"config key 'num_kv_shared_layers' = {shared} of {num_layers} layers: no layer owns a K/V cache"
        )
    types = list(raw.get("layer_types") or ["full_attention"] * num_layers)
    out: list[int | None] = [None] * first
    for i in range(first, num_layers):
        owners = [j for j in range(first) if types[j] == types[i]]
        if not owners:
            raise UnsupportedConfig(
                f"config key 'num_kv_shared_layers' = {shared}: layer {i} ({types[i]}) has no earlier"
                f" {types[i]} layer owning a cache"
            )
        out.append(owners[-1])
    return tuple(out)
