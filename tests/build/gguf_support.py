"""Tiny GGUF files of tiny random-init models, written here as llama.cpp's converter writes them.

Independent of specexport's GGUF reader: tensor names come from gguf-py's TensorNameMap (the
table the converter uses), q / k rows are permuted by the converter's own `permute` (written here
from its definition), Gemma norms are stored as 1 + w, a tied head is left out, and the metadata
keys are the ones llama.cpp reads (gguf.Keys). Quantized tensors come from gguf.quants.quantize;
`dequantized_reference` gives the model whose weights are what the file holds, dequantized by
gguf-py, in Hugging Face order: the reference a graph of the file's blocks must match.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

T = GGMLQuantizationType
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)
# HF model_type -> (GGUF architecture, q / k rows permuted by the converter, norms stored as 1 + w)
CONVERTED = {
    "llama": ("llama", True, False),
    "qwen2": ("qwen2", False, False),
    "qwen3": ("qwen3", False, False),
    "phi3": ("phi3", False, False),
    "gemma": ("gemma", False, True),
    "gemma2": ("gemma2", False, True),
    "gemma3_text": ("gemma3", False, True),
    "granite": ("granite", True, False),
    "olmo2": ("olmo2", False, False),
    "smollm3": ("smollm3", True, False),
}
# what a GGUF file can say: llama.cpp derives Gemma's attention scale from head_dim (the tiny
# configs' query_pre_attn_scalar 24 has no metadata key), so the GGUF tests use head_dim
GGUF_OVERRIDES = {"gemma2": dict(query_pre_attn_scalar=32), "gemma3_text": dict(query_pre_attn_scalar=32)}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf `LlamaModel.permute`: per head, rows (0, half, 1, half + 1, ...)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _metadata(writer: GGUFWriter, config, arch: str) -> None:
    c = config
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters
    if "full_attention" in rope:  # Gemma 3: the global rope in the main keys, the local theta fixed at 1e4
        assert rope["sliding_attention"]["rope_theta"] == 10000.0
        rope = rope["full_attention"]
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope.get("rope_type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_float32(f"{arch}.rope.scaling.factor", rope["factor"])
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if getattr(c, "sliding_window", None):
        writer.add_sliding_window(c.sliding_window)
    if c.model_type == "gemma2":
        writer.add_float32(f"{arch}.attn_logit_softcapping", c.attn_logit_softcapping)
        writer.add_float32(f"{arch}.final_logit_softcapping", c.final_logit_softcapping)
    if c.model_type == "granite":
        writer.add_float32(f"{arch}.attention.scale", c.attention_multiplier)
        writer.add_float32(f"{arch}.embedding_scale", c.embedding_multiplier)
        writer.add_float32(f"{arch}.residual_scale", c.residual_multiplier)
        writer.add_float32(f"{arch}.logit_scale", c.logits_scaling)
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id if isinstance(c.eos_token_id, int) else c.eos_token_id[0])
    if c.pad_token_id is not None:
        writer.add_pad_token_id(c.pad_token_id)


def write_model_gguf(
    model,
    path: Path,
    qtype_of=lambda name, w: T.F32,
    extra: dict | None = None,
    skip: tuple[str, ...] = (),
    tokenizer=None,
) -> tuple[Path, dict[str, np.ndarray]]:
    """(GGUF of `model` at `path`, {HF name: float32 [N, K] the file holds dequantized, HF order}
    for every quantized weight). qtype_of(hf_name, weight) picks each 2-D weight's type (F32,
    F16, a type gguf.quants.quantize writes, or a K-quant: random blocks); 1-D tensors are F32. extra: more tensors
    {gguf name: (raw array, type)} written as they are; skip: HF names left out; tokenizer: a
    byte-level BPE (tiny.make_tokenizer) written as llama.cpp's "gpt2" tokenizer metadata."""
    config = model.config
    arch, permuted, shifted = CONVERTED[config.model_type]
    arch_id = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    names = get_tensor_name_map(arch_id, config.num_hidden_layers)
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    _metadata(writer, config, arch)
    if tokenizer is not None:
        _tokenizer(writer, tokenizer)
    state = dict(model.named_parameters())  # a tied head appears once, under the embedding's name
    kv = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    held: dict[str, np.ndarray] = {}
    for name, p in state.items():
        if name in skip:
            continue
        stem, _, suffix = name.rpartition(".")
        gguf = names.get_name(stem)
        assert gguf is not None, name
        w = p.detach().float().numpy().copy()
        if shifted and name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        heads = kv.get(stem.rsplit(".", 1)[-1])
        if permuted and heads:
            w = permute(w, heads)
        qtype = qtype_of(name, w) if w.ndim == 2 else T.F32
        if qtype in (T.F32, T.F16):
            writer.add_tensor(f"{gguf}.{suffix}", w.astype(np.float32 if qtype == T.F32 else np.float16))
            continue
        raw = _k_quant(qtype, w.shape) if qtype in K_QUANTS else gguf_quantize(w, qtype)
        writer.add_tensor(f"{gguf}.{suffix}", raw, raw_dtype=qtype)
        value = gguf_dequantize(raw, qtype)
        held[name] = permute_back(value, heads) if permuted and heads else value
    for gguf, (raw, qtype) in (extra or {}).items():
        writer.add_tensor(gguf, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, held


def _tokenizer(writer: GGUFWriter, tok, pre: str = "gpt-2") -> None:
    """llama.cpp's BPE tokenizer keys: tokens by id, merges "a b", token types (3 = control), and
    the pre-tokenizer's llama.cpp name (tiny.make_tokenizer splits by GPT-2's expression: "gpt-2")."""
    import json

    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    specials = set(tok.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_token_types([3 if t in specials else 1 for t in tokens])
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)


def _k_quant(qtype: T, shape: tuple[int, int]) -> np.ndarray:
    """Random K-quant bytes of a [N, K] weight (gguf-py writes no K-quants): the file's values are
    then these blocks' dequantization, not the model's weight (dequantized_reference holds them)."""
    from quantized_checkpoints import k_quant_raw

    return k_quant_raw(qtype, shape[0], shape[1] // 256, np.random.default_rng(shape[0] * 7 + shape[1]))


def permute_back(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of `permute` (rows back in Hugging Face order)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantized_reference(model, held: dict[str, np.ndarray]):
    """A copy of `model` holding the file's dequantized weights where it holds them quantized."""
    ref = copy.deepcopy(model)
    params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, value in held.items():
            params[name].copy_(torch.from_numpy(value))
    return ref.eval()


# float config values a GGUF file stores as float32 (the metadata's type)
_FLOAT32_KEYS = (
    "rms_norm_eps",
    "attention_multiplier",
    "embedding_multiplier",
    "residual_multiplier",
    "logits_scaling",
    "attn_logit_softcapping",
    "final_logit_softcapping",
)


def gguf_model(family: str, seed: int = 0, **overrides):
    """The tiny random-init model of `family` that a GGUF file can describe (GGUF_OVERRIDES, and
    float values rounded to the float32 the metadata holds)."""
    from tiny import make_model, tiny_config

    values = {**GGUF_OVERRIDES.get(family, {}), **overrides}
    config = tiny_config(family, **values)
    for key in _FLOAT32_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, float):
            values[key] = float(np.float32(value))
    return make_model(family, seed=seed, **values)


HYBRID_CONTEXT = 128  # the hybrid GGUF tests' graphs


def hybrid_ids(n: int = 20) -> list[int]:
    """A fixed prompt of the tiny vocabulary."""
    return [int(i) for i in np.random.default_rng(0).integers(3, 300, n)]


def fused_graph_logits(model, out: Path, ids: list[int]) -> np.ndarray:
    """Rows of a prefill and a 5-token verify call of `model`'s fused graph (recurrent state): [len(ids), V]."""
    from specexport.build.validate import FeedRunner
    from specexport.graphs.decoder import build_decoder

    result = build_decoder(model, out, HYBRID_CONTEXT)
    runner = FeedRunner(result.path, result.spec)
    n0 = len(ids) - 5
    return np.concatenate([runner.run(ids[:n0], list(range(n0))), runner.run(ids[n0:], list(range(5)))])
