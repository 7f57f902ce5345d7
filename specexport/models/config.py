"""One normalized view of a model's config: the facts every graph form, `plan` and the trainer read.

    cfg = read_config(source)                        # config.json only: no weights are read
    norm = normalize(cfg, max_context=4096)          # NormalizedConfig, or a one-line refusal

transformers' own config class reads the checkpoint's config.json (so a transformers 4.x file with
`rope_scaling` / `rope_theta` / `rope_local_base_freq` is standardized into `rope_parameters`, and
derived keys such as Gemma's `layer_types` are filled in as the model will use them). normalize
then checks every key that changes the computation against the family's closed list
(architectures.ArchSpec.features, vocabulary FEATURE_OF_KEY below): a key that is set but not
implemented is refused naming the key, its value and what the family implements. Keys no family
reads (ids, dropout, metadata) are inert: transformers' modules never read them either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .architectures import ArchSpec, arch_for
from .config_keys import ACTIVATIONS, FEATURE_OF_KEY, is_set
from .errors import UnsupportedConfig
from .errors import show as _show
from .layer_shapes import head_dims as _head_dims
from .layer_shapes import kv_sources as _kv_sources
from .mixers import (
    ATTENTION,
    CONV,
    GDN,
    HYBRID,
    KV_KINDS,
    MAMBA2,
    STATE_SITES,
    DeltaNetSpec,
    MambaSpec,
    deltanet_spec,
    intermediate,
    layer_kinds,
    mamba_spec,
)
from .rope import RopeSpec
from .rope import layer_rope as _layer_rope
from .rope import ropes as _ropes

# --------------------------------------------------------------------------- the normalized object


@dataclass(frozen=True)
class LayerSpec:
    window: int | None  # a query sees this many keys, itself included (transformers' sliding_window); None: all
    rope: str | None  # key of NormalizedConfig.ropes; None: no rotary in this layer (NoPE)
    kind: str = ATTENTION  # the mixer (mixers.py): ATTENTION (a K/V cache), CONV (LFM2), MAMBA2 (Granite 4.0-H)
    head_dim: int = 0  # this layer's q/k/v head width (0: NormalizedConfig.head_dim; Gemma 4's global layers)
    kv_source: int | None = None  # the earlier layer whose K/V this one reads (Gemma 4); None: its own


@dataclass(frozen=True)
class FalconMup:
    """Falcon-H1's muP multipliers beyond the embedding's: attention input and output, keys, the
    Mamba2 output, the MLP's gate (before its activation) and down projection, the logits."""

    attention_in: float = 1.0
    attention_out: float = 1.0
    key: float = 1.0
    ssm_out: float = 1.0
    mlp_gate: float = 1.0
    mlp_down: float = 1.0
    logits: float = 1.0


