"""GGUF metadata of the recurrent hybrids read back into transformers config keys, for
formats/gguf_config.py's table: the Mamba2 mixer's ssm.* keys (granitehybrid, falcon-h1,
nemotron_h) and Qwen3.5's Gated DeltaNet (qwen35), as llama.cpp's converter writes them
(convert_hf_to_gguf: Mamba2Model, NemotronHModel, Qwen3NextModel and its value-head reorder).

    qwen35      ssm.conv_kernel      linear_conv_kernel_dim
                ssm.state_size       linear_key_head_dim
                ssm.group_count      linear_num_key_heads
                ssm.time_step_rank   linear_num_value_heads
                ssm.inner_size       linear_value_head_dim x linear_num_value_heads
                attention.recurrent_layers (or full_attention_interval)   layer_types
    nemotron_h  attention.head_count_kv [per layer], feed_forward_length [per layer]: a block with
                KV heads attends, one with an MLP width is an MLP, the others are Mamba2 (as
                llama.cpp decides); ssm.* as for every Mamba2 mixer, under Nemotron-H's names

Every function takes the file's Meta (gguf_config.Meta: `get`, `need`, `arch`, `reader`) and the
config dict built so far, and reads the header only.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .blocks import FormatError
from .gguf import value_head_order


def mamba2(meta: Any, cfg: dict) -> dict:
    """The Mamba2 mixer's shapes from llama.cpp's ssm.* keys (converter: inner_size = heads x
    head_dim, time_step_rank = heads); conv / in_proj biases and the gated norm by tensor presence."""
    inner, heads = int(meta.need("ssm.inner_size")), int(meta.need("ssm.time_step_rank"))
    if heads < 1 or inner % heads:
        raise FormatError(f"GGUF {meta.arch}.ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {heads}")
    names = {t.name for t in meta.reader.tensors}
    return {
        "mamba_n_heads": heads,
        "mamba_d_head": inner // heads,
        "mamba_d_state": int(meta.need("ssm.state_size")),
        "mamba_n_groups": int(meta.get("ssm.group_count", 1)),
        "mamba_d_conv": int(meta.need("ssm.conv_kernel")),
        "mamba_conv_bias": any(n.endswith(".ssm_conv1d.bias") for n in names),
        "mamba_proj_bias": any(n.endswith(".ssm_in.bias") for n in names),
    }


def _per_layer(meta: Any, key: str) -> list[int]:
    """A per-layer count (0 where the layer lacks the part), refused when the file holds one count."""
    value = meta.get(key)
    if not isinstance(value, list):
        raise FormatError(
            f"GGUF {meta.arch}.{key} must hold one count per layer (0: a layer without it), got {value!r}"
        )
    return [int(v) for v in value]


def qwen35(meta: Any, cfg: dict) -> dict:
    """Qwen3.5: Gated DeltaNet layers (attention.recurrent_layers, else all but every
    full_attention_interval-th layer) of ssm.group_count key heads x ssm.state_size and
    ssm.time_step_rank value heads of ssm.inner_size / heads; rope.dimension_count rotates part of
    each head (the sections of its interleaved M-RoPE coincide for text positions)."""
    n = cfg["num_hidden_layers"]
    recurrent = meta.get("attention.recurrent_layers")  # trailing MTP blocks included: cut at n
    if recurrent is None:
        interval = int(meta.get("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n)]
    value_heads, inner = int(meta.need("ssm.time_step_rank")), int(meta.need("ssm.inner_size"))
    if value_heads < 1 or inner % value_heads:
        raise FormatError(f"GGUF qwen35.ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {value_heads}")
    rotary = int(meta.get("rope.dimension_count", cfg["head_dim"]))
    return {
        "layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:n]],
        "linear_num_key_heads": int(meta.need("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": int(meta.need("ssm.state_size")),
        "linear_value_head_dim": inner // value_heads,
        "linear_conv_kernel_dim": int(meta.need("ssm.conv_kernel")),
        "rope_parameters": {**cfg["rope_parameters"], "partial_rotary_factor": rotary / cfg["head_dim"]},
    }


def qwen35_heads(cfg: dict) -> dict[str, tuple[int, np.ndarray]]:
    """{layer tensor kind: (axis, perm)} of the axes the converter tiled by value head (HF index r
    is GGUF index perm[r]): attn_qkv's v rows after q | k and the conv's v channels (same layout),
    attn_gate (in_proj_z) rows, ssm_alpha / ssm_beta rows and A / dt_bias (one entry a head), and
    ssm_out's inputs. None when key and value heads are as many (the converter keeps the order)."""
    kh, vh = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    if kh == vh:
        return {}
    v = value_head_order(kh, vh, cfg["linear_value_head_dim"])
    qk = 2 * kh * cfg["linear_key_head_dim"]
    qkv = np.concatenate([np.arange(qk), qk + v])
    per_head = value_head_order(kh, vh, 1)
    return {
        "attn_qkv": (0, qkv),
        "ssm_conv1d": (0, qkv),
        "attn_gate": (0, v),
        "ssm_out": (1, v),
        **{kind: (0, per_head) for kind in ("ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt")},
    }


def nemotron_h(meta: Any, cfg: dict) -> dict:
    """Nemotron-H: its block kinds from the per-layer counts, the MLP width, the Mamba2 shapes under
    Nemotron-H's names, the relu2 MLP llama.cpp computes; experts (nemotron_h_moe's) are refused."""
    if int(meta.get("expert_count", 0) or 0) > 0:
        raise FormatError("GGUF nemotron_h file has experts (expert_count > 0); only dense Nemotron-H is supported")
    kv, ff = _per_layer(meta, "attention.head_count_kv"), _per_layer(meta, "feed_forward_length")
    if len(kv) != len(ff) or len(kv) != cfg["num_hidden_layers"]:
        raise FormatError(
            f"GGUF nemotron_h.attention.head_count_kv ({len(kv)}) and feed_forward_length ({len(ff)})"
            f" must hold one count for each of the {cfg['num_hidden_layers']} blocks"
        )
    mamba = mamba2(meta, cfg)
    names = {t.name for t in meta.reader.tensors}
    return {
        "layers_block_type": ["full_attention" if a else "mlp" if f else "linear_attention" for a, f in zip(kv, ff)],
        "mamba_num_heads": mamba["mamba_n_heads"],
        "mamba_head_dim": mamba["mamba_d_head"],
        "ssm_state_size": mamba["mamba_d_state"],
        "n_groups": mamba["mamba_n_groups"],
        "conv_kernel": mamba["mamba_d_conv"],
        "use_conv_bias": mamba["mamba_conv_bias"],
        "use_bias": mamba["mamba_proj_bias"],
        "layer_norm_epsilon": cfg["rms_norm_eps"],
        "mlp_hidden_act": "relu2",
        "mlp_bias": any(n.endswith(".ffn_up.bias") for n in names),
        "n_routed_experts": 0,
    }
