"""The closed lists behind a normalized config (config.py): each config key that changes the
computation names the feature it expresses (FEATURE_OF_KEY; a family implements a set of them,
architectures.ArchSpec.features), the values that mean "not set" (NEUTRAL), the keys read as
shapes or standard settings (SHAPE_KEYS), the keys no module reads or that only derive others
(INERT_KEYS), and the activations the graphs implement. tests/build/test_model_config.py checks
that every key of every family's config class is in one of them.
"""

from __future__ import annotations

from typing import Any

# config key -> the feature it expresses. A family implements a set of features (ArchSpec.features);
# a key whose feature it lacks must be unset (None / its neutral value) or the config is refused.
FEATURE_OF_KEY: dict[str, str] = {
    "sliding_window": "sliding_window",
    "use_sliding_window": "sliding_window",
    "layer_types": "sliding_window",
    "attn_logit_softcapping": "softcapping",
    "final_logit_softcapping": "softcapping",
    "query_pre_attn_scalar": "query_pre_attn_scalar",
    "embedding_multiplier": "multipliers",
    "residual_multiplier": "multipliers",
    "attention_multiplier": "multipliers",
    "logits_scaling": "multipliers",
    "no_rope_layers": "nope_layers",
    "partial_rotary_factor": "partial_rotary",
    "attention_bias": "attention_bias",
    "mlp_bias": "mlp_bias",
    "conv_bias": "conv_bias",
    "full_attn_idxs": "conv_layers",  # LFM2: the attention layers; the others are gated convolutions
    # Gemma 4: a second embedding feeding each layer, the last layers reading earlier layers' K/V,
    # keys reused as values on full-attention layers, twice the MLP width on K/V-sharing layers,
    # per-layer head_dim / K/V heads (transformers' per_layer_config, from global_head_dim)
    "hidden_size_per_layer_input": "per_layer_inputs",
    "num_kv_shared_layers": "kv_sharing",
    "attention_k_eq_v": "keys_as_values",
    "use_double_wide_mlp": "double_wide_mlp",
    "per_layer_config": "per_layer_shapes",
    # implemented by no family: refused whenever set
    "use_bidirectional_attention": "bidirectional_attention",
    "attention_chunk_size": "chunked_attention",
    "clip_qkv": "qkv_clipping",
    "num_experts": "mixture_of_experts",
    "num_local_experts": "mixture_of_experts",
    "n_routed_experts": "mixture_of_experts",
    "moe_intermediate_size": "mixture_of_experts",
    "enable_moe_block": "mixture_of_experts",
    "kv_lora_rank": "latent_attention",
    "q_lora_rank": "latent_attention",
    "use_qk_norm": "qk_norm_flag",
    "qk_layernorm": "qk_norm_flag",
    "parallel_attn": "parallel_residual",
    "use_parallel_residual": "parallel_residual",
    "scale_attn_by_inverse_layer_idx": "inverse_layer_scaling",
    "scale_attn_weights": "unscaled_attention",
    "add_cross_attention": "cross_attention",
    "residual_in_fp32": "fp32_residual",  # Nemotron-H: a float32 residual stream in a half-precision model
}
# values that mean "not set" (besides None)
NEUTRAL: dict[str, tuple] = {
    "use_sliding_window": (False,),
    "embedding_multiplier": (1.0,),
    "residual_multiplier": (1.0,),
    "logits_scaling": (1.0,),
    "partial_rotary_factor": (1.0,),
    "attention_bias": (False,),
    "mlp_bias": (False,),
    "conv_bias": (False,),
    # Gemma 4's "vision": image tokens attend both ways among themselves; text rows stay causal
    "use_bidirectional_attention": (False, "vision"),
    "clip_qkv": (0,),
    "num_experts": (0, 1),
    "num_local_experts": (0, 1),
    "n_routed_experts": (0, 1),
    "use_qk_norm": (False,),
    "qk_layernorm": (False,),
    "parallel_attn": (False,),
    "use_parallel_residual": (False,),
    "scale_attn_by_inverse_layer_idx": (False,),
    "scale_attn_weights": (True,),
    "add_cross_attention": (False,),
    "residual_in_fp32": (False,),
    "hidden_size_per_layer_input": (0,),
    "num_kv_shared_layers": (0,),
    "attention_k_eq_v": (False,),
    "use_double_wide_mlp": (False,),
    "enable_moe_block": (False,),
    "per_layer_config": ({},),
}
# keys read as shapes or standard settings of every family (not features)
SHAPE_KEYS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "n_embd",
        "intermediate_size",
        "n_inner",
        "num_hidden_layers",
        "n_layer",
        "num_attention_heads",
        "n_head",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "hidden_activation",
        "activation_function",
        "max_position_embeddings",
        "n_positions",
        "original_max_position_embeddings",
        "rms_norm_eps",
        "layer_norm_epsilon",
        "tie_word_embeddings",
        "rope_parameters",
        "norm_eps",
        "conv_L_cache",  # LFM2: the conv kernel (its state keeps the last L - 1 inputs)
        # LFM2 derives its MLP width from these (block_auto_adjust_ff_dim; mixers.intermediate)
        "block_multiple_of",
        "block_ffn_dim_multiplier",
        "block_auto_adjust_ff_dim",
        # Qwen3.5: the Gated DeltaNet mixer (mixers.deltanet_spec)
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        # Granite 4.0-H: the shared MLP's width, rotary on or off, the Mamba2 mixer (mixers.mamba_spec)
        "shared_intermediate_size",
        "position_embedding_type",
        "mamba_n_heads",
        "mamba_n_groups",
        "mamba_d_state",
        "mamba_d_head",
        "mamba_d_conv",
        "mamba_expand",
        "mamba_conv_bias",
        "mamba_proj_bias",
        "time_step_limit",
        # Nemotron-H: its Mamba2 mixer under other names, its MLP activation (mixers.mamba_spec)
        "mamba_num_heads",
        "mamba_head_dim",
        "ssm_state_size",
        "n_groups",
        "conv_kernel",
        "expand",
        "use_conv_bias",
        "use_bias",
        "mamba_hidden_act",
        "mlp_hidden_act",
        "layers_block_type",  # Nemotron-H's layer_types (its num_hidden_layers derives from it)
        # Falcon-H1: its Mamba2 mixer and muP multipliers (mixers.mamba_spec, _falcon_mup)
        "mamba_d_ssm",
        "mamba_rms_norm",
        "mamba_norm_before_gate",
        "ssm_in_multiplier",
        "ssm_multipliers",
        "ssm_out_multiplier",
        "attention_in_multiplier",
        "attention_out_multiplier",
        "key_multiplier",
        "mlp_multipliers",
        "lm_head_multiplier",
        "projectors_bias",
        "vocab_size_per_layer_input",  # Gemma 4: rows of the per-layer embedding (read with its width)
    }
)
# keys that only derive the ones above in transformers' config classes, or that no module reads
INERT_KEYS = frozenset(
    {
        "max_window_layers",
        "no_rope_layer_interval",
        "sliding_window_pattern",
        "_sliding_window_pattern",
        "cache_implementation",
        "initializer_range",
        "use_cache",
        "attention_dropout",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "summary_type",
        "summary_use_proj",
        "summary_activation",
        "summary_proj_to_labels",
        "summary_first_dropout",
        "pretraining_tp",
        "reorder_and_upcast_attn",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "mamba_chunk_size",  # the reference's scan chunk: the same sums in another grouping
        # routing settings, read only with experts (num_local_experts > 0 is refused)
        "num_experts_per_tok",
        "top_k_experts",
        "output_router_logits",
        "router_aux_loss_coef",
        # Nemotron-H: initialisation, kernel choice, the cache dtype (states are float32 here), and
        # the expert / MTP settings, read only by its refused "moe" layers and its MTP layers
        "time_step_min",
        "time_step_max",
        "time_step_floor",
        "rescale_prenorm_residual",
        "use_mamba_kernels",
        "mamba_ssm_cache_dtype",
        "num_logits_to_keep",
        "chunk_size",
        "n_shared_experts",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_overlap",
        "moe_latent_size",
        "routed_scaling_factor",
        "n_group",
        "topk_group",
        "norm_topk_prob",
        "num_nextn_predict_layers",
        "mtp_layers_block_type",
        "hidden_dropout",
    }
)
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_new", "gelu", "relu2")


def is_set(key: str, value: Any) -> bool:
    """Whether a feature key holds a value that changes the computation (not None or neutral)."""
    if value is None or value in NEUTRAL.get(key, ()):
        return False
    if key == "layer_types":  # sliding layers are the feature; other kinds are the family's (layer_kinds)
        return any(t == "sliding_attention" for t in value)
    if key == "no_rope_layers":
        return not all(value)
    return True