@dataclass(frozen=True)
class NormalizedConfig:
    """Shapes and computation features of one decoder, as transformers computes it."""

    family: str  # architectures.ARCHITECTURES key
    layers: tuple[LayerSpec, ...]
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int  # the K/V caches' head width: the widest layer's (narrower layers pad theirs with zeros)
    vocab: int
    tied: bool
    activation: str
    ropes: tuple[tuple[str, RopeSpec], ...]  # (key, table) pairs; empty for learned positions
    rotary_dim: int  # rotated dims of each q/k head (partial rotary: < head_dim); 0: learned positions
    attn_scale: float  # on q.k
    attn_softcap: float | None = None  # scores -> tanh(scores / c) * c
    final_softcap: float | None = None  # logits -> tanh(logits / c) * c
    embedding_multiplier: float | None = None  # Granite: embeddings times m
    residual_multiplier: float | None = None  # Granite: x + m * branch
    logits_divisor: float | None = None  # Granite logits_scaling: logits / d
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    max_positions: int = 0
    conv_kernel: int = 0  # CONV layers: the depthwise kernel L (the state keeps L - 1 inputs)
    conv_bias: bool = False  # CONV layers: in_proj, conv and out_proj have biases
    mamba: MambaSpec | None = None  # MAMBA2 layers' shapes
    deltanet: DeltaNetSpec | None = None  # GDN layers' shapes
    mup: FalconMup | None = None  # Falcon-H1's multipliers
    per_layer_input: int = 0  # Gemma 4: width of each layer's slice of the per-layer embedding (0: none)
    per_layer_vocab: int = 0  # Gemma 4: rows of the per-layer embedding [V_pl, L P] (0: none)
    double_wide_mlp: bool = False  # Gemma 4: layers reading another's K/V have MLPs of 2 x intermediate
    values_from_keys: tuple[int, ...] = ()  # Gemma 4 attention_k_eq_v: layers without v_proj (values = keys)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Indices of the layers owning a K/V cache (the contract's past_key_{n} is the n-th of them);
        a layer reading another's K/V (LayerSpec.kv_source) owns none."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.kind in KV_KINDS and layer.kv_source is None)

    def kv_layer(self, i: int) -> int:
        """n of the cache past_key_{n} that attention layer i attends over (its own or its source's)."""
        source = self.layers[i].kv_source
        return self.attention_layers.index(i if source is None else source)

    def layer_head_dim(self, i: int) -> int:
        return self.layers[i].head_dim or self.head_dim

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The recurrent state tensors in layer order: a CONV layer's [L - 1, hidden] conv inputs;
        a MAMBA2 layer's conv window [L - 1, conv_dim] then its scan state [H, P, N]."""
        out: list[tuple[int, ...]] = []
        for layer in self.layers:
            if layer.kind == CONV:
                out.append((self.conv_kernel - 1, self.hidden))
            elif layer.kind in (MAMBA2, HYBRID) and self.mamba is not None:
                out += self.mamba.state_shapes
            elif layer.kind == GDN and self.deltanet is not None:
                out += self.deltanet.state_shapes
        return tuple(out)

    def state_sites(self, i: int) -> int:
        """The index of layer i's first state tensor (its state_index sites come in layer order)."""
        return sum(STATE_SITES.get(layer.kind, 0) for layer in self.layers[:i])

    @property
    def arch(self) -> ArchSpec:
        return arch_for(self.family)

    def rope(self, key: str) -> RopeSpec:
        return dict(self.ropes)[key]

    @property
    def windows(self) -> tuple[int, ...]:
        """The distinct window sizes, smallest first."""
        return tuple(sorted({layer.window for layer in self.layers if layer.window is not None}))

    @property
    def head_rope_theta(self) -> float:
        """The theta of the full-attention layers' rotary table (what an EAGLE-3 head copies)."""
        full = [layer.rope for layer in self.layers if layer.window is None and layer.rope is not None]
        key = full[0] if full else next((layer.rope for layer in self.layers if layer.rope is not None), None)
        return self.rope(key).theta if key is not None else 10000.0

    def long_range_length(self, max_context: int) -> int:
        """Tokens a probe needs to cross every window shorter than max_context (0: none is)."""
        short = [w for w in self.windows if w < max_context]
        return min(max_context, max(short) + 16) if short else 0

    def describe(self) -> str:
        parts = [
            self.family,
            f"{self.num_layers} layers",
            f"hidden {self.hidden}",
            f"heads {self.heads}/{self.kv_heads}x{self.head_dim}",
        ]
        if self.windows:
            n = sum(layer.window is not None for layer in self.layers)
            parts.append(f"window {'/'.join(map(str, self.windows))} on {n} layers")
        convs = sum(layer.kind == CONV for layer in self.layers)
        if convs:
            parts.append(f"{convs} conv layers (kernel {self.conv_kernel})")
        mambas = sum(layer.kind in (MAMBA2, HYBRID) for layer in self.layers)
        if mambas and self.mamba is not None:
            m = self.mamba
            parts.append(f"{mambas} Mamba2 layers ({m.heads} heads x {m.head_dim}, state {m.state_size})")
        gdns = sum(layer.kind == GDN for layer in self.layers)
        if gdns and self.deltanet is not None:
            dn = self.deltanet
            parts.append(f"{gdns} Gated DeltaNet layers ({dn.key_heads}/{dn.value_heads} heads x {dn.key_dim})")
        if any(layer.rope is None for layer in self.layers if layer.kind == ATTENTION) and self.rotary_dim:
            parts.append(f"{sum(layer.rope is None for layer in self.layers)} NoPE layers")
        shared = sum(layer.kv_source is not None for layer in self.layers)
        if shared:
            parts.append(f"{shared} layers reading earlier layers' K/V")
        if self.per_layer_input:
            parts.append(f"per-layer inputs of {self.per_layer_input}")
        if any(layer.head_dim for layer in self.layers):
            dims = sorted({self.layer_head_dim(i) for i in range(self.num_layers)})
            parts.append("head_dim " + "/".join(map(str, dims)))
        if 0 < self.rotary_dim < self.head_dim:
            parts.append(f"rotary {self.rotary_dim}/{self.head_dim}")
        kinds = sorted({r.kind for _, r in self.ropes} - {"default"})
        if kinds:
            parts.append("rope " + "/".join(kinds))
        if self.attn_softcap or self.final_softcap:
            parts.append(f"softcaps {self.attn_softcap}/{self.final_softcap}")
        return ", ".join(parts)


