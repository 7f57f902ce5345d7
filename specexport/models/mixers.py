"""The recurrent mixers of hybrid families in the normalized config (feature recurrent_state):
which layers run which mixer, and the shapes of their states.

    kinds = layer_kinds(raw, arch, num_layers)   # ATTENTION | CONV | MAMBA2 per layer
    mamba = mamba_spec(raw, hidden)              # a Mamba2 mixer's shapes (Granite 4.0-H)
    deltanet = deltanet_spec(raw)                # a Gated DeltaNet mixer's shapes (Qwen3.5)

A layer type the family's row does not map (ArchSpec.layer_kinds) is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .architectures import ArchSpec
from .errors import UnsupportedConfig

# LayerSpec.kind: the layer's mixer (MLP: a block that is only an MLP, Nemotron-H; HYBRID: attention
# and Mamba2 side by side on the same input, Falcon-H1)
ATTENTION, CONV, MAMBA2, GDN, MLP, HYBRID = "attention", "conv", "mamba2", "gdn", "mlp", "hybrid"
KV_KINDS = (ATTENTION, HYBRID)  # layers with a K/V cache
STATE_SITES = {CONV: 1, MAMBA2: 2, GDN: 2, HYBRID: 2}  # recurrent state tensors per layer


@dataclass(frozen=True)
class MambaSpec:
    """A Mamba2 mixer (transformers' GraniteMoeHybridMambaLayer): in_proj -> gate [I] | xBC | dt [H];
    xBC through a causal depthwise conv of `conv_kernel` taps and silu; a selective scan of H heads
    of `head_dim` over a state of `state_size` per head, B and C shared by `groups` groups; a gated
    RMSNorm over `groups` groups of I / groups; out_proj."""

    heads: int  # H
    head_dim: int  # P: I = H P
    groups: int  # G
    state_size: int  # N
    conv_kernel: int  # L
    conv_bias: bool
    proj_bias: bool
    dt_limit: tuple[float, float]  # dt clamped into [lo, hi] after softplus
    # Falcon-H1: the input times in_multiplier, in_proj's z | x | B | C | dt times these (muP), and the
    # output norm: "gate_norm" rmsnorm(y * silu(gate)) w (Granite, Nemotron), "norm_gate"
    # rmsnorm(y) w * silu(gate), or "gate" y * silu(gate) alone
    in_multiplier: float = 1.0
    projection_multipliers: tuple[float, ...] | None = None
    norm: str = "gate_norm"

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: x | B | C."""
        return self.inner + 2 * self.groups * self.state_size

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The conv window [L - 1, conv_dim] and the scan state [H, P, N]."""
        return (self.conv_kernel - 1, self.conv_dim), (self.heads, self.head_dim, self.state_size)


@dataclass(frozen=True)
class DeltaNetSpec:
    """A Gated DeltaNet mixer (transformers' Qwen3_5GatedDeltaNet): q, k of `key_heads` x `key_dim`,
    v of `value_heads` x `value_dim` (key heads repeat to the value heads) through a causal
    depthwise conv of `conv_kernel` taps and silu; the gated delta rule over a state [Hv, dk, dv]."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q | k | v."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The conv window [L - 1, conv_dim] and the delta-rule state [Hv, dk, dv]."""
        return (self.conv_kernel - 1, self.conv_dim), (self.value_heads, self.key_dim, self.value_dim)


def deltanet_spec(raw: Mapping[str, Any]) -> DeltaNetSpec:
    spec = DeltaNetSpec(
        int(raw["linear_num_key_heads"]),
        int(raw["linear_num_value_heads"]),
        int(raw["linear_key_head_dim"]),
        int(raw["linear_value_head_dim"]),
        int(raw.get("linear_conv_kernel_dim") or 4),
    )
    if spec.value_heads % spec.key_heads:
        raise UnsupportedConfig(
            f"linear_num_value_heads {spec.value_heads} is not a multiple of linear_num_key_heads {spec.key_heads}"
        )
    return spec


def layer_kinds(raw: Mapping[str, Any], arch: ArchSpec, num_layers: int) -> tuple[str, ...]:
    """Each layer's mixer from layer_types through the family's layer_kinds (transformers has
    already renamed legacy types: mamba -> linear_attention, attention -> full_attention)."""
    types = raw.get("layer_types") or raw.get("layers_block_type")  # Nemotron-H: layers_block_type
    if types is None:
        return (ATTENTION,) * num_layers
    if len(types) != num_layers:
        raise UnsupportedConfig(f"config key 'layer_types' has {len(types)} entries for {num_layers} layers")
    table = dict(arch.layer_kinds)
    unknown = sorted({t for t in types if t not in table})
    if unknown:
        raise UnsupportedConfig(
            f"config key 'layer_types' has {unknown}, which {arch.model_type!r} does not implement;"
            f" it implements: {', '.join(sorted(table))}"
        )
    return tuple(table[t] for t in types)


# Mamba2 settings by config key: Granite 4.0-H's names, then Nemotron-H's
_MAMBA_KEYS = {
    "heads": ("mamba_n_heads", "mamba_num_heads"),
    "head_dim": ("mamba_d_head", "mamba_head_dim"),
    "expand": ("mamba_expand", "expand"),
    "groups": ("mamba_n_groups", "n_groups"),
    "state": ("mamba_d_state", "ssm_state_size"),
    "conv": ("mamba_d_conv", "conv_kernel"),
    "conv_bias": ("mamba_conv_bias", "use_conv_bias"),
    "proj_bias": ("mamba_proj_bias", "use_bias"),
}


def _mamba(raw: Mapping[str, Any], what: str, default: Any = None) -> Any:
    """A Mamba2 setting under the naming the config uses (Nemotron-H's has mamba_num_heads)."""
    key = _MAMBA_KEYS[what][1 if raw.get("mamba_num_heads") is not None else 0]
    return raw[key] if raw.get(key) is not None else default


def mamba_spec(raw: Mapping[str, Any], hidden: int) -> MambaSpec:
    act = raw.get("mamba_hidden_act", "silu")
    if act != "silu":
        raise UnsupportedConfig(f"config key 'mamba_hidden_act' = {act!r} is not supported; supported: silu")
    heads = int(_mamba(raw, "heads"))
    inner = int(_mamba(raw, "expand", 2)) * hidden
    head_dim = int(_mamba(raw, "head_dim"))
    if raw.get("mamba_num_heads") is not None:  # Nemotron-H: the inner width is heads x head_dim
        inner = heads * head_dim
    if raw.get("mamba_d_ssm") is not None:  # Falcon-H1: an explicit inner width
        inner = int(raw["mamba_d_ssm"])
    if heads * head_dim != inner:
        raise UnsupportedConfig(f"mamba_n_heads {heads} x mamba_d_head {head_dim} != mamba_expand x hidden {inner}")
    groups = int(_mamba(raw, "groups", 1))
    if heads % groups:
        raise UnsupportedConfig(f"mamba_n_heads {heads} is not a multiple of mamba_n_groups {groups}")
    limit = raw.get("time_step_limit") or (0.0, float("inf"))
    return MambaSpec(
        heads,
        head_dim,
        groups,
        int(_mamba(raw, "state")),
        int(_mamba(raw, "conv", 4)),
        bool(_mamba(raw, "conv_bias", False)),
        bool(_mamba(raw, "proj_bias", False)),
        (float(limit[0]), float(limit[1])),
        float(raw.get("ssm_in_multiplier") or 1.0),
        tuple(float(m) for m in raw["ssm_multipliers"]) if raw.get("ssm_multipliers") is not None else None,
        _norm_mode(raw),
    )


def _norm_mode(raw: Mapping[str, Any]) -> str:
    """MambaSpec.norm: Falcon-H1's mamba_rms_norm / mamba_norm_before_gate, else Granite's order."""
    if raw.get("mamba_rms_norm") is None:
        return "gate_norm"
    if not raw["mamba_rms_norm"]:
        return "gate"
    return "norm_gate" if raw.get("mamba_norm_before_gate", True) else "gate_norm"


def intermediate(raw: Mapping[str, Any], hidden: int) -> int:
    """The MLP width: Granite 4.0-H's shared MLP (shared_intermediate_size; its experts are
    refused); LFM2's block_auto_adjust_ff_dim shrinks the configured one to 2/3, times
    block_ffn_dim_multiplier, rounded up to block_multiple_of (as transformers' Lfm2MLP)."""
    if raw.get("shared_intermediate_size") is not None:
        return int(raw["shared_intermediate_size"])
    width = int(raw.get("intermediate_size") or raw.get("n_inner") or 4 * hidden)
    if raw.get("block_auto_adjust_ff_dim"):
        width = int(2 * width / 3)
        if raw.get("block_ffn_dim_multiplier") is not None:
            width = int(raw["block_ffn_dim_multiplier"] * width)
            multiple = int(raw.get("block_multiple_of") or 1)
            width = multiple * ((width + multiple - 1) // multiple)
    return width
