"""The plan's drafters that read the target: a Gemma 4 assistant (recipe `draft: {model: PATH}`
whose config.json says `gemma4_assistant`; build/assistant.py) and the target checkpoint's own MTP
layer (`draft: {mtp: {}}`; build/mtp.py). Each is one ModelEstimate beside the target's.

Gemma 4 assistant (graphs/assistant.py writes, float32; Hb the target's hidden size, H the
assistant's, V the vocabulary, Hq query heads, Dt a layer's head_dim, I its MLP width):
  weights   V Hb          a copy of the target's embedding (each draft step embeds its token with it)
            2 Hb H        pre_projection;  H Hb  post_projection
            per layer     H Hq Dt (q) + Hq Dt H (o) + Dt (q norm) + 4 H (norms) + 3 H I (MLP);
                          no k / v projections: every layer reads a target cache
            H             final norm;  V H  lm_head (tied to its own embedding: stored once)
            C H           the centroid head's centroids (use_ordered_embeddings), and its
                          token ordering [V] int64 (8 bytes a token)
  K/V       none: each layer reads the target's last cache-owning layer of its type, read-only
  work      one call of R = max_gamma + 1 rows (a round's drafts) over T = max_context cache rows:
            scores and probabilities 2 Hq R T, the sliced K/V 4 Hkv T D, MLP 3 R I, logits 2 R V
            (all x 4 bytes); host buffers [R, V] logits and [R, Hb] hidden rows (assistant.AssistantModel)

MTP layer (graphs/mtp.py, float32): one full-attention decoder layer of the target's family with
its own K/V cache, its final norm, the target's embedding table copied into its graph (the head
reads it when the target's head is tied), fc [H, 2H] and two pre-fc norms [H]:
  weights   (parameters of a 1-layer copy of the target + 2 H H + 2 H) x 4
  K/V       2 x 1 layer x max_context x kv_heads x head_dim x 4 (the graph's own cache, float32)
  work      as a decoder's (sizes.activation_bytes of the 1-layer copy); host logits [64, V]
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..models.config import LayerSpec, NormalizedConfig
from ..models.mixers import ATTENTION
from ..recipe.spec import ModelSpec
from .known import KNOWN_ASSISTANTS
from .report import ModelEstimate, gib
from .sizes import CALL_ROWS, activation_bytes, kv_bytes, parameters

ASSISTANT_TYPE = "gemma4_assistant"  # models/assistant.MODEL_TYPE
FULL = "full_attention"


def assistant_config(spec: ModelSpec) -> tuple[Any, str] | None:
    """(transformers Gemma4AssistantConfig, where it came from) when the draft model is a Gemma 4
    assistant: a local folder whose config.json says so, else a known assistant by its hub id or
    by the folder's name (known.KNOWN_ASSISTANTS: the folder a recipe downloads it to, absent at
    plan time); None for any other draft model."""
    path = Path(spec.model).expanduser()
    if (path / "config.json").is_file():
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
        if data.get("model_type") != ASSISTANT_TYPE:
            return None
        source = f"{path}/config.json"
    else:
        key = next((k for k in KNOWN_ASSISTANTS if spec.model == k or path.name.lower() == k.split("/")[-1]), None)
        if key is None:
            return None
        data, source = KNOWN_ASSISTANTS[key], f"known config of {key} (assumed shapes)"
    from transformers import AutoConfig

    rest = {k: v for k, v in data.items() if k != "model_type"}
    return AutoConfig.for_model(ASSISTANT_TYPE, **rest), source


def _head_dims(text) -> list[int]:
    """Each assistant layer's head_dim (a full layer's comes from its per_layer_config)."""
    per_layer = getattr(text, "per_layer_config", None)
    dims = []
    for i in range(text.num_hidden_layers):
        entry = per_layer[i] if per_layer is not None else text
        dims.append(int(getattr(entry, "head_dim", None) or text.head_dim))
    return dims


def assistant_parameters(config) -> int:
    """The assistant's own parameters as the graph stores them (the docstring's list, without
    the target's embedding copy or the token ordering)."""
    t = config.get_text_config()
    H, Hb, V, Hq, M = (
        t.hidden_size,
        config.backbone_hidden_size,
        t.vocab_size,
        t.num_attention_heads,
        t.intermediate_size,
    )
    layers = sum(2 * H * Hq * d + d + 4 * H + 3 * H * M for d in _head_dims(t))
    centroids = config.num_centroids * H if config.use_ordered_embeddings else 0
    return 2 * Hb * H + layers + H + H * Hb + V * H + centroids


