"""A tiny random-init DFlash drafter for a tiny target, in the layout transformers' DFlash
generator reads (MuseGlimmerAssistantModel), and transformers' own forward of it: the independent
reference of the drafter graph and the dflash proposer."""

from __future__ import annotations

from pathlib import Path

import torch

BLOCK = 4  # rows of a drafter call: the anchor and 3 drafts
MASK = 300  # a token id inside the tiny target's 320 embedding rows
LAYER_IDS = (0, 2)  # outputs of target layers 0 and 2 (of 4)


def tiny_target(seed: int = 0, **overrides):
    """A 4-layer tiny Qwen3 (tied embeddings), so that the drafter reads two inner layers."""
    from tiny import make_model

    return make_model("qwen3", seed=seed, num_hidden_layers=4, tie_word_embeddings=True, **overrides)


def drafter_config(**overrides):
    from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantConfig

    values = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        block_size=BLOCK,
        mask_token_id=MASK,
        target_layer_ids=list(LAYER_IDS),
        layer_types=["full_attention"] * 2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    values.update(overrides)
    return MuseGlimmerAssistantConfig(**values)


def tiny_drafter(folder: Path | None = None, seed: int = 1, **overrides):
    """A random-init drafter whose norms are spread (not all ones), saved to `folder` when given."""
    from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantModel

    torch.manual_seed(seed)
    model = MuseGlimmerAssistantModel(drafter_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "norm_enc" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    if folder is not None:
        model.save_pretrained(folder)
    return model


def hidden_context(target, ids: list[int], layer_ids=LAYER_IDS) -> torch.Tensor:
    """[1, S, len(layer_ids) H]: the outputs of target layers `layer_ids` for every token, as the
    DFlash generator reads them (output_hidden_states[i + 1])."""
    with torch.no_grad():
        out = target(torch.tensor([ids]), output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


class ReferenceDrafter:
    """transformers' drafter forward on its DFlashCache, called as the DFlash generator calls it."""

    def __init__(self, drafter, target):
        from transformers.cache_utils import DFlashCache

        self.drafter, self.target = drafter, target
        self.cache = DFlashCache(config=drafter.config)
        self.length = 0  # context positions in the cache
        self.block = False  # the cache ends with a block's rows

    def block_logits(self, context: torch.Tensor, anchor: int) -> torch.Tensor:
        """context [1, C, F] of positions length .. length+C-1, anchor at length+C -> logits [B-1, V]."""
        C, B = context.shape[1], self.drafter.config.block_size
        if self.block:
            self.cache.crop(-B)
        self.cache.set_previous_accepted_tokens(C)
        noise = torch.tensor([[anchor] + [self.drafter.config.mask_token_id] * (B - 1)])
        positions = torch.arange(self.length, self.length + C + B)[None]
        with torch.no_grad():
            out = self.drafter(
                noise_embeds=self.target.get_input_embeddings()(noise),
                context_hidden_states=context,
                position_ids=positions,
                cache=self.cache,
            )
            logits = self.target.get_output_embeddings()(out.last_hidden_state[:, 1:])
        self.length += C
        self.block = True
        return logits[0]
