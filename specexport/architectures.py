"""Supported architectures: each is a small declarative difference over the shared decoder.

The shared decoder (decoder.py) runs the HF model's own norms and projections' weights and
does attention, rotary, caching and logits itself. An ArchSpec only says where the pieces live and which
attention variant the family uses. Register a new family in ARCHITECTURES and add it to the
parity test table (tests/build/test_parity.py fails if a registered family has none).
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
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    mlp: str = "mlp"
    mlp_kind: Literal["gated", "fused_gated", "module"] = "gated"
    # gated:       gate_proj/up_proj/down_proj + act_fn (fused here into one gate|up MatMul)
    # fused_gated: gate_up_proj rows [gate | up] + down_proj + activation_fn (Phi-3)
    # module:      HF's own MLP module called as is (GPT-2)
    qkv: Literal["separate", "fused", "conv1d"] = "separate"
    # separate: q_proj/k_proj/v_proj (nn.Linear, bias if the checkpoint has one: Qwen2)
    # fused:    qkv_proj with rows [q | k | v] (Phi-3)
    # conv1d:   c_attn, transformers Conv1D with columns [q | k | v] (GPT-2)
    out_proj: str = "o_proj"
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of q and k before rotary
    positions: Literal["rope", "learned"] = "rope"
    position_embed: str = ""  # learned positions, relative to decoder (GPT-2: wpe)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(hidden_size), in the model dtype
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (offset + w); the fused graph folds it into w
    sliding_window: bool = False  # Mistral: honour config.sliding_window in the mask


LLAMA = ArchSpec("llama")
MISTRAL = replace(LLAMA, model_type="mistral", sliding_window=True)
QWEN2 = replace(LLAMA, model_type="qwen2")  # q/k/v biases live in the HF Linear modules
QWEN3 = replace(LLAMA, model_type="qwen3", qk_norm=True)
PHI3 = replace(LLAMA, model_type="phi3", qkv="fused", mlp_kind="fused_gated")
GEMMA = replace(LLAMA, model_type="gemma", embed_scale=True, norm_offset=1.0)  # HF's GemmaRMSNorm: (1 + w)
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
)

ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec for spec in (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA, GPT2)
}


def arch_for(model_type: str) -> ArchSpec:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise UnsupportedArchitecture(
            f"architecture {model_type!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
