"""Tiny random-init Gemma 4 assistants for tests, shaped to tests/tiny.py's `gemma4_text` target
(hidden 64, vocabulary 320, one K/V head, head_dim 16 on sliding layers and 32 on full ones)."""

from __future__ import annotations

from pathlib import Path

import torch
from tiny import TINY_CONFIGS

# the assistant's own text config: two layers reading the target's sliding and full caches, a
# window shorter than the tests' prompts (8: a sliding layer reads the last 9 cache rows)
ASSISTANT_TEXT = dict(
    TINY_CONFIGS["gemma4_text"],
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=8,
    hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=0,
    use_double_wide_mlp=False,
    final_logit_softcapping=None,
)
ASSISTANT_TEXT.pop("num_kv_shared_layers")  # the assistant config shares every layer


def make_assistant(seed: int = 0, centroids: bool = True, backbone: int = 64, **text_overrides):
    """A random-init Gemma4AssistantForCausalLM; with `centroids`, the centroid-masked head (16
    centroids of 20 tokens, top 4) over a random token ordering. Norm weights spread as tiny.py does
    for Gemma 4 (its init of ones would hide a graph ignoring them)."""
    from tiny import _spread_scales
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    text = Gemma4TextConfig(**{**ASSISTANT_TEXT, **text_overrides})
    config = Gemma4AssistantConfig(
        text_config=text,
        backbone_hidden_size=backbone,
        use_ordered_embeddings=centroids,
        num_centroids=16,
        centroid_intermediate_top_k=4,
    )
    model = Gemma4AssistantForCausalLM(config).eval()
    _spread_scales(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("pre_projection.weight", "post_projection.weight")):
                p.normal_(0.0, 0.2)
        if centroids:
            model.masked_embedding.token_ordering.copy_(torch.randperm(text.vocab_size))
    return model


def save_assistant(model, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder
