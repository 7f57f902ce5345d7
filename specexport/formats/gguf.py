"""GGUF checkpoints: a file's quantized weight tensors mapped exactly onto BlockQuantized.

Every supported GGML block type is an affine code per block of inputs, so its codes and scales
carry over without dequantizing: W[n, k] = scale * (q - zero) + offset (blocks.py). Block
layouts follow llama.cpp's ggml-common.h (gguf-py's gguf/quants.py is the reference the tests
compare against):

    type   bytes per block (all little-endian)                    BlockQuantized
    Q4_0   f16 d | 16 B nibbles                                   4-bit, block 32, zero 8, scale d
    Q4_1   f16 d | f16 m | 16 B nibbles                           4-bit, block 32, zero 0, scale d, offset m
    Q5_0   f16 d | u32 high bits | 16 B nibbles                   8-bit, block 32, zero 16, scale d
    Q5_1   f16 d | f16 m | u32 high bits | 16 B nibbles           8-bit, block 32, zero 0, scale d, offset m
    Q8_0   f16 d | 32 x int8                                      8-bit (code q+128), block 32, zero 128, scale d
    Q4_K   f16 d | f16 dmin | 12 B 6-bit sc/m | 128 B nibbles     4-bit, block 32, zero 0, scale d*sc, offset -dmin*m
    Q5_K   as Q4_K, then 32 B high bits before the nibbles        8-bit, block 32, zero 0, scale d*sc, offset -dmin*m
    Q6_K   128 B low nibbles | 64 B 2-bit highs | 16 x int8 sc | f16 d   8-bit, block 16, zero 32, scale d*sc

A 32-element block stores element j < 16 in the low nibble of byte j and element j + 16 in its
high nibble (not MatMulNBits's packing of neighbours; blocks.pack packs from the unpacked codes).
Products d * sc (fp16 times an integer below 2**8) are exact in float32, so dequantize() of the
result equals gguf.quants.dequantize bit for bit.

Tensor names, the architectures and which of them had their attn_q / attn_k rows permuted by
llama.cpp's converter (for its interleaved rotary) are formats/gguf_config.py's table; the rows
are put back in Hugging Face order here (`rotary_unpermutation`, `permute_rows`: blocks run
along inputs, so a row permutation keeps them intact). Qwen3.5's value heads, which the converter
stores tiled instead of grouped by key head, come back through `value_head_order` (rows) and
`permute_columns` (out_proj's inputs: exact while each head spans whole blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from .blocks import BlockQuantized, FormatError

# ---------------------------------------------------------------------------------------------
# Block layouts. Each decoder takes raw [N, nsb, bytes] (nsb blocks of the GGML type per row)
# and returns q [N, nsb, elements] uint8, scale [N, nsb, subs] float32 and offset (same) or None.

Decoded = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]


@dataclass(frozen=True)
class Layout:
    bits: int  # BlockQuantized code width (5- and 6-bit codes widen to 8)
    block: int  # inputs per scale: the block, or a K-quant's sub-block
    zero: int  # zero point of every block
    decode: Callable[[np.ndarray], Decoded]


def _fields(raw: np.ndarray, *widths: int) -> list[np.ndarray]:
    """Consecutive byte fields of raw [..., bytes]: views [..., width] each."""
    if sum(widths) != raw.shape[-1]:
        raise FormatError(f"block fields {widths} cover {sum(widths)} bytes, the block has {raw.shape[-1]}")
    ends = np.cumsum(widths)
    return [raw[..., end - width : end] for width, end in zip(widths, ends)]


def _f16(field: np.ndarray) -> np.ndarray:
    """float32 [...] from little-endian fp16 bytes [..., 2]."""
    return np.ascontiguousarray(field).view("<f2")[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 2 * n] uint8 from [..., n] bytes: all low nibbles, then all high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(field: np.ndarray) -> np.ndarray:
    """[..., 8 * n] uint8 0/1 from [..., n] bytes, bit i of the little-endian word at i."""
    return np.unpackbits(field, axis=-1, bitorder="little")


def _decode_q4_0(raw: np.ndarray) -> Decoded:
    d, qs = _fields(raw, 2, 16)
    return _nibbles(qs), _f16(d)[..., None], None  # q: [N, nsb, 32]


def _decode_q4_1(raw: np.ndarray) -> Decoded:
    d, m, qs = _fields(raw, 2, 2, 16)
    return _nibbles(qs), _f16(d)[..., None], _f16(m)[..., None]


def _decode_q5_0(raw: np.ndarray) -> Decoded:
    d, qh, qs = _fields(raw, 2, 4, 16)
    return _nibbles(qs) | (_bits(qh) << 4), _f16(d)[..., None], None  # q: [N, nsb, 32] in 0..31


def _decode_q5_1(raw: np.ndarray) -> Decoded:
    d, m, qh, qs = _fields(raw, 2, 2, 4, 16)
    return _nibbles(qs) | (_bits(qh) << 4), _f16(d)[..., None], _f16(m)[..., None]


def _decode_q8_0(raw: np.ndarray) -> Decoded:
    d, qs = _fields(raw, 2, 32)
    return qs ^ np.uint8(0x80), _f16(d)[..., None], None  # int8 x -> uint8 x + 128


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: 12 bytes [..., 12] -> 6-bit scales and mins [..., 8] of the 8 sub-blocks.

    Sub-blocks 0-3 use the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take
    their low 4 bits from bytes 8-11 (scale: low nibble, min: high nibble) and their top 2 bits
    from the top bits of bytes 0-3 (scale) and 4-7 (min)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _k_low(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K: 128 bytes [..., 128] -> low 4 bits [..., 8, 32]: sub-block 2j is the low
    nibbles of bytes 32j..32j+31, sub-block 2j + 1 their high nibbles."""
    lead = qs.shape[:-1]
    pairs = qs.reshape(*lead, 4, 1, 32)  # [..., j, 1, 32]
    return np.concatenate([pairs & 0x0F, pairs >> 4], axis=-2).reshape(*lead, 8, 32)  # [..., 2j + nibble, 32]


