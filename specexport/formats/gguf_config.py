"""GGUF files: the per-architecture table, the header checks and the config from the metadata.

Everything here reads the file's header only (metadata and tensor infos; GGUFReader maps the
file and touches no tensor data), so an unsupported architecture, tensor type or tensor is
refused in one line before any weight is read.

    GGUF_ARCHS[general.architecture] -> GGUFArch:
      model_type   the transformers model_type the file is a checkpoint of
      permute_qk   llama.cpp's converter permuted attn_q / attn_k rows (and biases) for its
                   interleaved ("NORM") rotary: llama (and Mistral, converted as llama), granite,
                   smollm3. NeoX-rotary families (qwen2/3, phi3, gemma*, olmo2) are stored as is.
      norm_shift   added by the converter to every `*norm.weight` (Gemma: it stores 1 + w)
      extra        the family's own config keys from the metadata (a hybrid's layer kinds)

Tensors llama.cpp's converter reshapes (LFM2's and Mamba2's conv kernel [C, 1, L] stored as
[C, L], Mamba2's A and D [H] as [H, 1], its gated norm [inner] as [G, inner / G]) are read back in
the Hugging Face model's shape (gguf_source.GGUFSource: same elements, same order); a GGUFArch's
`tensors` names the tensors gguf-py's table does not (a converter's renames, and the parameter
whose rows it split into several tensors: Granite 4.0-H's gate | up), its `decode` undoes a value
transform (Mamba2's A stored as -exp(A_log)), its `head_orders` the axes the converter reordered
(Qwen3.5's value heads, gguf.value_head_order), its `unshifted` the norms stored without the shift
(Qwen3.5's gated DeltaNet norm), its `table_prefix` the checkpoint prefix gguf-py's table knows
(Nemotron-H's backbone.layers). The vocabulary is token_embd's rows, whatever the tokenizer list
holds (the Mamba2 converters pad that list: to a multiple of 8 for granitehybrid). Trailing MTP
blocks (`nextn_predict_layers`: Qwen3.5's) are left out of the config and never read.

The config is built from the metadata by this table (transformers' GGUF config mapping reads
fewer keys: a Gemma 3 file's rope scaling, its local theta and 27B's attention scale are lost),
with llama.cpp's own conventions where the file says nothing: Gemma 2 / 3 scale attention by
head_dim ** -0.5 except the 27B models (hidden / heads, recognized by layer count), Gemma 3
alternates 5 sliding layers with 1 full one with a local theta of 1e4 unless the file says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

from .blocks import FormatError
from .gguf_hybrids import mamba2 as _mamba2
from .gguf_hybrids import nemotron_h, qwen35, qwen35_heads

# GGML tensor types read as plain numbers or dequantized by gguf-py (gguf.quants); exact
# MatMulNBits layouts are a subset (gguf.py LAYOUTS).
_Q = GGMLQuantizationType
FLOAT_TYPES = (_Q.F32, _Q.F16, _Q.BF16)


def readable_types() -> frozenset[GGMLQuantizationType]:
    from gguf.quants import _type_traits  # gguf-py's dequantizers, by type

    return frozenset(FLOAT_TYPES) | frozenset(_type_traits)


class Meta:
    """The metadata of one file: `get("attention.head_count")` reads `{arch}.attention.head_count`."""

    def __init__(self, reader: GGUFReader, arch: str):
        self.reader, self.arch = reader, arch

    def raw(self, key: str, default: Any = None) -> Any:
        f = self.reader.get_field(key)
        return default if f is None else f.contents()

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw(f"{self.arch}.{key}", default)

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise FormatError(f"GGUF metadata has no {self.arch}.{key!r}, which a {self.arch} config needs")
        return value

    def count(self, key: str, default: int | None = None) -> int:
        """A per-layer head count that must be the same for every layer."""
        value = self.get(key, default)
        if isinstance(value, list):
            if not value or len(set(value)) != 1:
                raise FormatError(f"GGUF {self.arch}.{key} varies per layer ({value}); expected one count for all")
            value = value[0]
        if value is None:
            raise FormatError(f"GGUF metadata has no {self.arch}.{key!r}")
        return int(value)


@dataclass(frozen=True)
class GGUFArch:
    name: str  # general.architecture
    model_type: str  # transformers model_type
    permute_qk: bool = False
    norm_shift: float = 0.0
    extra: Callable[[Meta, dict], dict] = field(default=lambda meta, cfg: {})
    # a layer parameter's name within its layer -> the GGUF tensors (after "blk.N.") holding its
    # rows in order, where gguf-py's name table does not say (a converter's renames and splits)
    tensors: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # a layer tensor kind -> the inverse of the converter's value transform, float32 -> float32
    decode: dict[str, Callable[[np.ndarray], np.ndarray]] = field(default_factory=dict)
    # config dict -> {layer tensor kind: (axis, perm)}: HF index r along axis (numpy order) is GGUF index perm[r]
    head_orders: Callable[[dict], dict[str, tuple[int, np.ndarray]]] = field(default=lambda cfg: {})
    # layer tensor kinds whose norm weight the converter stored without norm_shift
    unshifted: tuple[str, ...] = ()
    # (HF prefix, the prefix gguf-py's name table expects) for layer parameters
    table_prefix: tuple[str, str] | None = None


def _gemma_scalar(meta: Meta, cfg: dict, big_layers: int) -> float:
    """llama.cpp's attention scale for Gemma 2 / 3: 1/sqrt(head_dim), the 27B model 1/sqrt(hidden / heads)."""
    if cfg["num_hidden_layers"] == big_layers:
        return cfg["hidden_size"] // cfg["num_attention_heads"]
    return cfg["head_dim"]


