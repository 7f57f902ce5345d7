"""GPTQ checkpoints (AutoGPTQ / GPTQModel, "gptq" and "gptq_v2" formats) as BlockQuantized weights.

A quantized Linear with N outputs and K inputs is stored as (`P` its module path, codes of `bits`
bits, 32 / bits codes per int32 word, low bits first):

    P.qweight  int32 [K / (32 / bits), N]        codes q[k, n], packed along K
    P.qzeros   int32 [K / group, N / (32 / bits)]  stored zero points, packed along N
    P.scales   fp16  [K / group, N]
    P.g_idx    int32 [K]  (optional)              group of input k; act-order when not k // group
    P.bias     (optional, not quantized: left to the caller with the other plain tensors)

    w[k, n] = scale[g, n] * (q[k, n] - zero[g, n])        g = g_idx[k]

Zero-point convention, from quantization_config's `checkpoint_format` (or `format`, its newer
name; absent = "gptq"):
  "gptq"    (v1, AutoGPTQ and GPTQModel's default export): the stored value is zero - 1, so
            zero = stored + 1. A stored all-ones code would mean zero = 2**bits, which no
            uint8 `bits`-bit zero point holds: FormatError (such checkpoints are already broken
            by AutoGPTQ's packing, which wraps zero 0 to -1).
  "gptq_v2" (GPTQModel's internal format): the stored value is the zero point.
`sym: true` checkpoints must then have every zero point at 2**(bits-1) (a mismatch means the
format label is wrong: FormatError); zero points all at 2**(bits-1) are returned as zero=None,
MatMulNBits's default.

group_size -1 (one group over all of K) maps to one block of K inputs, which MatMulNBits
accepts only when K is a power of two >= 16 (else FormatError).

Keys of the result are `P.weight`, the parameter the float Linear would have; weights are in
Hugging Face orientation [N, K].
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .blocks import BITS, MIN_BLOCK, BlockQuantized, FormatError

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")  # tensors of a quantized Linear consumed here
_ZERO_OFFSET = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what is added to a stored zero point


def gptq_blocks(tensors: Mapping[str, object], config: dict) -> dict[str, BlockQuantized]:
    """BlockQuantized weight [N, K] of every `P.qweight` in `tensors`, keyed `P.weight`.

    tensors: checkpoint tensors by name (numpy arrays or torch tensors); config: the
    quantization_config of config.json (bits, group_size, checkpoint_format, sym)."""
    return {f"{prefix}.weight": gptq_layer(tensors, prefix, config) for prefix in quantized_prefixes(tensors)}


def gptq_layer(tensors: Mapping[str, object], prefix: str, config: dict) -> BlockQuantized:
    """BlockQuantized weight [N, K] of the one quantized Linear at module path `prefix`."""
    bits = check_bits(config.get("bits"), "GPTQ")
    group_size = int(config.get("group_size", 128))
    return _layer(tensors, prefix, bits, group_size, _zero_offset(config), config.get("sym") is True)


def check_bits(bits: object, method: str, allowed: tuple[int, ...] = BITS) -> int:
    if bits not in allowed:
        raise FormatError(f"{method} bits {bits!r} is not supported (MatMulNBits code widths: {allowed})")
    return int(bits)


def _zero_offset(config: dict) -> int:
    fmt = str(config.get("checkpoint_format") or config.get("format") or "gptq").lower()
    if fmt not in _ZERO_OFFSET:
        raise FormatError(f"GPTQ checkpoint_format {fmt!r} is not supported (expected one of {sorted(_ZERO_OFFSET)})")
    return _ZERO_OFFSET[fmt]


def quantized_prefixes(tensors: Mapping[str, object]) -> list[str]:
    """Module paths P of the `P.qweight` tensors, sorted."""
    return sorted(name[: -len(".qweight")] for name in tensors if name.endswith(".qweight"))


def _layer(
    tensors: Mapping[str, object], prefix: str, bits: int, group_size: int, offset: int, sym: bool
) -> BlockQuantized:
    q = unpack_int32(packed_tensor(tensors, f"{prefix}.qweight"), bits, axis=0)  # [K, N] uint8
    K, N = q.shape
    block = block_size(group_size, K, prefix)
    scale = scale_tensor(tensors, f"{prefix}.scales", (K // block, N))  # [K / block, N] float32
    stored = unpack_int32(packed_tensor(tensors, f"{prefix}.qzeros"), bits, axis=1)  # [K / block, N] uint8
    check_shape(stored, (K // block, N), f"{prefix}.qzeros (unpacked)")
    zero = _zero_points(stored, bits, offset, sym, f"{prefix}.qzeros")  # [K / block, N] uint8 or None
    g_idx = _act_order(tensors, f"{prefix}.g_idx", K, block)  # [K] int32 or None
    return make_block(
        prefix, q=q.T, scale=scale.T, zero=None if zero is None else zero.T, bits=bits, block=block, g_idx=g_idx
    )


def _zero_points(stored: np.ndarray, bits: int, offset: int, sym: bool, name: str) -> np.ndarray | None:
    """uint8 zero points from the stored codes [groups, N]; None when all are 2**(bits-1)."""
    zero = stored.astype(np.int32) + offset
    levels = 1 << bits
    if int(zero.max(initial=0)) >= levels:
        raise FormatError(
            f"{name} stores zero point code {levels - 1}, which is {levels} under the 'gptq' (+1) "
            f"convention, outside the {bits}-bit range (a wrapped zero point 0?)"
        )
    mid = levels // 2
    all_mid = bool(np.all(zero == mid))
    if sym and not all_mid:
        raise FormatError(
            f"{name}: sym is true but zero points are not all {mid} after the offset +{offset} "
            f"(is checkpoint_format right?)"
        )
    return None if all_mid else zero.astype(np.uint8)


def _act_order(tensors: Mapping[str, object], name: str, K: int, block: int) -> np.ndarray | None:
    """g_idx [K] int32 when it is not the identity grouping k // block, else None."""
    if name not in tensors:
        return None
    g_idx = to_numpy(tensors[name], name)
    if g_idx.dtype.kind not in "iu":
        raise FormatError(f"{name} must be an integer tensor, got {g_idx.dtype}")
    check_shape(g_idx, (K,), name)
    if np.array_equal(g_idx, np.arange(K) // block):
        return None
    return g_idx.astype(np.int32)


def block_size(group_size: int, K: int, prefix: str) -> int:
    """MatMulNBits block of a layer with K inputs: group_size, or K for group_size -1."""
    block = K if group_size == -1 else group_size
    if block < MIN_BLOCK or block & (block - 1):
        what = f"K = {K} (group_size -1)" if group_size == -1 else f"group_size {group_size}"
        raise FormatError(f"{prefix}: {what} is not a power of two >= {MIN_BLOCK}, which MatMulNBits needs as a block")
    if K % block:
        raise FormatError(f"{prefix}: K = {K} inputs is not a multiple of group_size {block}")
    return block


def unpack_int32(packed: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """uint8 codes from int32 words of 32 / bits codes each, low bits first, unpacked along `axis`.

    packed [A, B] -> [A * 32 / bits, B] (axis 0) or [A, B * 32 / bits] (axis 1)."""
    per = 32 // bits
    words = np.ascontiguousarray(packed).view(np.uint32)  # [A, B]: the sign bit is a code bit
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)  # [per]
    codes = ((words[..., None] >> shifts) & np.uint32((1 << bits) - 1)).astype(np.uint8)  # [A, B, per]
    A, B = words.shape
    if axis == 0:
        return np.ascontiguousarray(codes.transpose(0, 2, 1)).reshape(A * per, B)
    return codes.reshape(A, B * per)


def to_numpy(value: object, name: str) -> np.ndarray:
    """A checkpoint tensor as a numpy array (torch bfloat16, which numpy lacks, as float32)."""
    if isinstance(value, np.ndarray):
        return value
    import torch

    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        return (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    raise FormatError(f"{name} is a {type(value).__name__}, not a numpy array or torch tensor")


def packed_tensor(tensors: Mapping[str, object], name: str) -> np.ndarray:
    """A 2-D int32 (or uint32) tensor of packed codes."""
    value = get_tensor(tensors, name)
    if value.dtype not in (np.int32, np.uint32) or value.ndim != 2:
        raise FormatError(f"{name} must be int32 [rows, cols] packed codes, got {value.dtype} {list(value.shape)}")
    return value


def scale_tensor(tensors: Mapping[str, object], name: str, shape: tuple[int, int]) -> np.ndarray:
    """float32 scales of the given shape (fp16 / bf16 / fp32 in the checkpoint, converted exactly)."""
    value = get_tensor(tensors, name)
    if value.dtype.kind != "f":
        raise FormatError(f"{name} must be a float tensor, got {value.dtype}")
    check_shape(value, shape, name)
    return value.astype(np.float32)


def get_tensor(tensors: Mapping[str, object], name: str) -> np.ndarray:
    if name not in tensors:
        raise FormatError(f"checkpoint has no tensor {name!r}")
    return to_numpy(tensors[name], name)


def check_shape(value: np.ndarray, shape: tuple[int, ...], name: str) -> None:
    if value.shape != shape:
        raise FormatError(f"{name} has shape {list(value.shape)}, expected {list(shape)}")


def make_block(prefix: str, **fields) -> BlockQuantized:
    """BlockQuantized(**fields) with contiguous arrays; its FormatError is prefixed with the layer."""
    arrays = {k: np.ascontiguousarray(v) if isinstance(v, np.ndarray) else v for k, v in fields.items()}
    try:
        return BlockQuantized(**arrays)
    except FormatError as exc:
        raise FormatError(f"{prefix}: {exc}") from exc
