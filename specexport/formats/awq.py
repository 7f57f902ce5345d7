"""AWQ checkpoints (AutoAWQ's GEMM format, quantization_config "version": "gemm") as BlockQuantized.

A quantized Linear with N outputs and K inputs is stored as (`P` its module path, 4-bit codes,
8 per int32 word, packed along N):

    P.qweight  int32 [K, N / 8]          codes q[k, n]
    P.qzeros   int32 [K / group, N / 8]  zero points z[g, n], same packing
    P.scales   fp16  [K / group, N]
    P.bias     (optional, not quantized: left to the caller with the other plain tensors)

    w[k, n] = scale[g, n] * (q[k, n] - z[g, n])        g = k // group

Packing order: nibble i (bits 4i .. 4i+3) of word c holds column 8c + AWQ_ORDER[i], with
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7] (the interleave AutoAWQ's GEMM kernel reads). Zero points
are stored as they are (no +1, unlike GPTQ v1). The GEMV / GEMV-fast / Marlin layouts and
zero_point: false are not read (FormatError).

Keys of the result are `P.weight`, weights in Hugging Face orientation [N, K].
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .blocks import BlockQuantized, FormatError
from .gptq import (
    block_size,
    check_bits,
    check_shape,
    make_block,
    packed_tensor,
    quantized_prefixes,
    scale_tensor,
    unpack_int32,
)

SUFFIXES = ("qweight", "qzeros", "scales")  # tensors of a quantized Linear consumed here
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8c + AWQ_ORDER[i]
_NIBBLE_OF_COLUMN = np.argsort(AWQ_ORDER)  # column j of a word is nibble [0, 4, 1, 5, 2, 6, 3, 7][j]


def awq_blocks(tensors: Mapping[str, object], config: dict) -> dict[str, BlockQuantized]:
    """BlockQuantized weight [N, K] of every `P.qweight` in `tensors`, keyed `P.weight`.

    tensors: checkpoint tensors by name (numpy arrays or torch tensors); config: the
    quantization_config of config.json (bits, group_size, version, zero_point; AutoAWQ's own
    names w_bit and q_group_size are read too)."""
    check_config(config)
    return {f"{prefix}.weight": awq_layer(tensors, prefix, config) for prefix in quantized_prefixes(tensors)}


def check_config(config: dict) -> None:
    """FormatError unless quantization_config describes a 4-bit zero-point GEMM checkpoint."""
    check_bits(_field(config, "bits", "w_bit"), "AWQ", allowed=(4,))
    _check_version(config)
    if config.get("zero_point", True) is not True:
        raise FormatError(
            f"AWQ zero_point {config.get('zero_point')!r} is not supported (only zero-point GEMM checkpoints)"
        )


def awq_layer(tensors: Mapping[str, object], prefix: str, config: dict) -> BlockQuantized:
    """BlockQuantized weight [N, K] of the one quantized Linear at module path `prefix`."""
    return _layer(tensors, prefix, int(_field(config, "group_size", "q_group_size", 128)))


def _field(config: dict, name: str, alias: str, default: object = None) -> object:
    return config.get(name, config.get(alias, default))


def _check_version(config: dict) -> None:
    version = str(config.get("version") or config.get("format") or "gemm").lower()
    if version != "gemm":
        raise FormatError(f"AWQ version {version!r} is not supported (only 'gemm')")


def _layer(tensors: Mapping[str, object], prefix: str, group_size: int) -> BlockQuantized:
    q = unpack_awq(packed_tensor(tensors, f"{prefix}.qweight"))  # [K, N] uint8
    K, N = q.shape
    block = block_size(group_size, K, prefix)
    zero = unpack_awq(packed_tensor(tensors, f"{prefix}.qzeros"))  # [K / block, N] uint8
    check_shape(zero, (K // block, N), f"{prefix}.qzeros (unpacked)")
    scale = scale_tensor(tensors, f"{prefix}.scales", (K // block, N))  # [K / block, N] float32
    return make_block(prefix, q=q.T, scale=scale.T, zero=zero.T, bits=4, block=block)


def unpack_awq(packed: np.ndarray) -> np.ndarray:
    """uint8 codes [R, 8C] in column order from int32 words [R, C] packed in AWQ_ORDER."""
    nibbles = unpack_int32(packed, 4, axis=1)  # [R, 8C]: nibble order within each word
    R, cols = nibbles.shape
    return nibbles.reshape(R, cols // 8, 8)[:, :, _NIBBLE_OF_COLUMN].reshape(R, cols)
