"""Model sizes for `specexport plan`: parameters, weight, KV-cache, recurrent-state and working-memory
bytes of a model's normalized config (models.config.NormalizedConfig). The bundled recipes' models'
configs are in known.py, so that a plan needs no download. The formulas are in estimate.py's docstring.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from specexport_runtime.recurrent import MAX_CALL_ROWS

from ..errors import SpecExportError
from ..models.config import LayerSpec, NormalizedConfig, config_from_dict, normalize, read_config
from ..models.mixers import ATTENTION, CONV, GDN, HYBRID, MAMBA2, MLP
from ..recipe.spec import QUANTIZED_TARGETS, ModelSpec, QuantizationSpec
from .known import KNOWN_CONFIGS

MATMULNBITS_BLOCK = 32


class PlanError(SpecExportError, ValueError):
    """A model's shape is unknown, or plan arguments are out of range."""


def known_config(model: str, max_context: int | None = None) -> NormalizedConfig:
    return normalize(config_from_dict(KNOWN_CONFIGS[model]), max_context)


def model_config(
    spec: ModelSpec, max_context: int | None = None, known: dict[str, dict[str, Any]] | None = None
) -> tuple[NormalizedConfig, str]:
    """(normalized config, where it came from) of a recipe's model: the known table (hub ids of the
    bundled recipes, builtin models; `known` adds config.json dicts), a local folder's
    config.json, or a local GGUF file's metadata. What build would refuse is refused here too."""
    table = {**KNOWN_CONFIGS, **(known or {})}
    if spec.model in table:
        return normalize(config_from_dict(table[spec.model]), max_context), "known config"
    path = Path(spec.model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        data = json.loads((path / "config.json").read_text(encoding="utf-8"))
        return normalize(config_from_dict(data), max_context), f"{path}/config.json"
    gguf = path if path.suffix.lower() == ".gguf" else (path / spec.gguf_file if spec.gguf_file else None)
    if gguf is not None and gguf.is_file():
        return normalize(read_config(str(gguf.parent), gguf_file=gguf.name), max_context), str(gguf)
    raise PlanError(
        f"cannot size model {spec.model!r}: it is not in the known table ({len(KNOWN_CONFIGS)} models of the bundled"
        " recipes) and is not a local folder with config.json or a local .gguf file; download it (or its config.json)"
        " and give the folder"
    )


# --------------------------------------------------------------------------- parameters


def _attention_linear(c: NormalizedConfig, i: int) -> int:
    """Attention layer i's q|k|v and o weights at its own head_dim; a layer reading another's K/V
    has q and o only, a keys-as-values layer no v (Gemma 4)."""
    d = c.layer_head_dim(i)
    q, kv = c.heads * d, c.kv_heads * d
    gate = c.hidden * q if c.arch.attn_gate else 0  # Qwen3.5: q_proj holds a gate per head too
    kv_projections = 0 if c.layers[i].kv_source is not None else (1 if i in c.values_from_keys else 2)
    return c.hidden * q + kv_projections * c.hidden * kv + q * c.hidden + gate


def layer_intermediate(c: NormalizedConfig, i: int) -> int:
    """Layer i's MLP width (Gemma 4's double-wide MLP on the layers reading another's K/V)."""
    return c.intermediate * (2 if c.double_wide_mlp and c.layers[i].kv_source is not None else 1)


def linear_parameters(c: NormalizedConfig) -> int:
    """Parameters of the decoder layers' MatMul weights (what the quantizers rewrite): attention
    layers' q|k|v and o, conv layers' in_proj [3 C, C] and out_proj [C, C], every layer's MLP;
    Gemma 4's per-layer gate [P, hidden] and projection [hidden, P] and the per-layer model
    projection [L P, hidden]."""
    mixers = {CONV: 4 * c.hidden * c.hidden}
    if c.deltanet is not None:  # in_proj_qkv | z | b | a, out_proj
        d = c.deltanet
        vd = d.value_heads * d.value_dim
        mixers[GDN] = c.hidden * (d.conv_dim + vd + 2 * d.value_heads) + vd * c.hidden
    if c.mamba is not None:  # in_proj [I + conv_dim + H, hidden], out_proj [hidden, I]
        m = c.mamba
        mixers[MAMBA2] = c.hidden * (m.inner + m.conv_dim + m.heads) + m.inner * c.hidden
    gates = 2 if c.arch.mlp_kind in ("module", "plain") else 3

    def mixer(i: int) -> int:
        kind = c.layers[i].kind
        if kind == ATTENTION:
            return _attention_linear(c, i)
        if kind == HYBRID:  # Falcon-H1: attention and Mamba2 side by side
            return _attention_linear(c, i) + mixers[MAMBA2]
        return mixers[kind]

    per_layer = 2 * c.hidden * c.per_layer_input  # Gemma 4: each layer's gate and projection
    model_projection = c.hidden * c.num_layers * c.per_layer_input
    if c.arch.block == "single":  # Nemotron-H: a block is one mixer or the MLP
        mlp = gates * c.hidden * c.intermediate
        return sum(mlp if layer.kind == MLP else mixer(i) for i, layer in enumerate(c.layers))
    return model_projection + sum(
        mixer(i) + gates * c.hidden * layer_intermediate(c, i) + per_layer for i in range(c.num_layers)
    )


def _attention_small(c: NormalizedConfig, i: int) -> int:
    """Attention layer i's q/k norms and biases at its own head_dim (a layer reading another's K/V
    has no k norm or k/v biases; Gemma 4's value norm has no weight)."""
    d = c.layer_head_dim(i)
    q, kv = c.heads * d, c.kv_heads * d
    own = c.layers[i].kv_source is None
    norms = {"": 0, "head": (2 if own else 1) * d, "full": q + (kv if own else 0)}[c.arch.qk_norm]
    kv_projections = 0 if not own else (1 if i in c.values_from_keys else 2)
    biases = (q + kv_projections * kv if c.qkv_bias else 0) + (c.hidden if c.out_bias else 0)
    return norms + biases


def small_parameters(c: NormalizedConfig) -> int:
    """Norm weights (and LayerNorm biases), q/k norms, biases and learned positions; Gemma 4's
    per-layer input norms (hidden per layer) and per-layer projection norm (P)."""
    a = c.arch
    norm = c.hidden * (2 if a.norm_bias else 1)
    layer = a.norms_per_layer * norm + (c.hidden if c.per_layer_input else 0)
    mlp_bias = (c.intermediate if a.mlp_kind in ("module", "plain") else 2 * c.intermediate) + c.hidden
    if c.mlp_bias and a.block == "pair":
        layer += mlp_bias
    mixers = {CONV: c.hidden * c.conv_kernel + (5 * c.hidden if c.conv_bias else 0)}
    if c.mamba is not None:  # conv kernel (+ bias), dt_bias, A_log, D, the gated norm (+ projection biases)
        m = c.mamba
        norm_w = m.inner if m.norm != "gate" else 0  # Falcon-H1 without mamba_rms_norm has no output norm
        mixers[MAMBA2] = m.conv_dim * m.conv_kernel + (m.conv_dim if m.conv_bias else 0) + 3 * m.heads + norm_w
        mixers[MAMBA2] += (m.inner + m.conv_dim + m.heads + c.hidden) if m.proj_bias else 0
    if c.deltanet is not None:  # conv kernel, dt_bias, A_log, the gated norm over dv
        d = c.deltanet
        mixers[GDN] = d.conv_dim * d.conv_kernel + 2 * d.value_heads + d.value_dim
    mixers[MLP] = mlp_bias if c.mlp_bias else 0

    def mixer(i: int) -> int:
        kind = c.layers[i].kind
        if kind == ATTENTION:
            return _attention_small(c, i)
        if kind == HYBRID:
            return _attention_small(c, i) + mixers[MAMBA2]
        return mixers[kind]

    positions = c.max_positions * c.hidden if a.positions == "learned" else 0
    per_layer_norm = c.per_layer_input  # Gemma 4: per_layer_projection_norm [P]
    return c.num_layers * layer + sum(mixer(i) for i in range(c.num_layers)) + norm + positions + per_layer_norm


def per_layer_table_parameters(c: NormalizedConfig) -> int:
    """Gemma 4's per-layer embedding [V_pl, L P]: a float Gather table in every precision (the
    quantizers rewrite MatMuls only); 0 without per-layer inputs."""
    return c.per_layer_vocab * c.num_layers * c.per_layer_input


def buffer_parameters(c: NormalizedConfig) -> int:
    """Persistent buffers the checkpoint holds beside its parameters: Gemma 4's layer_scalar [1]
    per layer (a constant of the graph, not in transformers' model.parameters())."""
    return c.num_layers if c.arch.layer_scalar else 0


def embedding_parameters(c: NormalizedConfig) -> int:
    return c.vocab * c.hidden


def parameters(c: NormalizedConfig) -> int:
    """Parameters of the model as published (tied embeddings counted once)."""
    head = 0 if c.tied else embedding_parameters(c)
    body = linear_parameters(c) + small_parameters(c) + per_layer_table_parameters(c)
    return body + embedding_parameters(c) + head


# --------------------------------------------------------------------------- bytes


_QUANT_BYTES = {"int8": 1 + 4 / MATMULNBITS_BLOCK, "int4": 0.5 + 4 / MATMULNBITS_BLOCK, "dynamic-int8": 1.0}
_FLOAT_BYTES = {"fp32": 4, "fp16": 2}
PRECISION_BYTES = {**_FLOAT_BYTES, **_QUANT_BYTES}


def _per_param(mode: str, precision: str, q: QuantizationSpec) -> float:
    """Bytes per parameter of a quantized target's tensor stored as `mode` (plan.py's docstring)."""
    f = 2 if q.dtype == "fp16" else 4
    block = q.block_size or MATMULNBITS_BLOCK
    if mode == "checkpoint":
        mode = {"gguf": "gguf", "int8": "int8", "int4": "int4"}.get(precision, "fp32")  # gptq / awq: float
    return {
        "fp32": float(f),
        "int8": 1 + f / block,
        "int4": 0.5 + f / block,
        "gguf": 0.5 + 2 * f / 32,
        "gptq": 0.5 + (f + 0.5) / 32,
        "awq": 0.5 + (f + 0.5) / 32,
    }[mode]


def quantized_target_bytes(c: NormalizedConfig, precision: str, q: QuantizationSpec) -> int:
    """Weight bytes of a quantized target: layers, head and embedding as `q` stores them."""
    layers = linear_parameters(c) * _per_param(precision, precision, q)
    embedding = embedding_parameters(c) * _per_param(q.embedding, precision, q)
    head = embedding_parameters(c) * _per_param(q.head, precision, q)
    if c.tied and q.head in ("fp32", "checkpoint") and q.embedding == q.head:
        head = 0  # one float table serves both (the graph's Gemm on the embedding)
    floats = small_parameters(c) + per_layer_table_parameters(c) + buffer_parameters(c)  # Gemma 4's table: a Gather
    norms = floats * (2 if q.dtype == "fp16" else 4)
    return int(layers + embedding + head + norms)


def weight_bytes(c: NormalizedConfig, precision: str, quantization: QuantizationSpec | None = None) -> int:
    if precision in QUANTIZED_TARGETS and quantization is not None:
        return quantized_target_bytes(c, precision, quantization)
    if precision in _FLOAT_BYTES:
        return (parameters(c) + buffer_parameters(c)) * _FLOAT_BYTES[precision]
    if precision in _QUANT_BYTES:
        quantized = linear_parameters(c) + embedding_parameters(c)  # untied output projection
        # the embedding, norms and Gemma 4's per-layer table (a Gather) stay fp32
        floats = embedding_parameters(c) + small_parameters(c) + per_layer_table_parameters(c) + buffer_parameters(c)
        return int(quantized * _QUANT_BYTES[precision]) + 4 * floats
    raise PlanError(f"precision {precision!r} is not one of {', '.join(PRECISION_BYTES)}")


def kv_dtype_bytes(precision: str, quantization: QuantizationSpec | None = None) -> int:
    return 2 if precision == "fp16" or (quantization is not None and quantization.dtype == "fp16") else 4


def kv_bytes(
    c: NormalizedConfig, precision: str, max_context: int, quantization: QuantizationSpec | None = None
) -> int:
    """Both caches of every cache-owning attention layer (c.attention_layers: not the layers reading
    another's K/V) at max_context rows and the caches' one head width c.head_dim (the widest layer's;
    narrower layers pad to it), windowed layers included. A hybrid's recurrent states are state_bytes."""
    b = kv_dtype_bytes(precision, quantization)
    return 2 * len(c.attention_layers) * max_context * c.kv_heads * c.head_dim * b


CALL_ROWS = 64  # engine.OrtModel max_rows: the rows one call binds (its host logits buffer)


def state_positions(max_gamma: int) -> int:
    """States a runtime holds per sequence (recurrent.StateHistory as loading opens a recurrent
    model: max_rows R = 1 + max_gamma, at least 2 for a padded target): a ring of R + 1 kept
    positions plus R slots for one call's outputs, and the zeros state."""
    rows = max(max_gamma + 1, 2)
    return (rows + 1) + rows + 1


def state_bytes(c: NormalizedConfig, positions: int) -> int:
    """A hybrid's recurrent states (feature recurrent_state, float32 in every precision): every state
    tensor (NormalizedConfig.state_shapes) at `positions` kept positions (state_positions); 0
    without recurrent layers."""
    return positions * state_position_bytes(c)


def state_position_bytes(c: NormalizedConfig) -> int:
    """Bytes of one position's recurrent state (every state tensor once, float32)."""
    return sum(math.prod(shape) for shape in c.state_shapes) * 4


def window_saving_bytes(
    c: NormalizedConfig, precision: str, max_context: int, quantization: QuantizationSpec | None = None
) -> int:
    """What a ring-buffer cache would save on the cache-owning sliding-window layers (these graphs
    keep max_context rows on every cache)."""
    windows = (c.layers[i].window for i in c.attention_layers)
    rows = sum(max_context - w for w in windows if w is not None and w < max_context)
    return 2 * rows * c.kv_heads * c.head_dim * kv_dtype_bytes(precision, quantization)


def kv_sharing_saving_bytes(
    c: NormalizedConfig, precision: str, max_context: int, quantization: QuantizationSpec | None = None
) -> int:
    """What the layers reading an earlier layer's K/V (Gemma 4 num_kv_shared_layers) save: the
    caches they would own at the caches' width; 0 without such layers."""
    shared = sum(layer.kv_source is not None for layer in c.layers)
    return 2 * shared * max_context * c.kv_heads * c.head_dim * kv_dtype_bytes(precision, quantization)


def head_padding_bytes(
    c: NormalizedConfig, precision: str, max_context: int, quantization: QuantizationSpec | None = None
) -> int:
    """The zeros in the caches of layers narrower than the widest (Gemma 4's 256-wide sliding
    layers in 512-wide caches: each pads its heads to c.head_dim); part of kv_bytes."""
    dims = sum(c.head_dim - c.layer_head_dim(i) for i in c.attention_layers)
    return 2 * dims * max_context * c.kv_heads * kv_dtype_bytes(precision, quantization)


def call_bytes(
    c: NormalizedConfig,
    precision: str,
    seq: int,
    total: int,
    rows: int,
    quantization: QuantizationSpec | None = None,
    flash: bool = False,
) -> int:
    """Working memory of one call with `seq` new tokens attending over `total` positions
    (flash: fused attention that never materializes the scores)."""
    b = kv_dtype_bytes(precision, quantization)
    scores = 0 if flash else 2 * c.heads * seq * total * b
    mlp = 3 * seq * max(layer_intermediate(c, i) for i in range(c.num_layers)) * b
    per_layer = 2 * seq * c.num_layers * c.per_layer_input * b  # Gemma 4: the [S, L, P] inputs and a copy
    hidden = 4 * seq * c.hidden * b
    kv_repeat = 2 * c.heads * total * c.head_dim * b
    logits = rows * c.vocab * 4
    return scores + mlp + per_layer + hidden + kv_repeat + logits + scan_bytes(c, seq)


def scan_bytes(c: NormalizedConfig, seq: int) -> int:
    """A recurrent layer's chunk-form intermediates in one call of `seq` rows: a [heads, S, S]
    float32 decay / attention matrix per scan head (Mamba2, Gated DeltaNet); 0 for other layers."""
    heads = max(c.mamba.heads if c.mamba else 0, c.deltanet.value_heads if c.deltanet else 0)
    return heads * seq * seq * 4


def activation_bytes(
    c: NormalizedConfig,
    precision: str,
    max_context: int,
    max_prompt: int,
    max_gamma: int,
    quantization: QuantizationSpec | None = None,
    flash: bool = False,
) -> int:
    """The larger of a prefill call and a verify call. A recurrent model's prefill runs as calls of
    at most MAX_CALL_ROWS rows (engine.OrtModel), the last of them attending over the whole prompt."""
    rows = min(max_prompt, MAX_CALL_ROWS) if c.state_shapes else max_prompt
    prefill = call_bytes(c, precision, rows, max_prompt, 1, quantization, flash)
    verify_s = min(max_gamma + 1, max_context)
    verify = call_bytes(c, precision, verify_s, max_context, verify_s, quantization, flash)
    return max(prefill, verify)


def head_layer(target: NormalizedConfig, draft_vocab: int) -> NormalizedConfig:
    """An EAGLE-3 head's one decoder layer at the target's shapes (for its cache and call sizes)."""
    plain = dict(per_layer_input=0, per_layer_vocab=0, double_wide_mlp=False, values_from_keys=())
    return replace(target, layers=(LayerSpec(None, None),), vocab=draft_vocab, **plain)


def summary(c: NormalizedConfig) -> dict[str, Any]:
    """The plan report's view of a config."""
    return {
        "family": c.family,
        "layers": c.num_layers,
        "hidden": c.hidden,
        "intermediate": c.intermediate,
        "heads": c.heads,
        "kv_heads": c.kv_heads,
        "head_dim": c.head_dim,
        "vocab": c.vocab,
        "tied": c.tied,
        "windows": {str(w): sum(layer.window == w for layer in c.layers) for w in c.windows},
        **({"conv_layers": c.num_layers - len(c.attention_layers)} if c.state_shapes else {}),
    }