# --------------------------------------------------------------------------- reading


def text_config(config) -> Any:
    """The decoder's config: a multimodal wrapper's text_config (Gemma 3 4B+), else config."""
    if arch_for(config.model_type).text_config:
        return config.text_config
    return config


def normalize(config, max_context: int | None = None) -> NormalizedConfig:
    """The NormalizedConfig of a transformers config object (from read_config or a loaded model).

    max_context: the context the graphs are built for; rope kinds exact only below a bound
    (dynamic, longrope) are refused above it, and a window of max_context keys or more is dropped
    (it never excludes a key there: Phi-4-mini's 262144). Raises UnsupportedArchitecture /
    UnsupportedConfig."""
    arch = arch_for(config.model_type)
    family = arch.model_type
    decoder_config = text_config(config)
    raw = decoder_config.to_dict()
    if raw.get("layer_types") is None and getattr(decoder_config, "layer_types", None) is not None:
        raw["layer_types"] = list(decoder_config.layer_types)  # a property in some classes (Falcon-H1)
    _check_features(raw, arch)
    get = raw.get
    hidden = int(get("hidden_size") or get("n_embd"))
    heads = int(get("num_attention_heads") or get("n_head"))
    kv_heads = int(get("num_key_value_heads") or heads)
    base_dim = int(get("head_dim") or hidden // heads)
    num_layers = int(get("num_hidden_layers") or get("n_layer") or len(get("layers_block_type") or ()))
    if heads % kv_heads:
        raise UnsupportedConfig(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    dims = _head_dims(raw, num_layers, base_dim, kv_heads)
    head_dim = max(dims)  # the caches' width
    types = get("layer_types") or ()
    type_dims = {t: d for t, d in zip(types, dims)}  # Gemma 4: one head_dim per layer type
    activation = (
        get("hidden_activation") or get("hidden_act") or get("activation_function") or get("mlp_hidden_act")
    ) or arch.activation
    if activation not in ACTIVATIONS:
        raise UnsupportedConfig(
            f"config key 'hidden_act' = {activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}"
        )
    ropes, rotary_dim = (), 0
    if arch.positions == "rope" and (not arch.rope_switch or get(arch.rope_switch) == "rope"):
        ropes, rotary_dim = _ropes(raw, arch, base_dim, max_context, type_dims)
    kinds = layer_kinds(raw, arch, num_layers)
    mamba = mamba_spec(raw, hidden) if MAMBA2 in kinds or HYBRID in kinds else None
    deltanet = deltanet_spec(raw) if GDN in kinds else None
    sources = _kv_sources(raw, num_layers)
    layers = tuple(
        LayerSpec(
            _window(raw, i, max_context),
            _layer_rope(raw, arch, i, ropes),
            kinds[i],
            dims[i] if dims[i] != head_dim else 0,
            sources[i],
        )
        for i in range(num_layers)
    )
    if not set(kinds) & set(KV_KINDS):
        raise UnsupportedConfig(f"{family}: no layer attends (layer_types {_show(get('layer_types'))})")
    conv_kernel = int(get("conv_L_cache") or 0) if CONV in kinds else 0
    if CONV in kinds and conv_kernel < 2:
        raise UnsupportedConfig(f"config key 'conv_L_cache' = {get('conv_L_cache')!r} must be a kernel of >= 2 taps")
    attention_bias = bool(get("attention_bias"))
    return NormalizedConfig(
        family=family,
        layers=layers,
        hidden=hidden,
        intermediate=intermediate(raw, hidden),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        vocab=int(get("vocab_size")),
        tied=bool(get("tie_word_embeddings", True)),
        activation=activation,
        ropes=ropes,
        rotary_dim=rotary_dim,
        attn_scale=arch.attn_scale if arch.attn_scale is not None else _attn_scale(raw, head_dim),
        attn_softcap=_float_or_none(get("attn_logit_softcapping")),
        final_softcap=_float_or_none(get("final_logit_softcapping")),
        embedding_multiplier=_float_or_none(get("embedding_multiplier")),
        residual_multiplier=_float_or_none(get("residual_multiplier")),
        logits_divisor=_float_or_none(get("logits_scaling")),
        norm_eps=float(get("rms_norm_eps") or get("layer_norm_epsilon") or get("norm_eps") or 1e-6),
        qkv_bias=arch.qkv_bias or attention_bias or arch.qkv == "conv1d",
        out_bias=attention_bias or arch.qkv == "conv1d",
        mlp_bias=bool(get("mlp_bias")) or arch.mlp_kind == "module",
        max_positions=int(get("max_position_embeddings") or get("n_positions") or 0),
        conv_kernel=conv_kernel,
        conv_bias=bool(get("conv_bias")) and CONV in kinds,
        mamba=mamba,
        deltanet=deltanet,
        mup=_falcon_mup(raw) if arch.block == "parallel" else None,
        per_layer_input=int(get("hidden_size_per_layer_input") or 0),
        per_layer_vocab=int(get("vocab_size_per_layer_input") or get("vocab_size"))
        if get("hidden_size_per_layer_input")
        else 0,
        double_wide_mlp=bool(get("use_double_wide_mlp")),
        values_from_keys=_values_from_keys(raw, sources),
    )


def _values_from_keys(raw: Mapping[str, Any], sources: tuple[int | None, ...]) -> tuple[int, ...]:
    """attention_k_eq_v: the layers whose values are their keys (no v_proj): every layer not of the
    sliding type that owns its K/V (transformers' Gemma4TextAttention)."""
    if not raw.get("attention_k_eq_v"):
        return ()
    types = list(raw.get("layer_types") or ())
    sliding = [i < len(types) and types[i] == "sliding_attention" for i in range(len(sources))]
    return tuple(i for i, source in enumerate(sources) if source is None and not sliding[i])


def _falcon_mup(raw: Mapping[str, Any]) -> FalconMup:
    gate, down = (float(m) for m in raw.get("mlp_multipliers") or (1.0, 1.0))
    return FalconMup(
        float(raw.get("attention_in_multiplier") or 1.0),
        float(raw.get("attention_out_multiplier") or 1.0),
        float(raw.get("key_multiplier") or 1.0),
        float(raw.get("ssm_out_multiplier") or 1.0),
        gate,
        down,
        float(raw.get("lm_head_multiplier") or 1.0),
    )


def _check_features(raw: Mapping[str, Any], arch: ArchSpec) -> None:
    for key, value in raw.items():
        feature = FEATURE_OF_KEY.get(key)
        if feature is None or feature in arch.features or not is_set(key, value):
            continue
        if feature == "mixture_of_experts" and arch.experts_by_layer_type:
            continue  # read only by "moe" layers, which layer_kinds refuses
        raise UnsupportedConfig(
            f"config key {key!r} = {_show(value)} is not implemented for {arch.model_type!r}"
            f" ({feature.replace('_', ' ')});"
            f" {arch.model_type} implements: {', '.join(sorted(arch.features)) or 'no optional features'}"
        )


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _attn_scale(raw: Mapping[str, Any], head_dim: int) -> float:
    if raw.get("attention_multiplier") is not None:  # Granite: replaces 1/sqrt(head_dim)
        return float(raw["attention_multiplier"])
    if raw.get("query_pre_attn_scalar") is not None:  # Gemma 2/3
        return float(raw["query_pre_attn_scalar"]) ** -0.5
    return head_dim**-0.5


def _window(raw: Mapping[str, Any], i: int, max_context: int | None) -> int | None:
    """Layer i's window as transformers applies it: config.sliding_window on the layers that
    layer_types marks sliding (all layers when the family has no layer_types: Mistral, Phi-3),
    unless use_sliding_window is false (Qwen2/3, SmolLM3)."""
    window = raw.get("sliding_window")
    if window is None or raw.get("use_sliding_window") is False:
        return None
    types = raw.get("layer_types")
    if types is not None and types[i] != "sliding_attention":
        return None
    if int(window) < 1:
        raise UnsupportedConfig(f"config key 'sliding_window' = {window!r} must be a positive number of keys")
    if max_context is not None and int(window) >= max_context:
        return None  # a query at position p < max_context sees all its p + 1 keys anyway
    return int(window)


# --------------------------------------------------------------------------- sources


def read_config(
    location: str, *, gguf_file: str | None = None, revision: str | None = None, trust_remote_code: bool = False
):
    """transformers' config object of a model folder, hub id (config.json only) or GGUF file
    (its metadata), without reading any weight. Raises UnsupportedArchitecture for a model type
    transformers does not know without remote code, UnsupportedConfig for an invalid config."""
    from transformers import AutoConfig

    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    if revision:
        kwargs["revision"] = revision
    try:
        return AutoConfig.from_pretrained(location, **kwargs)
    except ValueError as exc:  # unknown model_type, or a config class validator's refusal
        message = " ".join(str(exc).split())
        if "model_type" in message or "does not recognize this architecture" in message:
            from .architectures import UnsupportedArchitecture, supported_list

            raise UnsupportedArchitecture(f"{location}: {message[:200]}; supported: {supported_list()}") from None
        raise UnsupportedConfig(f"{location}: config.json is invalid: {message[:300]}") from None


def config_from_dict(data: Mapping[str, Any]):
    """A transformers config object from a config.json mapping (model_type inside)."""
    from transformers import AutoConfig

    data = _special_floats(dict(data))
    model_type = data.pop("model_type", None)
    arch_for(str(model_type))  # UnsupportedArchitecture before transformers is asked
    try:
        return AutoConfig.for_model(model_type, **data)
    except ValueError as exc:
        raise UnsupportedConfig(f"config is invalid: {' '.join(str(exc).split())[:300]}") from None


_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _special_floats(value: Any) -> Any:
    """transformers writes inf / nan into config.json as {"__float__": "Infinity"} (Granite 4.0-H's
    time_step_limit); its own reader decodes them, and so does this one."""
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[value["__float__"]]
        return {k: _special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_special_floats(v) for v in value]
    return value


def check_hf_modules(model, norm: NormalizedConfig) -> None:
    """Cross-check the loaded modules against the normalized config (shapes, per-layer scale)."""
    from .architectures import module_at

    arch = norm.arch
    layers = module_at(model, f"{arch.decoder}.{arch.layers}")
    if len(layers) != norm.num_layers:
        raise UnsupportedConfig(f"the model has {len(layers)} layers, its config {norm.num_layers}")
    for i, layer in enumerate(layers):
        mixer = getattr(layer, arch.mamba, None) if arch.mamba != arch.attn else None
        if mixer is not None and hasattr(mixer, "A_log") and norm.layers[i].kind not in (MAMBA2, HYBRID):
            raise UnsupportedConfig(
                f"layer {i} has a Mamba2 mixer but its config type reads {norm.layers[i].kind!r}: the layer types"
                " were not read as the model builds them"
            )
        if norm.layers[i].kind not in KV_KINDS:
            continue
        scale = getattr(module_at(layer, arch.attn), "scaling", None)
        if scale is not None and not math.isclose(float(scale), norm.attn_scale, rel_tol=1e-6):
            raise UnsupportedConfig(
                f"layer {i} attention scale {float(scale)} differs from the config's {norm.attn_scale}"
            )