def _gemma2(meta: Meta, cfg: dict) -> dict:
    pattern = int(meta.get("attention.sliding_window_pattern", 2))
    return {
        "attn_logit_softcapping": meta.get("attn_logit_softcapping"),
        "final_logit_softcapping": meta.get("final_logit_softcapping"),
        "sliding_window": meta.get("attention.sliding_window"),
        "query_pre_attn_scalar": _gemma_scalar(meta, cfg, 46),
        "layer_types": _layer_types(cfg["num_hidden_layers"], pattern),
    }


def _layer_types(n: int, pattern: int) -> list[str]:
    """Every `pattern`-th layer full attention, the others sliding (Gemma 2: 2, Gemma 3: 6)."""
    return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]


def _gemma3(meta: Meta, cfg: dict) -> dict:
    pattern = meta.get("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer files: one flag per layer, true = sliding
        types = ["sliding_attention" if s else "full_attention" for s in pattern]
    else:
        types = _layer_types(cfg["num_hidden_layers"], int(pattern))
    local = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base_swa", 10000.0))}
    return {
        "sliding_window": meta.get("attention.sliding_window"),
        "query_pre_attn_scalar": _gemma_scalar(meta, cfg, 62),
        "layer_types": types,
        "rope_parameters": {"sliding_attention": local, "full_attention": cfg["rope_parameters"]},
    }


def _granite(meta: Meta, cfg: dict) -> dict:
    return {
        "attention_multiplier": meta.need("attention.scale"),
        "embedding_multiplier": meta.need("embedding_scale"),
        "residual_multiplier": meta.need("residual_scale"),
        "logits_scaling": meta.need("logit_scale"),
    }


def _phi3(meta: Meta, cfg: dict) -> dict:
    rot = int(meta.get("rope.dimension_count", cfg["head_dim"]))
    extra: dict = {"sliding_window": meta.get("attention.sliding_window")}
    if rot != cfg["head_dim"]:
        extra["rope_parameters"] = {**cfg["rope_parameters"], "partial_rotary_factor": rot / cfg["head_dim"]}
    return extra


def attention_layers(meta: Meta) -> list[bool] | None:
    """Per layer, whether it attends: a hybrid's attention.head_count_kv is one count per layer,
    0 for a layer without attention (llama.cpp's LFM2 / Granite-hybrid converters); None for one
    count shared by every layer."""
    value = meta.get("attention.head_count_kv")
    return [bool(v) for v in value] if isinstance(value, list) else None


def _kv_heads(meta: Meta, heads: int) -> int:
    """The KV head count of the attention layers (a per-layer list's non-zero entries: one count)."""
    value = meta.get("attention.head_count_kv", heads)
    if isinstance(value, list):
        counts = sorted({int(v) for v in value if v})
        if len(counts) != 1:
            raise FormatError(
                f"GGUF {meta.arch}.attention.head_count_kv {value} has no one count for its attention layers"
            )
        return counts[0]
    return int(value)


def _lfm2(meta: Meta, cfg: dict) -> dict:
    """LFM2: layers with 0 KV heads are gated short convolutions of shortconv.l_cache taps; the file's
    feed_forward_length is the MLP width already adjusted (so no block_auto_adjust_ff_dim)."""
    attends = attention_layers(meta)
    if attends is None:
        raise FormatError("GGUF lfm2.attention.head_count_kv must hold one count per layer (0: a conv layer)")
    names = {t.name for t in meta.reader.tensors}
    return {
        "layer_types": ["full_attention" if a else "conv" for a in attends],
        "conv_L_cache": int(meta.need("shortconv.l_cache")),
        "conv_bias": any(n.endswith(".shortconv.in_proj.bias") for n in names),
        "norm_eps": cfg["rms_norm_eps"],
        "block_auto_adjust_ff_dim": False,
    }


def _granite_hybrid(meta: Meta, cfg: dict) -> dict:
    """Granite 4.0-H: head_count_kv 0 marks a Mamba2 layer; the dense MLP is the shared one
    (expert_shared_feed_forward_length); rope.scaling.finetuned says whether attention rotates
    (the converter's flag: Bamba and non-hybrid files); experts are refused."""
    attends = attention_layers(meta)
    if attends is None:
        raise FormatError(
            "GGUF granitehybrid.attention.head_count_kv must hold one count per layer (0: a Mamba2 layer)"
        )
    if int(meta.get("expert_count", 0) or 0) > 0:
        raise FormatError(
            "GGUF granitehybrid file has experts (expert_count > 0); only dense Granite 4.0-H is supported"
        )
    width = int(meta.get("expert_shared_feed_forward_length") or cfg["intermediate_size"])
    mamba = _mamba2(meta, cfg)
    return {
        **_granite(meta, cfg),
        **mamba,
        "mamba_expand": mamba["mamba_n_heads"] * mamba["mamba_d_head"] // cfg["hidden_size"],
        "layer_types": ["attention" if a else "mamba" for a in attends],
        "shared_intermediate_size": width,
        "intermediate_size": width,
        "num_local_experts": 0,
        "position_embedding_type": "rope" if meta.get("rope.scaling.finetuned") else None,
    }


def _falcon_h1(meta: Meta, cfg: dict) -> dict:
    """Falcon-H1: llama.cpp's converter multiplies every muP multiplier into the weights (embedding,
    head, q/k/v, o, in_proj rows, out_proj, gate, down), so the config's are 1; a file with the
    gated norm (ssm_norm) normalizes after the gate, as llama.cpp computes it."""
    mamba = _mamba2(meta, cfg)
    names = {t.name for t in meta.reader.tensors}
    return {
        **mamba,
        "mamba_d_ssm": mamba["mamba_n_heads"] * mamba["mamba_d_head"],
        "mamba_rms_norm": any(n.endswith(".ssm_norm.weight") for n in names),
        "mamba_norm_before_gate": False,
        "projectors_bias": False,
        "embedding_multiplier": 1.0,
        "lm_head_multiplier": 1.0,
        "attention_in_multiplier": 1.0,
        "attention_out_multiplier": 1.0,
        "key_multiplier": 1.0,
        "ssm_in_multiplier": 1.0,
        "ssm_out_multiplier": 1.0,
        "ssm_multipliers": [1.0] * 5,
        "mlp_multipliers": [1.0, 1.0],
    }


# Mamba2 tensors as llama.cpp's converter writes them: A as ssm_a = -exp(A_log) [H, 1], D [H, 1],
# the conv kernel [C, K] (squeezed), the gated norm [G, inner / G], dt_bias as ssm_dt.bias (the
# shapes are read back through GGUFSource's HF shapes; the value of A through `decode`)
_MAMBA2_TENSORS = {"mamba.dt_bias": ("ssm_dt.bias",)}
_MAMBA2_DECODE = {"ssm_a": lambda a: np.log(-a)}


def _window(meta: Meta, cfg: dict) -> dict:
    window = meta.get("attention.sliding_window")
    return {} if window is None else {"sliding_window": window}


GGUF_ARCHS: dict[str, GGUFArch] = {
    a.name: a
    for a in (
        GGUFArch("llama", "llama", permute_qk=True),
        GGUFArch("qwen2", "qwen2"),
        GGUFArch("qwen3", "qwen3", extra=_window),
        GGUFArch("phi3", "phi3", extra=_phi3),
        GGUFArch("gemma", "gemma", norm_shift=1.0),
        GGUFArch("gemma2", "gemma2", norm_shift=1.0, extra=_gemma2),
        GGUFArch("gemma3", "gemma3_text", norm_shift=1.0, extra=_gemma3),
        GGUFArch("granite", "granite", permute_qk=True, extra=_granite),
        GGUFArch("olmo2", "olmo2"),
        GGUFArch("smollm3", "smollm3", permute_qk=True),
        GGUFArch("lfm2", "lfm2", extra=_lfm2),
        GGUFArch(
            "granitehybrid",
            "granitemoehybrid",
            permute_qk=True,
            extra=_granite_hybrid,
            tensors={
                **_MAMBA2_TENSORS,
                "shared_mlp.input_linear.weight": ("ffn_gate.weight", "ffn_up.weight"),  # rows gate | up
                "shared_mlp.output_linear.weight": ("ffn_down.weight",),
            },
            decode=_MAMBA2_DECODE,
        ),
        GGUFArch("falcon-h1", "falcon_h1", extra=_falcon_h1, tensors=_MAMBA2_TENSORS, decode=_MAMBA2_DECODE),
        GGUFArch(
            "qwen35",
            "qwen3_5_text",
            norm_shift=1.0,  # (1 + w) norms, the gated DeltaNet norm excepted
            extra=qwen35,
            tensors={"linear_attn.dt_bias": ("ssm_dt.bias",)},
            decode=_MAMBA2_DECODE,
            head_orders=qwen35_heads,
            unshifted=("ssm_norm",),
        ),
        GGUFArch(
            "nemotron_h",
            "nemotron_h",
            permute_qk=True,  # the converter permutes q / k rows although these layers have no rotary
            extra=nemotron_h,
            tensors={"mixer.dt_bias": ("ssm_dt.bias",)},
            decode=_MAMBA2_DECODE,
            table_prefix=("model.layers.", "backbone.layers."),
        ),
    )
}
# Tensors a file may hold that no supported config reproduces: refused by name.
REFUSED_TENSORS = {
    "rope_freqs.weight": "llama3-style rope frequency factors (rope scaling the config cannot express)",
    "rope_factors_long.weight": "LongRoPE factors",
    "rope_factors_short.weight": "LongRoPE factors",
}


@dataclass(frozen=True)
class GGUFHeader:
    """One file's header: the reader (tensor data untouched), its architecture row and config dict."""

    path: Path
    reader: GGUFReader
    arch: GGUFArch
    config: dict  # transformers config kwargs, model_type included
    mtp_layers: int = 0  # trailing blocks past config["num_hidden_layers"] (nextn_predict_layers), never read


def _open(path: Path) -> GGUFReader:
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:  # bad magic or version, truncated header
        raise FormatError(f"{str(path)!r} is not a readable GGUF file: {exc}") from exc
    if reader.byte_order != "I":
        raise FormatError(f"{str(path)!r} is a big-endian GGUF file; only little-endian files are supported")
    return reader


def read_header(path: str | Path) -> GGUFHeader:
    """The file's architecture row and transformers config, every tensor's type checked: one
    FormatError line for an unsupported architecture, tensor type or tensor, no tensor read."""
    path = Path(path)
    reader = _open(path)
    f = reader.get_field("general.architecture")
    name = None if f is None else f.contents()
    if name not in GGUF_ARCHS:
        raise FormatError(f"GGUF architecture {name!r} is not supported (supported: {', '.join(sorted(GGUF_ARCHS))})")
    readable = readable_types()
    for t in reader.tensors:
        if t.tensor_type not in readable:
            raise FormatError(
                f"GGUF tensor {t.name!r} has type {t.tensor_type.name}, which cannot be read"
                f" (readable: {', '.join(sorted(q.name for q in readable))})"
            )
        if t.name in REFUSED_TENSORS:
            raise FormatError(f"GGUF tensor {t.name!r} holds {REFUSED_TENSORS[t.name]}; such files are not supported")
    arch = GGUF_ARCHS[name]
    mtp = int(Meta(reader, name).get("nextn_predict_layers", 0) or 0)
    return GGUFHeader(path, reader, arch, _config(reader, arch, mtp), mtp)


def tensor_shape(reader: GGUFReader, name: str) -> list[int] | None:
    """[rows, cols] (numpy order: GGUF's ne reversed) of a tensor, None if absent."""
    for t in reader.tensors:
        if t.name == name:
            return [int(n) for n in reversed(t.shape.tolist())]
    return None


def _one_width(meta: Meta, key: str) -> int:
    """A width the file may hold per layer (0: a layer without that part): its one non-zero value."""
    value = meta.need(key)
    if not isinstance(value, list):
        return int(value)
    widths = sorted({int(v) for v in value if v})
    if len(widths) > 1:
        raise FormatError(f"GGUF {meta.arch}.{key} {value} has no one width for its layers")
    return widths[0] if widths else 0


def _config(reader: GGUFReader, arch: GGUFArch, mtp_layers: int = 0) -> dict:
    meta = Meta(reader, arch.name)
    heads = meta.count("attention.head_count")
    hidden = int(meta.need("embedding_length"))
    embd = tensor_shape(reader, "token_embd.weight")  # [V, hidden]
    vocab = embd[0] if embd is not None else meta.get("vocab_size")
    if vocab is None:
        raise FormatError(f"GGUF file has neither 'token_embd.weight' nor {arch.name}.vocab_size")
    names = {t.name for t in reader.tensors}
    head_dim = int(meta.get("attention.key_length", hidden // heads))
    eps = meta.get("attention.layer_norm_rms_epsilon")  # Nemotron-H's converter writes layer_norm_epsilon
    rope: dict = {"rope_type": "default", "rope_theta": float(meta.get("rope.freq_base", 10000.0))}
    scaling = meta.get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise FormatError(f"GGUF {arch.name}.rope.scaling.type {scaling!r} is not supported (expected 'linear')")
        rope = {**rope, "rope_type": "linear", "factor": float(meta.need("rope.scaling.factor"))}
    cfg: dict = {
        "model_type": arch.model_type,
        "num_hidden_layers": int(meta.need("block_count")) - mtp_layers,
        "hidden_size": hidden,
        "intermediate_size": _one_width(meta, "feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _kv_heads(meta, heads),
        "head_dim": head_dim,
        "max_position_embeddings": int(meta.get("context_length", 2048)),
        "rms_norm_eps": float(eps if eps is not None else meta.need("attention.layer_norm_epsilon")),
        "rope_parameters": rope,
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }
    for key, hf in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        value = meta.raw(f"tokenizer.ggml.{hf}_token_id")
        if value is not None:
            cfg[key] = int(value)
    cfg.update({k: v for k, v in arch.extra(meta, cfg).items() if v is not None})
    if arch.model_type != "qwen2":  # Qwen2 has q/k/v biases whatever the config says
        return cfg
    cfg.pop("attention_bias")
    cfg.pop("mlp_bias")
    return cfg


def hf_config(header: GGUFHeader):
    """The transformers config object of the header's config dict."""
    from transformers import AutoConfig

    data = dict(header.config)
    model_type = data.pop("model_type")
    return AutoConfig.for_model(model_type, **data)


def block_type(qtype: GGMLQuantizationType) -> bool:
    """Whether a GGML type stores blocks (quantized), not one plain number per element."""
    return GGML_QUANT_SIZES[qtype][0] > 1