def _k_affine(d: np.ndarray, dmin: np.ndarray, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """scale d * sc and offset -dmin * m, float32 [N, nsb, 8] (exact products)."""
    sc, mn = _k_scales(packed)
    return _f16(d)[..., None] * sc.astype(np.float32), -(_f16(dmin)[..., None] * mn.astype(np.float32))


def _decode_q4_k(raw: np.ndarray) -> Decoded:
    d, dmin, packed, qs = _fields(raw, 2, 2, 12, 128)
    scale, offset = _k_affine(d, dmin, packed)
    return _k_low(qs).reshape(*raw.shape[:-1], 256), scale, offset


def _decode_q5_k(raw: np.ndarray) -> Decoded:
    d, dmin, packed, qh, qs = _fields(raw, 2, 2, 12, 32, 128)
    scale, offset = _k_affine(d, dmin, packed)
    high = np.swapaxes(_bits(qh[..., None]), -1, -2)  # [N, nsb, 8, 32]: bit s of byte l is sub-block s, element l
    return (_k_low(qs) | (high << 4)).reshape(*raw.shape[:-1], 256), scale, offset


def _decode_q6_k(raw: np.ndarray) -> Decoded:
    """Each half of 128 elements: groups g = 0..3 of 32 take low nibbles from bytes 0-31 / 32-63
    of the half's 64 ql bytes (g = 0, 1 low nibbles; g = 2, 3 high nibbles) and 2 high bits
    from bits 2g, 2g + 1 of the half's 32 qh bytes."""
    ql, qh, sc, d = _fields(raw, 128, 64, 16, 2)
    lead = raw.shape[:-1]
    low = _nibbles(ql.reshape(*lead, 2, 64)).reshape(*lead, 2, 4, 32)  # [N, nsb, half, g, 32]
    shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
    high = (qh.reshape(*lead, 2, 1, 32) >> shifts) & 0x03  # [N, nsb, half, g, 32]
    scale = _f16(d)[..., None] * np.ascontiguousarray(sc).view(np.int8).astype(np.float32)  # [N, nsb, 16]
    return (low | (high << 4)).reshape(*lead, 256), scale, None


_Q = GGMLQuantizationType
LAYOUTS: dict[GGMLQuantizationType, Layout] = {
    _Q.Q4_0: Layout(4, 32, 8, _decode_q4_0),
    _Q.Q4_1: Layout(4, 32, 0, _decode_q4_1),
    _Q.Q5_0: Layout(8, 32, 16, _decode_q5_0),
    _Q.Q5_1: Layout(8, 32, 0, _decode_q5_1),
    _Q.Q8_0: Layout(8, 32, 128, _decode_q8_0),
    _Q.Q4_K: Layout(4, 32, 0, _decode_q4_k),
    _Q.Q5_K: Layout(8, 32, 0, _decode_q5_k),
    _Q.Q6_K: Layout(8, 16, 32, _decode_q6_k),
}


def supported_types() -> str:
    return ", ".join(t.name for t in LAYOUTS)


def is_block_type(qtype: GGMLQuantizationType) -> bool:
    """Whether a GGML type stores blocks (quantized), not one plain number per element."""
    return GGML_QUANT_SIZES[qtype][0] > 1


def decode_blocks(raw: np.ndarray, qtype: GGMLQuantizationType) -> BlockQuantized:
    """BlockQuantized of one quantized 2-D tensor: raw uint8 [N, row bytes] as GGUF stores it
    (rows are outputs, each row the K inputs' blocks), in the file's row order."""
    qtype = GGMLQuantizationType(qtype)
    layout = LAYOUTS.get(qtype)
    if layout is None:
        raise FormatError(f"GGUF type {qtype.name} has no exact block form here (supported: {supported_types()})")
    per_block, type_size = GGML_QUANT_SIZES[qtype]
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] % type_size:
        raise FormatError(
            f"{qtype.name} data must be uint8 [N, blocks * {type_size}], got {raw.dtype} {list(raw.shape)}"
        )
    N, nsb = raw.shape[0], raw.shape[1] // type_size
    q, scale, offset = layout.decode(raw.reshape(N, nsb, type_size))
    nb = nsb * per_block // layout.block
    zero = None if layout.zero == 1 << (layout.bits - 1) else np.full((N, nb), layout.zero, np.uint8)
    return BlockQuantized(
        q=np.ascontiguousarray(q.reshape(N, nsb * per_block), np.uint8),
        scale=np.ascontiguousarray(scale.reshape(N, nb), np.float32),
        zero=zero,
        bits=layout.bits,
        block=layout.block,
        offset=None if offset is None else np.ascontiguousarray(offset.reshape(N, nb), np.float32),
    )


