"""Supported architectures: each family is one declarative row over the shared decoder.

A row says where the pieces of the transformers model live, how its layer is wired (which norms
surround attention and MLP, q/k norms, embedding scale), and `features`: the closed list of
optional config features the family implements (model_config.FEATURE_OF_KEY names the config
keys behind each). The graph writer (decoder_graph.py, both forms) reads these rows and the
normalized config (model_config.py); nothing else derives family facts.

Register a new family in ARCHITECTURES and give it a tiny config in tests/tiny.TINY_CONFIGS
(the parity tests fail when one is missing).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from specexport_runtime.errors import SpecExportError


class UnsupportedArchitecture(SpecExportError):
    """The model's architecture is not in ARCHITECTURES."""


@dataclass(frozen=True)
class ArchSpec:
    model_type: str  # HF config.model_type
    decoder: str = "model"  # attribute path of the base model inside *ForCausalLM
    embed: str = "embed_tokens"  # token embedding, relative to decoder
    layers: str = "layers"
    final_norm: str = "norm"
    attn: str = "self_attn"  # per layer
    # norms per layer, relative to the layer; None: absent
    #   x = x + attn_post_norm(attn(attn_norm(x)));  x = x + mlp_post_norm(mlp(mlp_norm(x)))
    attn_norm: str | None = "input_layernorm"
    attn_post_norm: str | None = None  # Gemma 2/3, OLMo 2
    mlp_norm: str | None = "post_attention_layernorm"
    mlp_post_norm: str | None = None  # Gemma 2/3, OLMo 2
    mlp: str = "mlp"
    mlp_kind: Literal["gated", "fused_gated", "module", "plain"] = "gated"
    # gated:       gate_proj/up_proj/down_proj + act_fn (fused here into one gate|up MatMul)
    # fused_gated: gate_up_proj rows [gate | up] + down_proj + activation_fn (Phi-3)
    # module:      HF's own MLP module called as is (GPT-2)
    # plain:       up -> activation -> down, no gate (mlp_names[1], mlp_names[2]; Nemotron-H's relu2)
    qkv: Literal["separate", "fused", "conv1d"] = "separate"
    # separate: q_proj/k_proj/v_proj (nn.Linear, bias if the checkpoint has one: Qwen2)
    # fused:    qkv_proj with rows [q | k | v] (Phi-3)
    # conv1d:   c_attn, transformers Conv1D with columns [q | k | v] (GPT-2)
    qkv_bias: bool = False  # q/k/v biases whatever the config says (Qwen2)
    out_proj: str = "o_proj"
    qk_norm: Literal["", "head", "full"] = (
        ""  # RMSNorm of q and k before rotary: per head (Qwen3, Gemma 3) or over all heads (OLMo 2)
    )
    positions: Literal["rope", "learned", "none"] = "rope"  # none: no position signal (Nemotron-H)
    position_embed: str = ""  # learned positions, relative to decoder (GPT-2: wpe)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size), in the model dtype
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (offset + w); the fused graph folds it into w
    norm_bias: bool = False  # LayerNorm with a bias (GPT-2), not RMSNorm
    features: frozenset[str] = frozenset()  # optional config features implemented (model_config.FEATURE_OF_KEY)
    text_config: bool = False  # a multimodal wrapper: the decoder's config is config.text_config
    global_nope: bool = False  # EXAONE 4: with sliding_window set, the full-attention layers have no rotary
    q_norm: str = "q_norm"  # qk_norm modules, relative to attn
    k_norm: str = "k_norm"
    # gated MLP: gate, up, down; fused_gated: the [gate; up] module, unused, down
    mlp_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    activation: str = ""  # the MLP activation when the config names none (LFM2: silu, hard-wired)
    # config layer_types value -> the mixer that layer runs: "attention" or "conv" (LFM2's gated short
    # convolution, module `conv`: in_proj -> B, C, x; y = C * causal_depthwise_conv(B * x); out_proj)
    layer_kinds: tuple[tuple[str, str], ...] = (("full_attention", "attention"), ("sliding_attention", "attention"))
    conv: str = "conv"  # the conv mixer module, relative to the layer
    mamba: str = "mamba"  # the Mamba2 mixer module (layer kind "mamba2"), relative to the layer
    deltanet: str = "linear_attn"  # the Gated DeltaNet mixer module (layer kind "gdn"), relative to the layer
    attn_gate: bool = False  # Qwen3.5: q_proj rows per head [q | gate]; attention output times sigmoid(gate)
    # rotary only when config[key] == "rope" (Granite 4.0-H: position_embedding_type; unset or "nope": NoPE)
    rope_switch: str = ""
    # pair: each layer is a mixer then an MLP, each behind its norm; single: each layer is one block,
    # norm -> mixer (attention, mamba2 or the MLP: layer kind "mlp") -> residual (Nemotron-H)
    # parallel: the mixer is attention and Mamba2 side by side on one normed input (Falcon-H1)
    block: Literal["pair", "single", "parallel"] = "pair"
    experts_by_layer_type: bool = False  # expert keys only matter on layers of a refused "moe" type
    attn_scale: float | None = None  # a fixed scale on q.k (Gemma 4: 1, its q/k norms set the size)
    v_norm: bool = False  # Gemma 4: values through a weightless RMSNorm per head (attn.v_norm)
    # Gemma 4: after the MLP, x = x + norm(proj(act(gate(x)) * per_layer_input_i)), modules per layer
    # (gate, projection, norm); per_layer_inputs.py builds the inputs from the second embedding
    per_layer_inputs: tuple[str, str, str] | None = None
    layer_scalar: str = ""  # Gemma 4: each layer's output times this buffer of the layer ([1])

    @property
    def norms_per_layer(self) -> int:
        return sum(n is not None for n in (self.attn_norm, self.attn_post_norm, self.mlp_norm, self.mlp_post_norm))