def assistant_weight_bytes(config) -> int:
    """Bytes of the assistant graph's weights: its own parameters and the target's embedding
    copy in float32, and the centroid head's int64 token ordering."""
    t = config.get_text_config()
    ordering = 8 * t.vocab_size if config.use_ordered_embeddings else 0
    return 4 * (assistant_parameters(config) + t.vocab_size * config.backbone_hidden_size) + ordering


def _assistant_layers(config, target: NormalizedConfig) -> tuple[LayerSpec, ...]:
    """The assistant's layers as LayerSpecs reading (kv_source) the target's last cache-owning
    layer of their kind: none owns a cache."""
    t = config.get_text_config()
    out = []
    for kind, d in zip(t.layer_types, _head_dims(t)):
        full = kind == FULL
        owners = [i for i in target.attention_layers if (target.layers[i].window is None) == full]
        src = owners[-1] if owners else 0
        window = None if full else int(t.sliding_window)
        out.append(LayerSpec(window, target.layers[src].rope, ATTENTION, head_dim=d, kv_source=src))
    return tuple(out)


def assistant_estimate(
    spec: ModelSpec, config, source: str, target: NormalizedConfig, max_context: int, max_gamma: int
) -> ModelEstimate:
    t = config.get_text_config()
    dims = _head_dims(t)
    shape = replace(
        target,
        family=ASSISTANT_TYPE,
        layers=_assistant_layers(config, target),
        hidden=t.hidden_size,
        intermediate=t.intermediate_size,
        heads=t.num_attention_heads,
        head_dim=max(dims),
        vocab=t.vocab_size,
        per_layer_input=0,
        per_layer_vocab=0,
        double_wide_mlp=False,
        values_from_keys=(),
    )
    R, T, V, Hq, Hkv = max_gamma + 1, max_context, t.vocab_size, t.num_attention_heads, t.num_key_value_heads
    work = 4 * (2 * Hq * R * T + 4 * Hkv * T * target.head_dim + 3 * R * t.intermediate_size + 2 * R * V)
    return ModelEstimate(
        role="draft",
        model=f"{spec.model} (Gemma 4 assistant)",
        precision="fp32",
        config=shape,
        config_source=source,
        parameters=assistant_parameters(config),
        weight_bytes=assistant_weight_bytes(config),
        kv_bytes=0,
        activation_bytes=work,
        logits_buffer_bytes=R * (V + config.backbone_hidden_size) * 4,
    )


def mtp_shape(target: NormalizedConfig) -> NormalizedConfig:
    """A 1-layer copy of the target whose layer is its full-attention kind (the MTP layer)."""
    full = [i for i in target.attention_layers if target.layers[i].window is None] or list(target.attention_layers)
    return replace(target, layers=(target.layers[full[-1]],), deltanet=None, mamba=None)


def mtp_weight_bytes(target: NormalizedConfig) -> int:
    H = target.hidden
    return 4 * (parameters(mtp_shape(target)) + 2 * H * H + 2 * H)


def mtp_estimate(target_model: str, target: NormalizedConfig, max_context: int, max_prompt: int, max_gamma: int):
    shape = mtp_shape(target)
    H = target.hidden
    return ModelEstimate(
        role="draft",
        model=f"{target_model} (MTP layer)",
        precision="fp32",
        config=shape,
        config_source="target shape",
        parameters=parameters(shape) - target.vocab * H * (1 if target.tied else 2) + 2 * H * H + 2 * H,
        weight_bytes=mtp_weight_bytes(target),
        kv_bytes=kv_bytes(shape, "fp32", max_context),
        activation_bytes=activation_bytes(shape, "fp32", max_context, max_prompt, max_gamma),
        logits_buffer_bytes=CALL_ROWS * target.vocab * 4,
    )


def drafter_notes(draft: ModelEstimate, target: NormalizedConfig) -> list[str]:
    """What the report says of a drafter reading the target."""
    copy = target.vocab * target.hidden * 4
    if draft.config.family == ASSISTANT_TYPE:
        reads = sorted({layer.kv_source for layer in draft.config.layers})
        return [
            f"the Gemma 4 assistant owns no K/V cache: its {draft.config.num_layers} layers read target layers"
            f" {', '.join(map(str, reads))}'s caches; its graph holds a float32 copy of the target's embedding"
            f" ({gib(copy)} of its {gib(draft.weight_bytes)})"
        ]
    return [
        f"the MTP layer keeps its own K/V cache (1 layer, {gib(draft.kv_bytes)}); its graph holds a float32 copy"
        f" of the target's embedding ({gib(copy)} of its {gib(draft.weight_bytes)})"
    ]