# ---------------------------------------------------------------------------------------------
# Names and the q / k row order


def rotary_unpermutation(rows: int, heads: int) -> np.ndarray:
    """int64 [rows]: Hugging Face row r of attn_q / attn_k is GGUF row perm[r].

    llama.cpp's converter stores, per head of 2 * half rows, HF rows (0, half, 1, half + 1, ...)
    (its `permute`); transformers' `_reverse_permute_weights` takes them back."""
    if heads < 1 or rows % (2 * heads):
        raise FormatError(f"{rows} rows do not split into {heads} heads of an even size")
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


def permute_rows(w: BlockQuantized, perm: np.ndarray) -> BlockQuantized:
    """w with its output rows reordered: row r of the result is row perm[r] of w."""
    take = lambda a: None if a is None else np.ascontiguousarray(a[perm])  # noqa: E731
    return BlockQuantized(
        q=take(w.q),
        scale=take(w.scale),
        zero=take(w.zero),
        bits=w.bits,
        block=w.block,
        offset=take(w.offset),
        g_idx=w.g_idx,
    )


def value_head_order(key_heads: int, value_heads: int, dim: int) -> np.ndarray:
    """int64 [value_heads * dim]: Hugging Face index r of a Gated DeltaNet value-head axis is GGUF
    index perm[r].

    Hugging Face groups the value heads by key head (k0v0, k0v1, ..., k1v0, ...); llama.cpp's
    converter (`_reorder_v_heads`) tiles them (k0v0, k1v0, ..., k0v1, k1v1, ...), each head `dim`
    entries wide. Identity when key_heads == value_heads."""
    if key_heads < 1 or value_heads % key_heads:
        raise FormatError(f"{value_heads} value heads do not split over {key_heads} key heads")
    per_key = value_heads // key_heads
    heads = np.arange(value_heads).reshape(per_key, key_heads).T.reshape(value_heads)  # HF head -> GGUF head
    return (heads[:, None] * dim + np.arange(dim)).reshape(value_heads * dim)


def permute_columns(w: BlockQuantized, perm: np.ndarray) -> BlockQuantized | None:
    """w with its inputs reordered (input k of the result is input perm[k] of w) when perm moves
    whole blocks, else None (the blocks would be torn apart)."""
    runs = perm.reshape(-1, w.block)  # [nb, block]: the inputs of each result block
    starts = runs[:, 0]
    if w.g_idx is not None or (starts % w.block).any():
        return None
    if not (runs == starts[:, None] + np.arange(w.block)).all():
        return None
    blocks = starts // w.block
    take = lambda a: None if a is None else np.ascontiguousarray(a[:, blocks])  # noqa: E731
    return BlockQuantized(
        q=np.ascontiguousarray(w.q[:, perm]),
        scale=take(w.scale),
        zero=take(w.zero),
        bits=w.bits,
        block=w.block,
        offset=take(w.offset),
    )
