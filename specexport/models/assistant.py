"""The Gemma 4 assistant (transformers' `Gemma4AssistantForCausalLM`, config `gemma4_assistant`):
a small decoder that drafts from one position of its target, reading the target's K/V instead
of computing its own (docs/proposers.md, "assistant").

    facts = check_pair(read_assistant_config(folder), target_config, target_norm)  # refusals first
    model = load_assistant(folder)

Per draft step, for the last seen token t at position p (transformers'
SinglePositionMultiTokenCandidateGenerator):

    x = pre_projection(embed_target(t) | h)       # [1, 2 Hb] -> [1, H]; h the target's last
                                                   # hidden row (post final norm), then the
                                                   # assistant's own hidden_out
    x = layers(x) attending over the target's K/V of positions < p: each assistant layer reads
                                                   # the cache of the target's last cache-owning
                                                   # layer of its type; q at position p
    logits = lm_head(norm(x))  (or the centroid-masked head)
    hidden_out = post_projection(norm(x))          # [1, Hb]

The checks here read config.json alone, before any weight: the assistant's backbone width is
the target's hidden size, its vocabulary the target's, and each of its layer types reads a
target cache of the same head_dim and K/V head count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import NormalizedConfig
from .errors import UnsupportedConfig

MODEL_TYPE = "gemma4_assistant"
TARGET_TYPES = ("gemma4_text", "gemma4")  # a text decoder, or the multimodal checkpoint's language model


class AssistantMismatch(UnsupportedConfig):
    """An assistant that does not fit its target (backbone width, vocabulary, K/V layout)."""


def config_file(model: str | Path, revision: str | None = None) -> Path | None:
    """A recipe draft model's config.json: in its folder, or a hub id's (huggingface_hub's cache,
    config.json alone: no weight is fetched to recognise the drafter); None when there is none."""
    local = Path(model) / "config.json"
    if local.is_file():
        return local
    from .sources import resolve_source

    try:
        if resolve_source(str(model), revision=revision).kind != "hub":
            return None
        from huggingface_hub import hf_hub_download

        return Path(hf_hub_download(str(model), "config.json", revision=revision))
    except Exception:  # an unreachable hub or an unknown path: the draft's own loader reports it
        return None


def is_assistant(model: str | Path, revision: str | None = None) -> bool:
    """Whether a recipe draft model (folder or hub id) is a Gemma 4 assistant (its config.json's model_type)."""
    path = config_file(model, revision)
    if path is None:
        return False
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("model_type") == MODEL_TYPE
    except (OSError, ValueError):
        return False


def read_assistant_config(folder: str | Path):
    """The folder's Gemma4AssistantConfig (no weights read)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(folder))
    if config.model_type != MODEL_TYPE:
        raise UnsupportedConfig(f"{folder}: model_type {config.model_type!r} is not {MODEL_TYPE!r}")
    return config


@dataclass(frozen=True)
class AssistantFacts:
    """What the graph and the manifest need of an assistant checked against its target."""

    backbone: int  # Hb: the target's hidden size
    hidden: int  # H: the assistant's
    vocab: int  # V: both models' embedding rows
    layer_types: tuple[str, ...]  # each assistant layer's type
    shared_kv: dict[str, int]  # layer type -> n of the target cache past_key_{n} it reads
    head_dims: dict[str, int]  # layer type -> its head_dim (<= the target cache's D)
    centroids: int  # 0: the full head; else the centroid-masked head's centroids
    top_k: int  # centroids kept per row


def _text(config) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _layer_dims(text) -> tuple[list[int], list[int]]:
    """(head_dim, K/V heads) of each layer of a Gemma 4 text config (its per_layer_config)."""
    per_layer = getattr(text, "per_layer_config", None)
    dims, heads = [], []
    for i in range(text.num_hidden_layers):
        entry = per_layer[i] if per_layer is not None else text
        dims.append(int(getattr(entry, "head_dim", None) or text.head_dim))
        heads.append(int(getattr(entry, "num_key_value_heads", None) or text.num_key_value_heads))
    return dims, heads


def store_layers(text) -> dict[str, int]:
    """Layer type -> the target's last cache-owning layer of that type (transformers'
    kv_sharing_modes "store": what it hands an assistant as shared_kv_states)."""
    first_shared = text.num_hidden_layers - int(getattr(text, "num_kv_shared_layers", 0) or 0)
    out: dict[str, int] = {}
    for i, kind in enumerate(text.layer_types[:first_shared]):
        out[kind] = i
    return out


def check_pair(assistant, target, target_norm: NormalizedConfig, name: str = "assistant") -> AssistantFacts:
    """The assistant's facts, or AssistantMismatch in one line naming the value and what the
    target has. `target`: the target's transformers config; `target_norm`: its normalized config
    (which numbers its caches)."""
    text, ttext = _text(assistant), _text(target)
    if getattr(target, "model_type", None) not in TARGET_TYPES:
        raise AssistantMismatch(
            f"{name}: a Gemma 4 assistant drafts for a Gemma 4 target ({', '.join(TARGET_TYPES)}),"
            f" not {getattr(target, 'model_type', None)!r}"
        )
    if assistant.backbone_hidden_size != ttext.hidden_size:
        raise AssistantMismatch(
            f"{name}: backbone_hidden_size {assistant.backbone_hidden_size} is not the target's hidden_size"
            f" {ttext.hidden_size}"
        )
    if text.vocab_size != ttext.vocab_size:
        raise AssistantMismatch(f"{name}: vocab_size {text.vocab_size} is not the target's {ttext.vocab_size}")
    for key, want in (("hidden_size_per_layer_input", 0), ("enable_moe_block", False), ("use_double_wide_mlp", False)):
        if (getattr(text, key, None) or want) != want:
            raise AssistantMismatch(f"{name}: {key} {getattr(text, key)!r} is not implemented for an assistant")
    stores = store_layers(ttext)
    t_dims, t_heads = _layer_dims(ttext)
    a_dims, a_heads = _layer_dims(text)
    shared, dims = {}, {}
    for i, kind in enumerate(text.layer_types):
        src = stores.get(kind)
        if src is None:
            raise AssistantMismatch(
                f"{name}: layer {i} is {kind!r}, but the target has no {kind!r} layer owning K/V"
                f" (it has {sorted(stores)})"
            )
        if a_dims[i] != t_dims[src] or a_heads[i] != t_heads[src]:
            raise AssistantMismatch(
                f"{name}: layer {i} ({kind}) reads {a_heads[i]} K/V heads x {a_dims[i]}, but the target's layer"
                f" {src} stores {t_heads[src]} x {t_dims[src]}"
            )
        if a_dims[i] > target_norm.head_dim or a_heads[i] != target_norm.kv_heads:
            raise AssistantMismatch(
                f"{name}: layer {i} ({kind}) reads {a_heads[i]} x {a_dims[i]}, but the target's caches hold"
                f" {target_norm.kv_heads} x {target_norm.head_dim}"
            )
        shared[kind], dims[kind] = target_norm.kv_layer(src), a_dims[i]
    centroids = int(assistant.num_centroids) if assistant.use_ordered_embeddings else 0
    if centroids and (text.vocab_size % centroids or not 0 < assistant.centroid_intermediate_top_k <= centroids):
        raise AssistantMismatch(
            f"{name}: {centroids} centroids with top_k {assistant.centroid_intermediate_top_k} do not divide a"
            f" vocabulary of {text.vocab_size}"
        )
    return AssistantFacts(
        ttext.hidden_size,
        text.hidden_size,
        text.vocab_size,
        tuple(text.layer_types),
        shared,
        dims,
        centroids,
        int(assistant.centroid_intermediate_top_k) if centroids else 0,
    )


def load_assistant(folder: str | Path):
    """The assistant in float32, eval mode (transformers' Gemma4AssistantForCausalLM)."""
    import torch
    from transformers import Gemma4AssistantForCausalLM

    model = Gemma4AssistantForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    return model.eval()
