"""Quantized checkpoints written by the tests, independently of the loaders under test.

GPTQ / AWQ: a tiny model's Linears are round-to-nearest quantized and packed here from the
format descriptions: GPTQ packs codes low-first into int32 words along K (qweight [K / per, N])
and zero points along N (qzeros [groups, N / per]), storing zero - 1 in the v1 "gptq" format;
AWQ GEMM packs codes and zero points along N, nibble i of word c holding column
8c + [0, 2, 4, 6, 1, 3, 5, 7][i]. The reference weight is float32(scale)[g(k), n] *
(q[k, n] - zero[g(k), n]) in float32, computed from the test's own codes.

GGUF: raw bytes come from gguf.quants.quantize (legacy types) or are assembled field by field
(K-quants, ggml-common.h), values from gguf.quants.dequantize; files are written with gguf's
GGUFWriter; llama's q / k rows are permuted as llama.cpp's converter does (`unpermute` is its
inverse, written from that definition).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.numpy import save_file

# ---------------------------------------------------------------- GPTQ / AWQ

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]


# ---------------------------------------------------------------- test-side quantization and packing


@dataclass
class RefLayer:
    """One quantized Linear as the test made it, in checkpoint orientation."""

    q: np.ndarray  # uint8 [K, N] codes
    zero: np.ndarray  # int64 [G, N] true zero points (before any format offset)
    scale: np.ndarray  # float16 [G, N]
    g_idx: np.ndarray  # int32 [K] group of each input

    def weight(self) -> np.ndarray:
        """float32 [N, K]: scale * (q - zero), in float32."""
        codes = self.q.astype(np.float32) - self.zero[self.g_idx].astype(np.float32)  # [K, N]
        return (self.scale.astype(np.float32)[self.g_idx] * codes).T


def quantize_layer(w: np.ndarray, bits: int, group: int, sym: bool, rng: np.random.Generator | None) -> RefLayer:
    """Round-to-nearest quantization of w [N, K]; rng given: a shuffled (act-order) g_idx."""
    N, K = w.shape
    group = K if group == -1 else group
    levels = 1 << bits
    g_idx = (np.arange(K) // group).astype(np.int32)
    if rng is not None:
        shuffled = np.empty(K, np.int32)
        shuffled[rng.permutation(K)] = g_idx  # input perm[i] is in group i // group
        g_idx = shuffled
    G = K // group
    q = np.zeros((K, N), np.uint8)
    zero = np.zeros((G, N), np.int64)
    scale = np.zeros((G, N), np.float16)
    for g in range(G):
        rows = w.T[g_idx == g]  # [group, N]
        lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
        if sym:
            scale[g] = (np.maximum(-lo, hi) / (levels // 2 - 1)).astype(np.float16)
            zero[g] = levels // 2
        else:
            scale[g] = ((hi - lo) / (levels - 1)).astype(np.float16)
            zero[g] = np.clip(np.round(-lo / scale[g].astype(np.float32)), 1, levels - 1)  # >= 1: v1 stores zero - 1
        s = scale[g].astype(np.float32)
        q[g_idx == g] = np.clip(np.round(rows / s) + zero[g], 0, levels - 1).astype(np.uint8)
    return RefLayer(q=q, zero=zero, scale=scale, g_idx=g_idx)


def pack(codes: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words of 32 / bits codes each, low bits first, packed along `axis` of codes [A, B]."""
    per = 32 // bits
    c = codes.astype(np.uint32)
    A, B = c.shape
    parts = c.reshape(A // per, per, B) if axis == 0 else c.reshape(A, B // per, per).transpose(0, 2, 1)
    words = np.zeros((parts.shape[0], parts.shape[2]), np.uint32)
    for j in range(per):
        words |= parts[:, j, :] << np.uint32(bits * j)
    return words.view(np.int32)


def gptq_tensors(ref: RefLayer, bits: int, fmt: str, with_g_idx: bool) -> dict[str, np.ndarray]:
    stored = ref.zero - (1 if fmt == "gptq" else 0)  # v1 stores zero - 1
    tensors = {
        "qweight": pack(ref.q, bits, axis=0),  # [K / per, N] int32
        "qzeros": pack(stored, bits, axis=1),  # [G, N / per] int32
        "scales": ref.scale,  # [G, N] fp16
    }
    if with_g_idx:
        tensors["g_idx"] = ref.g_idx  # [K] int32
    return tensors


def awq_interleave(codes: np.ndarray) -> np.ndarray:
    """codes [A, 8C] -> the order AWQ packs: word c, nibble i = column 8c + AWQ_ORDER[i]."""
    A, cols = codes.shape
    return codes.reshape(A, cols // 8, 8)[:, :, AWQ_ORDER].reshape(A, cols)


def awq_tensors(ref: RefLayer) -> dict[str, np.ndarray]:
    return {
        "qweight": pack(awq_interleave(ref.q), 4, axis=1),  # [K, N / 8] int32
        "qzeros": pack(awq_interleave(ref.zero), 4, axis=1),  # [G, N / 8] int32
        "scales": ref.scale,  # [G, N] fp16
    }


# ---------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class Variant:
    method: str  # "gptq" | "awq"
    bits: int = 4
    group: int = 32
    fmt: str = "gptq"  # GPTQ checkpoint_format
    sym: bool = False
    act_order: bool = False
    with_g_idx: bool = True

    def qconfig(self) -> dict:
        if self.method == "awq":
            return {
                "quant_method": "awq",
                "bits": self.bits,
                "group_size": self.group,
                "zero_point": True,
                "version": "gemm",
            }
        return {
            "quant_method": "gptq",
            "bits": self.bits,
            "group_size": self.group,
            "sym": self.sym,
            "desc_act": self.act_order,
            "checkpoint_format": self.fmt,
        }


VARIANTS = {
    "gptq-v1-4bit-g32": Variant("gptq"),
    "gptq-v1-8bit-g16-sym": Variant("gptq", bits=8, group=16, sym=True, with_g_idx=False),
    "gptq-v2-4bit-g32": Variant("gptq", fmt="gptq_v2"),
    "gptq-v1-4bit-allK": Variant("gptq", group=-1),
    "gptq-v1-4bit-g16-actorder": Variant("gptq", group=16, act_order=True),
    "awq-gemm-4bit-g32": Variant("awq"),
}


@dataclass
class Checkpoint:
    folder: Path
    refs: dict[str, RefLayer]  # by parameter name ("model.layers.0.mlp.up_proj.weight")
    reference: torch.nn.Module  # the tiny model with the reference weights (and fp16-rounded plain tensors)


def write_checkpoint(folder: Path, model, tokenizer, variant: Variant, seed: int = 0) -> Checkpoint:
    """Quantize the Linears of `model`, save config.json + model.safetensors + tokenizer."""
    rng = np.random.default_rng(seed) if variant.act_order else None
    reference = copy.deepcopy(model)
    state = {name: p.detach().numpy() for name, p in model.state_dict().items()}
    tensors: dict[str, np.ndarray] = {}
    refs: dict[str, RefLayer] = {}
    prefixes = [f"model.layers.{i}.{lin}" for i in range(model.config.num_hidden_layers) for lin in LINEARS]
    for prefix in prefixes:
        ref = quantize_layer(state.pop(f"{prefix}.weight"), variant.bits, variant.group, variant.sym, rng)
        refs[f"{prefix}.weight"] = ref
        packed = (
            awq_tensors(ref)
            if variant.method == "awq"
            else gptq_tensors(ref, variant.bits, variant.fmt, variant.with_g_idx)
        )
        tensors.update({f"{prefix}.{suffix}": value for suffix, value in packed.items()})
    state.pop("lm_head.weight")  # tied to the embeddings
    tensors.update({name: value.astype(np.float16) for name, value in state.items()})  # plain tensors in fp16
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = model.config.to_dict()
    config["quantization_config"] = variant.qconfig()
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tokenizer.save_pretrained(folder)
    _set_reference(reference, refs, state)
    return Checkpoint(folder, refs, reference)


def _set_reference(reference, refs: dict[str, RefLayer], plain: dict[str, np.ndarray]) -> None:
    with torch.no_grad():
        params = dict(reference.named_parameters())
        for name, ref in refs.items():
            params[name].copy_(torch.from_numpy(ref.weight()))
        for name, value in plain.items():
            params[name].copy_(torch.from_numpy(value.astype(np.float16).astype(np.float32)))


# ---------------------------------------------------------------- GGUF

LEGACY = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
K_QUANTS = (T.Q4_K, T.Q5_K, T.Q6_K)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """uint8 [..., 2]: little-endian fp16 of values [...]."""
    return values.astype("<f2")[..., None].view(np.uint8)


def k_quant_raw(qtype: T, rows: int, superblocks: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [rows, superblocks * type size]: random K-quant blocks built field by field
    (ggml-common.h block_q4_K / block_q5_K / block_q6_K); every byte pattern is valid except
    non-finite fp16 super-scales, which are drawn from a normal distribution instead."""
    shape = (rows, superblocks)
    byte = lambda n: rng.integers(0, 256, (*shape, n), dtype=np.uint8)  # noqa: E731
    d = _f16_bytes(rng.normal(0, 1e-3, shape))
    dmin = _f16_bytes(rng.normal(0, 1e-3, shape))
    if qtype == T.Q4_K:  # d | dmin | 12 B packed 6-bit scales and mins | 128 B nibbles
        parts = [d, dmin, byte(12), byte(128)]
    elif qtype == T.Q5_K:  # d | dmin | 12 B scales and mins | 32 B high bits | 128 B nibbles
        parts = [d, dmin, byte(12), byte(32), byte(128)]
    else:  # Q6_K: 128 B low nibbles | 64 B 2-bit highs | 16 int8 scales | d
        parts = [byte(128), byte(64), byte(16), d]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def raw_of(qtype: T, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF bytes uint8 [rows, row bytes] of a [rows, cols] tensor of type qtype."""
    if qtype in K_QUANTS:
        return k_quant_raw(qtype, rows, cols // 256, rng)
    weights = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
    weights[0, :32] += 0.2  # a block with only positive values (Q4_1 / Q5_1 minimum > 0)
    return gguf_quantize(weights, qtype)


HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 256, 4, 2, 512, 64, 2
HEAD_DIM = HIDDEN // HEADS
# every supported type appears, K-quants and legacy ones on attn_q / attn_k
TYPES = [
    {
        "attn_q": T.Q4_K,
        "attn_k": T.Q6_K,
        "attn_v": T.Q5_K,
        "attn_output": T.Q4_0,
        "ffn_gate": T.Q4_1,
        "ffn_up": T.Q5_0,
        "ffn_down": T.Q5_1,
    },
    {
        "attn_q": T.Q4_1,
        "attn_k": T.Q8_0,
        "attn_v": T.Q4_0,
        "attn_output": T.Q6_K,
        "ffn_gate": T.Q5_K,
        "ffn_up": T.Q4_K,
        "ffn_down": T.Q8_0,
    },
]
HF = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def shape_of(part: str) -> tuple[int, int]:
    """[out, in] of a layer tensor."""
    return {
        "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
        "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }.get(part, (HIDDEN, HIDDEN))


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert_hf_to_gguf `permute` (per head, GGUF rows 2i and 2i + 1
    are HF rows i and i + head_dim / 2), written here from that definition."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)


def write_gguf(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, T]]) -> Path:
    """A GGUF file with llama-style metadata under `arch` and the given raw tensors."""
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_gguf(folder: Path) -> tuple[Path, dict[str, np.ndarray]]:
    """(tiny llama GGUF, expected HF-order float32 weights by HF name: gguf-py's dequantize of
    the stored bytes, q / k un-permuted by this test's own `unpermute`)."""
    rng = np.random.default_rng(0)
    tensors: dict[str, tuple[np.ndarray, T]] = {}
    expected: dict[str, np.ndarray] = {}

    def add(gguf_name: str, hf_name: str, qtype: T, shape: tuple[int, int], heads: int = 0) -> None:
        raw = raw_of(qtype, *shape, rng)
        tensors[gguf_name] = (raw, qtype)
        value = gguf_dequantize(raw, qtype)
        expected[hf_name] = unpermute(value, heads) if heads else value

    add("token_embd.weight", "model.embed_tokens.weight", T.Q8_0, (VOCAB, HIDDEN))
    add("output.weight", "lm_head.weight", T.Q6_K, (VOCAB, HIDDEN))
    ones = np.ones(HIDDEN, np.float32)
    tensors["output_norm.weight"] = (ones, T.F32)
    for i, types in enumerate(TYPES):
        for part, qtype in types.items():
            heads = {"attn_q": HEADS, "attn_k": KV_HEADS}.get(part, 0)
            add(f"blk.{i}.{part}.weight", f"model.layers.{i}.{HF[part]}.weight", qtype, shape_of(part), heads)
        tensors[f"blk.{i}.attn_norm.weight"] = (ones, T.F32)
        tensors[f"blk.{i}.ffn_norm.weight"] = (ones, T.F32)
    return write_gguf(folder / "tiny.gguf", "llama", tensors), expected
