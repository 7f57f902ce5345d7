"""ONNX nodes for block-quantized weights (formats/blocks.py) on ONNX Runtime contrib ops.

    y = x @ W^T, W = scale * (q - zero) + offset       x: [1, S, K] float32 -> y: [1, S, N]

is written as one com.microsoft MatMulNBits (codes, scales, integer zero points), plus, for
formats with a per-block minimum (GGUF Q4_1 / Q4_K / Q5_1 / Q5_K), the term MatMulNBits
cannot hold, which is exact in float32 arithmetic:

    sum_k x_k offset[n, b(k)] = blocksum(x) @ offset^T     blocksum(x): [1, S, nb]

(MatMulNBits with float zero points would hold it too, but runs far slower on the CPU
provider: docs/performance.md, "Quantized targets"). With act-order (GPTQ g_idx) the inputs are gathered into
block order first. Embeddings use GatherBlockQuantized.

Scales and offsets are stored in the graph's float dtype (MatMulNBits needs A's): exact for
fp32 graphs; an fp16 graph (for the CUDA provider) rounds scales that need more than fp16's 11
significant bits (GGUF K-quant products d * sc can).

accuracy_level: 0 / 1 keep the activations in float32 (the layer computes exactly the stored
weights, up to summation order); 4 quantizes the activations to int8 per block (ONNX Runtime's
fast path, as llama.cpp does for its own quantized dot products).
"""

from __future__ import annotations

import numpy as np

from ..formats.blocks import BlockQuantized, pack

MS = "com.microsoft"
ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # MatMulNBits: 0 unset (fp32), 1 fp32, 2 fp16, 3 bf16, 4 int8 activations


def matmul_nbits(g, x: str, w: BlockQuantized, stem: str, accuracy_level: int) -> str:
    """Nodes computing x [.., K] @ w^T -> [.., N] in graph writer `g` (graph_writer.Graph)."""
    w, perm = w.in_order()
    N, K = w.shape
    if perm is not None:  # act-order: x[..., perm] puts each block's inputs next to each other
        (x,) = g.op("Gather", [x, g.const(f"{stem}_perm", perm.astype(np.int64))], axis=-1)
    data, zeros = pack(w)
    inputs = [x, g.const(f"{stem}_q", data), g.const(f"{stem}_scale", w.scale.astype(g.np_dtype))]  # scales: A's dtype
    if zeros is not None:
        inputs.append(g.const(f"{stem}_zp", zeros))
    (y,) = g.op(
        "MatMulNBits", inputs, domain=MS, K=K, N=N, bits=w.bits, block_size=w.block, accuracy_level=accuracy_level
    )
    if w.offset is None:
        return y
    # + blocksum(x) @ offset^T: x [1, S, K] -> [1, S, nb, block] -> sum -> [1, S, nb] @ [nb, N]
    (xb,) = g.op("Reshape", [x, g.const(f"{stem}_blocks", np.array([0, 0, w.blocks, w.block], np.int64))])
    (sums,) = g.op("ReduceSum", [xb, g.const(f"{stem}_axis", np.array([-1], np.int64))], keepdims=0)
    (low,) = g.op("MatMul", [sums, g.const(f"{stem}_offset", np.ascontiguousarray(w.offset.T, g.np_dtype))])
    return g.op("Add", [y, low])[0]


def gather_nbits(g, ids: str, w: BlockQuantized, stem: str) -> str:
    """Embedding rows of `ids` [1, S] from a block-quantized table [V, hidden] -> [1, S, hidden]."""
    if w.offset is not None or w.g_idx is not None:
        raise ValueError("GatherBlockQuantized holds neither per-block offsets nor act-order")
    V, K = w.shape
    data = w.q if w.bits == 8 else (w.q[:, 0::2] | (w.q[:, 1::2] << 4)).astype(np.uint8)  # [V, K * bits / 8]
    inputs = [
        g.const(f"{stem}_q", np.ascontiguousarray(data)),
        ids,
        g.const(f"{stem}_scale", w.scale.astype(g.np_dtype)),
    ]
    if w.zero is not None:
        z = w.zero if w.bits == 8 else _pack_nibbles(w.zero)
        inputs.append(g.const(f"{stem}_zp", z))
    return g.op(
        "GatherBlockQuantized", inputs, domain=MS, bits=w.bits, block_size=w.block, gather_axis=0, quantize_axis=1
    )[0]


def _pack_nibbles(z: np.ndarray) -> np.ndarray:
    """uint8 [V, nb] -> [V, ceil(nb / 2)], element 2i in the low nibble."""
    if z.shape[1] % 2:
        z = np.concatenate([z, np.zeros((z.shape[0], 1), np.uint8)], 1)
    return np.ascontiguousarray(z[:, 0::2] | (z[:, 1::2] << 4), np.uint8)