def _features(*names: str) -> frozenset[str]:
    return frozenset(names)


LLAMA = ArchSpec("llama", features=_features("attention_bias", "mlp_bias"))
MISTRAL = ArchSpec("mistral", features=_features("sliding_window"))
QWEN2 = ArchSpec("qwen2", qkv_bias=True, features=_features("sliding_window"))
QWEN3 = ArchSpec("qwen3", qk_norm="head", features=_features("attention_bias", "sliding_window"))
PHI3 = ArchSpec(
    "phi3",
    qkv="fused",
    mlp_kind="fused_gated",
    mlp_names=("gate_up_proj", "", "down_proj"),
    features=_features("sliding_window", "partial_rotary"),
)
GEMMA = ArchSpec(
    "gemma", embed_scale=True, norm_offset=1.0, features=_features("attention_bias")
)  # HF's GemmaRMSNorm: (1 + w)
_SANDWICH = dict(
    attn_post_norm="post_attention_layernorm",
    mlp_norm="pre_feedforward_layernorm",
    mlp_post_norm="post_feedforward_layernorm",
)
GEMMA2 = replace(
    GEMMA,
    model_type="gemma2",
    **_SANDWICH,
    features=_features("attention_bias", "sliding_window", "softcapping", "query_pre_attn_scalar"),
)
GEMMA3_TEXT = replace(
    GEMMA2, model_type="gemma3_text", qk_norm="head", features=GEMMA2.features | {"rope_per_layer_type"}
)
GEMMA3 = replace(GEMMA3_TEXT, model_type="gemma3", decoder="model.language_model", text_config=True)
# Gemma 4 (E2B: 35 layers, 4 sliding : 1 full, head_dim 256 / 512 on full layers, the last 20 layers
# reading earlier layers' K/V): Gemma 3's sandwich layer with plain-w norms, unit attention scale,
# weightless value norms, per-layer inputs and a per-layer output scalar
GEMMA4_TEXT = replace(
    GEMMA3_TEXT,
    model_type="gemma4_text",
    norm_offset=0.0,
    attn_scale=1.0,
    v_norm=True,
    per_layer_inputs=("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm"),
    layer_scalar="layer_scalar",
    features=_features(
        "sliding_window",
        "softcapping",
        "rope_per_layer_type",
        "per_layer_inputs",
        "kv_sharing",
        "keys_as_values",
        "double_wide_mlp",
        "per_layer_shapes",
    ),
)
GEMMA4 = replace(GEMMA4_TEXT, model_type="gemma4", decoder="model.language_model", text_config=True)
SMOLLM3 = ArchSpec("smollm3", features=_features("attention_bias", "mlp_bias", "sliding_window", "nope_layers"))
GRANITE = ArchSpec("granite", features=_features("attention_bias", "mlp_bias", "multipliers"))
OLMO2 = ArchSpec(
    "olmo2",
    attn_norm=None,
    attn_post_norm="post_attention_layernorm",
    mlp_norm=None,
    mlp_post_norm="post_feedforward_layernorm",
    qk_norm="full",
    features=_features("attention_bias"),
)
OLMO3 = replace(OLMO2, model_type="olmo3", features=OLMO2.features | {"sliding_window", "rope_per_layer_type"})
EXAONE4 = replace(OLMO2, model_type="exaone4", qk_norm="head", global_nope=True, features=_features("sliding_window"))
LFM2 = ArchSpec(
    "lfm2",
    final_norm="embedding_norm",
    attn_norm="operator_norm",
    mlp_norm="ffn_norm",
    mlp="feed_forward",
    mlp_names=("w1", "w3", "w2"),
    out_proj="out_proj",
    qk_norm="head",
    q_norm="q_layernorm",
    k_norm="k_layernorm",
    activation="silu",
    layer_kinds=(("full_attention", "attention"), ("conv", "conv")),
    features=_features("conv_layers", "conv_bias"),
)
# Granite 4.0-H dense: Mamba2 mixers (layer type "mamba", read as linear_attention) between GQA layers
# without rotary (position_embedding_type unset), Granite's multipliers, a gated shared MLP
GRANITE_HYBRID = ArchSpec(
    "granitemoehybrid",
    mlp="shared_mlp",
    mlp_kind="fused_gated",
    mlp_names=("input_linear", "", "output_linear"),
    layer_kinds=(("full_attention", "attention"), ("linear_attention", "mamba2")),
    rope_switch="position_embedding_type",
    features=_features("attention_bias", "multipliers", "mamba_layers"),
)
# Qwen3.5: Gated DeltaNet mixers with one gated full-attention layer in four (partial rotary, (1 + w) norms)
QWEN3_5_TEXT = ArchSpec(
    "qwen3_5_text",
    qk_norm="head",
    norm_offset=1.0,
    attn_gate=True,
    layer_kinds=(("full_attention", "attention"), ("linear_attention", "gdn")),
    features=_features("partial_rotary", "linear_attention_layers"),
)
QWEN3_5 = replace(  # the VL checkpoint loaded whole: its language model
    QWEN3_5_TEXT, model_type="qwen3_5", decoder="model.language_model", text_config=True
)
# Nemotron-H dense: blocks of one mixer each (Mamba2, GQA without positions, or a relu2 MLP)
NEMOTRON_H = ArchSpec(
    "nemotron_h",
    embed="embeddings",
    final_norm="norm_f",
    attn="mixer",
    mamba="mixer",
    mlp="mixer",
    attn_norm="norm",
    mlp_norm=None,
    mlp_kind="plain",
    mlp_names=("", "up_proj", "down_proj"),
    positions="none",
    block="single",
    experts_by_layer_type=True,
    layer_kinds=(("full_attention", "attention"), ("linear_attention", "mamba2"), ("mlp", "mlp")),
    features=_features("attention_bias", "mlp_bias", "mamba_layers"),
)
# Falcon-H1: every layer runs attention and a Mamba2 mixer in parallel, then a gated MLP; muP
# multipliers on the embedding, attention input / keys / output, the mixer's projections and output,
# the MLP's gate and down projection, and the logits
FALCON_H1 = ArchSpec(
    "falcon_h1",
    final_norm="final_layernorm",
    mlp="feed_forward",
    mlp_norm="pre_ff_layernorm",
    block="parallel",
    layer_kinds=(("hybrid", "hybrid"),),
    features=_features("attention_bias", "mlp_bias", "multipliers", "mamba_layers"),
)
GPT2 = ArchSpec(
    "gpt2",
    decoder="transformer",
    embed="wte",
    layers="h",
    final_norm="ln_f",
    attn="attn",
    attn_norm="ln_1",
    mlp_norm="ln_2",
    qkv="conv1d",
    out_proj="c_proj",
    mlp_kind="module",
    positions="learned",
    position_embed="wpe",
    norm_bias=True,
)

ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (
        LLAMA,
        MISTRAL,
        QWEN2,
        QWEN3,
        PHI3,
        GEMMA,
        GEMMA2,
        GEMMA3_TEXT,
        GEMMA3,
        GEMMA4_TEXT,
        GEMMA4,
        SMOLLM3,
        GRANITE,
        OLMO2,
        OLMO3,
        EXAONE4,
        LFM2,
        GRANITE_HYBRID,
        QWEN3_5_TEXT,
        QWEN3_5,
        NEMOTRON_H,
        FALCON_H1,
        GPT2,
    )
}


def supported_list() -> str:
    return ", ".join(sorted(ARCHITECTURES))


def arch_for(model_type: str) -> ArchSpec:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture {model_type!r} is not supported; supported: {supported_list()}"
        ) from None


def module_at(root, path: str):
    """root.a.b.c for path 'a.b.c'."""
    for part in path.split("."):
        root = getattr(root, part)
    return root
