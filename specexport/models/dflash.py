"""DFlash block drafters: their folder read, their config checked against the target's, before
any graph is written.

A DFlash drafter drafts a whole block in one forward: it reads the target's hidden states at its
`target_layer_ids` (the outputs of those decoder layers, transformers' output_hidden_states[i + 1])
for every committed position, projects them (`fc`, then an RMSNorm) into its own K/V, and runs its
layers bidirectionally over `block_size` rows: the last committed token, then `block_size - 1`
copies of `mask_token_id`, embedded with the target's table. Rows 1 .. block_size - 1 give the
drafts through the target's output head. It has no embedding and no head of its own.

Two folder layouts hold the same weights (config.json + safetensors):

    layout        config keys                                   projection weights
    transformers  block_size, mask_token_id, target_layer_ids   encoder.fc.weight, encoder.output_norm_enc.weight
    published     dflash_config: {mask_token_id, target_layer_ids}, block_size (top level or inside)
                                                                fc.weight, hidden_norm.weight

and the same per-layer names (layers.{i}.self_attn.{q,k,v,o}_proj, q_norm, k_norm, mlp.{gate,up,down}_proj,
input_layernorm, post_attention_layernorm) and the final `norm.weight`. `is_dflash_folder` is how a
recipe's `draft: {model: PATH}` is recognised as one. Every refusal is one line (UnsupportedConfig).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import UnsupportedConfig

TRANSFORMERS, PUBLISHED = "transformers", "published"
PROJECTION = {  # layout -> (fc, norm) weight names
    TRANSFORMERS: ("encoder.fc.weight", "encoder.output_norm_enc.weight"),
    PUBLISHED: ("fc.weight", "hidden_norm.weight"),
}
LAYER_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


@dataclass(frozen=True)
class DFlashConfig:
    """What the drafter's graph needs, read from its config.json."""

    layout: str  # TRANSFORMERS | PUBLISHED: which projection names its weights use
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int  # rows of one drafter call: the anchor, then block_size - 1 masks (drafts)
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # target decoder layers whose outputs feed the drafter

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target graph's feature_layers (residual streams entering layer i): i + 1 per id."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @property
    def feature_width(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size


def _read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise UnsupportedConfig(f"{folder} has no config.json; a DFlash drafter folder holds config.json + safetensors")
    return json.loads(path.read_text())


def _dflash_keys(raw: dict) -> tuple[str, dict] | None:
    """(layout, {block_size, mask_token_id, target_layer_ids}) or None when raw is no DFlash config."""
    inner = raw.get("dflash_config")
    if isinstance(inner, dict) and "target_layer_ids" in inner:
        keys = {k: inner.get(k, raw.get(k)) for k in ("block_size", "mask_token_id", "target_layer_ids")}
        return PUBLISHED, keys
    if "target_layer_ids" in raw and "mask_token_id" in raw and "block_size" in raw:
        return TRANSFORMERS, {k: raw[k] for k in ("block_size", "mask_token_id", "target_layer_ids")}
    return None


def is_dflash_folder(folder: str | Path) -> bool:
    """Whether `folder` holds a DFlash drafter (its config names target_layer_ids, block_size and
    mask_token_id, at the top level or in dflash_config)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return False
    try:
        return _dflash_keys(json.loads(path.read_text())) is not None
    except (OSError, ValueError):
        return False


def read_dflash_config(folder: str | Path) -> DFlashConfig:
    """The drafter's config, or UnsupportedConfig naming the first key this graph does not implement."""
    raw = _read_config(Path(folder))
    found = _dflash_keys(raw)
    if found is None:
        raise UnsupportedConfig(f"{folder}: config.json names no target_layer_ids / block_size / mask_token_id")
    layout, keys = found
    extra = sorted(
        k for k in (raw.get("dflash_config") or {}) if k not in ("block_size", "mask_token_id", "target_layer_ids")
    )
    if extra:
        raise UnsupportedConfig(f"DFlash dflash_config keys {extra} are not implemented (a later drafter version)")
    for key in ("block_size", "mask_token_id"):
        if not isinstance(keys[key], int) or isinstance(keys[key], bool):
            raise UnsupportedConfig(f"DFlash {key} must be an integer, got {keys[key]!r}")
    if keys["block_size"] < 2:
        raise UnsupportedConfig(f"DFlash block_size must be >= 2 (the anchor and one draft), got {keys['block_size']}")
    ids = keys["target_layer_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UnsupportedConfig(f"DFlash target_layer_ids must be a non-empty list of integers, got {ids!r}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedConfig(f"DFlash hidden_act {act!r} is not implemented (silu)")
    if raw.get("attention_bias"):
        raise UnsupportedConfig("DFlash attention_bias true is not implemented")
    rope = raw.get("rope_parameters") or {"rope_type": "default", "rope_theta": raw.get("rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedConfig(f"DFlash rope_type {rope.get('rope_type')!r} is not implemented (default)")
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types") or ["full_attention"] * layers
    window = raw.get("sliding_window")
    if any(t != "full_attention" for t in types) and (raw.get("use_sliding_window", True) and window is not None):
        raise UnsupportedConfig(
            f"DFlash sliding-window layers (window {window}) are not implemented; full_attention layers only"
        )
    heads = int(raw["num_attention_heads"])
    return DFlashConfig(
        layout=layout,
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads", heads)),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        block_size=keys["block_size"],
        mask_token_id=keys["mask_token_id"],
        target_layer_ids=tuple(ids),
    )


def check_against_target(c: DFlashConfig, target_config) -> None:
    """One line for the first way the drafter does not fit the target (a transformers config):
    hidden width, layer ids (the last layer's output is the final norm's input, which the target
    graph does not emit), and the mask token within the target's embedding rows."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    hidden, layers, vocab = int(text.hidden_size), int(text.num_hidden_layers), int(text.vocab_size)
    if c.hidden_size != hidden:
        raise UnsupportedConfig(f"DFlash hidden_size {c.hidden_size} differs from the target's {hidden}")
    bad = [i for i in c.target_layer_ids if not 0 <= i <= layers - 2]
    if bad:
        raise UnsupportedConfig(
            f"DFlash target_layer_ids {bad} are outside the target's 0..{layers - 2}"
            f" (its {layers} layers, the last excluded)"
        )
    if not 0 <= c.mask_token_id < vocab:
        raise UnsupportedConfig(
            f"DFlash mask_token_id {c.mask_token_id} is outside the target's {vocab} embedding rows"
        )


@dataclass(frozen=True)
class DFlashDrafter:
    """A checked drafter: its config and weights by their transformers-layout names (float32)."""

    config: DFlashConfig
    weights: dict[str, torch.Tensor]
    folder: Path


def expected_shapes(c: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the graph reads, by its transformers-layout name, with its shape."""
    H, D = c.hidden_size, c.head_dim
    per_layer = {
        "self_attn.q_proj.weight": (c.num_heads * D, H),
        "self_attn.k_proj.weight": (c.num_kv_heads * D, H),
        "self_attn.v_proj.weight": (c.num_kv_heads * D, H),
        "self_attn.o_proj.weight": (H, c.num_heads * D),
        "self_attn.q_norm.weight": (D,),
        "self_attn.k_norm.weight": (D,),
        "mlp.gate_proj.weight": (c.intermediate_size, H),
        "mlp.up_proj.weight": (c.intermediate_size, H),
        "mlp.down_proj.weight": (H, c.intermediate_size),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
    }
    shapes = {f"layers.{i}.{k}": v for i in range(c.num_layers) for k, v in per_layer.items()}
    fc, norm = PROJECTION[TRANSFORMERS]
    shapes.update({fc: (H, c.feature_width), norm: (H,), "norm.weight": (H,)})
    return shapes


def load_dflash(folder: str | Path, target_config) -> DFlashDrafter:
    """Read and check a drafter folder against the target's config, then its weights (safetensors):
    every expected tensor present with its shape, nothing else."""
    from safetensors import safe_open

    folder = Path(folder)
    c = read_dflash_config(folder)
    check_against_target(c, target_config)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UnsupportedConfig(f"{folder} has no *.safetensors weights")
    rename = dict(zip(PROJECTION[c.layout], PROJECTION[TRANSFORMERS]))
    prefix = "model."  # a base model saved under a wrapper
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                name = key[len(prefix) :] if key.startswith(prefix) else key
                weights[rename.get(name, name)] = f.get_tensor(key).float()
    want = expected_shapes(c)
    extra = sorted(set(weights) - set(want))
    if extra:
        raise UnsupportedConfig(f"DFlash weights {extra[:3]} are not implemented (a later drafter version?)")
    missing = sorted(set(want) - set(weights))
    if missing:
        raise UnsupportedConfig(f"DFlash weights {missing[:3]} are missing from {folder}")
    wrong = [(k, tuple(weights[k].shape), v) for k, v in want.items() if tuple(weights[k].shape) != v]
    if wrong:
        k, got, v = wrong[0]
        raise UnsupportedConfig(f"DFlash weight {k} has shape {list(got)}, expected {list(v)} from its config")
    return DFlashDrafter(c, weights, folder)
