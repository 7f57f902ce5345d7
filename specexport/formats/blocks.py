"""Block-quantized weights: the one in-memory form every quantized format is mapped onto.

A linear layer's weight W [N, K] (Hugging Face orientation: N outputs, K inputs) is stored in
blocks of `block` consecutive inputs per output row, each block with a float scale, an integer
zero point and, for formats that store a per-block minimum (GGUF Q4_1, Q4_K), a float offset:

    W[n, k] = scale[n, b] * (q[n, k] - zero[n, b]) + offset[n, b]      b = group[k]

where group[k] = k // block unless the format reorders inputs (GPTQ act-order: `g_idx`).
This is ONNX Runtime's MatMulNBits layout (codes of `bits` bits, packed low-first along K,
one scale and zero point per block), plus the offset, which MatMulNBits cannot hold and the
graph adds as blocksum(x) @ offset^T (specexport/graphs/nbits.py).

Loaders (gguf.py, gptq.py, awq.py) return BlockQuantized weights holding the checkpoint's
codes and scales exactly; `rtn_quantize` makes one from a float weight (the int8 / int4
recipe precisions).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import BuildError

BITS = (4, 8)  # code widths MatMulNBits runs on the CPU provider
MIN_BLOCK = 16  # MatMulNBits: a power of two >= 16


class FormatError(BuildError, ValueError):
    """A quantized tensor does not have the shape, type or values its format requires."""


@dataclass(frozen=True, eq=False)
class BlockQuantized:
    """W [N, K] = scale * (q - zero) + offset, per block of inputs (module docstring)."""

    q: np.ndarray  # uint8 [N, K]: unpacked codes in [0, 2**bits)
    scale: np.ndarray  # float32 [N, nb]: nb = K / block
    zero: np.ndarray | None  # uint8 [N, nb]; None = 2**(bits - 1), MatMulNBits's default
    bits: int
    block: int
    offset: np.ndarray | None = None  # float32 [N, nb]: per-block minimum (Q4_1 / Q4_K); None = 0
    g_idx: np.ndarray | None = None  # int32 [K]: block of input k (GPTQ act-order); None = k // block

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise FormatError(f"bits {self.bits!r} is not one of {BITS}")
        if self.block < MIN_BLOCK or self.block & (self.block - 1):
            raise FormatError(f"block {self.block!r} is not a power of two >= {MIN_BLOCK}")
        if self.q.dtype != np.uint8 or self.q.ndim != 2:
            raise FormatError(f"q must be uint8 [N, K], got {self.q.dtype} {list(self.q.shape)}")
        N, K = self.q.shape
        if K % self.block:
            raise FormatError(f"K = {K} inputs is not a multiple of block {self.block}")
        if int(self.q.max(initial=0)) >= 1 << self.bits:
            raise FormatError(
                f"codes reach {int(self.q.max())}, above the {self.bits}-bit range 0..{(1 << self.bits) - 1}"
            )
        nb = K // self.block
        for name in ("scale", "zero", "offset"):
            value = getattr(self, name)
            if value is not None and value.shape != (N, nb):
                raise FormatError(f"{name} must have shape [N, K / block] = {[N, nb]}, got {list(value.shape)}")
        if self.scale.dtype != np.float32 or (self.offset is not None and self.offset.dtype != np.float32):
            raise FormatError("scale and offset must be float32")
        if self.zero is not None and (self.zero.dtype != np.uint8 or int(self.zero.max(initial=0)) >= 1 << self.bits):
            raise FormatError(f"zero must be uint8 codes in 0..{(1 << self.bits) - 1}")
        if self.g_idx is not None:
            if self.g_idx.shape != (K,) or self.g_idx.min(initial=0) < 0 or self.g_idx.max(initial=0) >= nb:
                raise FormatError(f"g_idx must be [K] = [{K}] block indices in 0..{nb - 1}")
            if np.bincount(self.g_idx, minlength=nb).max() != self.block:
                raise FormatError(f"g_idx must put exactly {self.block} inputs in every block")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape  # [N, K]

    @property
    def blocks(self) -> int:
        return self.q.shape[1] // self.block

    def zeros(self) -> np.ndarray:
        """uint8 [N, nb] zero points, the default filled in."""
        if self.zero is not None:
            return self.zero
        return np.full(self.scale.shape, 1 << (self.bits - 1), np.uint8)

    def group(self) -> np.ndarray:
        """int64 [K]: the block of each input."""
        if self.g_idx is not None:
            return self.g_idx.astype(np.int64)
        return np.arange(self.q.shape[1]) // self.block

    def dequantize(self) -> np.ndarray:
        """float32 [N, K], computed in float32 as scale * (q - zero) + offset."""
        if self.g_idx is None:  # blocks of consecutive inputs: the same operations, broadcast per block
            N, K = self.q.shape
            codes = self.q.reshape(N, self.blocks, self.block).astype(np.float32)  # [N, nb, block]
            codes -= self.zeros().astype(np.float32)[..., None]
            codes *= self.scale[..., None]
            if self.offset is not None:
                codes += self.offset[..., None]
            return codes.reshape(N, K)
        g = self.group()
        codes = self.q.astype(np.float32) - self.zeros().astype(np.float32)[:, g]
        w = self.scale[:, g] * codes
        if self.offset is not None:
            w = w + self.offset[:, g]
        return w.astype(np.float32)

    def in_order(self) -> tuple[BlockQuantized, np.ndarray | None]:
        """(weight whose blocks are consecutive inputs, input permutation or None).

        With act-order (g_idx), inputs are permuted so each block is contiguous: the layer
        computes x[..., perm] @ W'^T, which equals x @ W^T exactly (a permutation of a sum)."""
        if self.g_idx is None or np.array_equal(self.g_idx, np.arange(self.q.shape[1]) // self.block):
            return (self if self.g_idx is None else _replace(self, g_idx=None)), None
        perm = np.argsort(self.g_idx, kind="stable")
        return _replace(self, q=np.ascontiguousarray(self.q[:, perm]), g_idx=None), perm


def _replace(w: BlockQuantized, **changes) -> BlockQuantized:
    fields = dict(q=w.q, scale=w.scale, zero=w.zero, bits=w.bits, block=w.block, offset=w.offset, g_idx=w.g_idx)
    fields.update(changes)
    return BlockQuantized(**fields)


def concat_rows(parts: list[BlockQuantized]) -> BlockQuantized:
    """Stack weights along N (q|k|v, gate|up) into one; they must share bits, block, inputs
    and the presence of zero points / offsets, and have no act-order (see `compatible`)."""
    if not compatible(parts):
        raise FormatError(
            "weights differ in bits, block, K, zero points, offsets or act-order; they cannot share one node"
        )
    first = parts[0]
    if len(parts) == 1:
        return first
    cat = lambda name: None if getattr(first, name) is None else np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    return BlockQuantized(
        q=np.concatenate([p.q for p in parts]),
        scale=np.concatenate([p.scale for p in parts]),
        zero=_cat_zero(parts),
        bits=first.bits,
        block=first.block,
        offset=cat("offset"),
    )


def _cat_zero(parts: list[BlockQuantized]) -> np.ndarray | None:
    if all(p.zero is None for p in parts):
        return None
    return np.concatenate([p.zeros() for p in parts])


def compatible(parts: list[BlockQuantized]) -> bool:
    """Whether `parts` can be stacked along N into one MatMulNBits (concat_rows)."""
    first = parts[0]
    return all(
        p.bits == first.bits
        and p.block == first.block
        and p.q.shape[1] == first.q.shape[1]
        and (p.offset is None) == (first.offset is None)
        and p.g_idx is None
        for p in parts
    )


CHUNK_VALUES = 1 << 24  # float32 values rtn_quantize works on at once


def rtn_quantize(w: np.ndarray, bits: int, block: int, symmetric: bool = True) -> BlockQuantized:
    """Round-to-nearest block quantization of a float weight [N, K].

    symmetric: zero point 2**(bits-1), scale = the block's largest-magnitude value / -2**(bits-1),
    so that value maps to code 0 and the codes span the full range (GGUF Q4_0 / Q8_0 do the same).
    asymmetric: zero point and scale from the block's min and max (codes 0..2**bits - 1)."""
    w = np.asarray(w, np.float32)
    if w.ndim != 2:
        raise FormatError(f"weight must be [N, K], got shape {list(w.shape)}")
    N, K = w.shape
    if bits not in BITS:
        raise FormatError(f"bits {bits!r} is not one of {BITS}")
    if block < MIN_BLOCK or block & (block - 1) or K % block:
        raise FormatError(f"block {block!r} must be a power of two >= {MIN_BLOCK} dividing K = {K}")
    rows = max(1, CHUNK_VALUES // K)  # rows quantized at a time: the temporaries stay ~64 MB
    if N > rows:
        parts = [rtn_quantize(w[i : i + rows], bits, block, symmetric) for i in range(0, N, rows)]
        zero = None if symmetric else np.concatenate([p.zero for p in parts])
        return BlockQuantized(
            q=np.concatenate([p.q for p in parts]),
            scale=np.concatenate([p.scale for p in parts]),
            zero=zero,
            bits=bits,
            block=block,
        )
    levels = 1 << bits
    blocks = w.reshape(N, K // block, block)  # [N, nb, block]
    if symmetric:
        lo, hi = blocks.min(-1), blocks.max(-1)
        extreme = np.where(-lo > hi, lo, hi)  # the largest-magnitude value, with its sign
        scale = extreme / -(levels // 2)
        zero = None
        zp = levels // 2
    else:
        lo, hi = np.minimum(blocks.min(-1), 0), np.maximum(blocks.max(-1), 0)
        scale = (hi - lo) / (levels - 1)
        safe = np.where(scale == 0, 1, scale)
        zp = np.clip(np.round(-lo / safe), 0, levels - 1)
        zero = zp.astype(np.uint8)
        zp = zp[..., None]
    inv = np.where(scale == 0, 0, 1 / np.where(scale == 0, 1, scale))
    q = np.clip(np.round(blocks * inv[..., None]) + zp, 0, levels - 1).astype(np.uint8)
    return BlockQuantized(q=q.reshape(N, K), scale=scale.astype(np.float32), zero=zero, bits=bits, block=block)


def pack(w: BlockQuantized) -> tuple[np.ndarray, np.ndarray | None]:
    """MatMulNBits initializers of an in-order weight: B uint8 [N, nb, block * bits / 8] (codes
    packed low-first along K) and zero points uint8 [N, ceil(nb * bits / 8)] or None (default)."""
    if w.g_idx is not None:
        raise FormatError("pack needs an in-order weight (BlockQuantized.in_order)")
    N, K = w.q.shape
    q = w.q.reshape(N, w.blocks, w.block)
    if w.bits == 8:
        data = q
        zeros = w.zero
    else:
        data = q[..., 0::2] | (q[..., 1::2] << 4)
        zeros = None
        if w.zero is not None:
            z = w.zero if w.blocks % 2 == 0 else np.concatenate([w.zero, np.zeros((N, 1), np.uint8)], 1)
            zeros = z[:, 0::2] | (z[:, 1::2] << 4)
    return np.ascontiguousarray(data, np.uint8), None if zeros is None else np.ascontiguousarray(zeros, np.uint8)
