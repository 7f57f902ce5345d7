"""Quantized copies of a contract graph (drafts): weight-only 8/4-bit MatMulNBits, dynamic int8.

Quantizers rewrite MatMul nodes only; the graph's inputs, outputs and cache layout are
unchanged, so a quantized graph follows the same contract as its source. Drafts are exported
with an untied [hidden, V] output projection so that it is quantized too (tie_lm_head=False).
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import onnx

from ..recipe.spec import BLOCK_SIZE, BLOCK_SIZES, BLOCKED_PRECISIONS
from .writer import GRAPH_NAME, write_onnx

QUANTIZED_PRECISIONS = ("int8", "int4", "dynamic-int8")
# accuracy_level 4: int8 activations inside MatMulNBits (its fast path also for S >= 2 rows)
ACCURACY_LEVEL = 4


@dataclass(frozen=True)
class QuantizeResult:
    path: Path
    seconds: float
    bytes: int


def quantize_graph(src: Path, out_dir: Path, precision: str, block_size: int = BLOCK_SIZE) -> QuantizeResult:
    """Write a `precision` copy of the graph at `src` into out_dir/model.onnx (+ data).

    block_size: input rows sharing one scale (int8 / int4). Coarser blocks read fewer scales
    per step (a faster draft) at some agreement with the source; dynamic-int8 has none."""
    if precision not in QUANTIZED_PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {QUANTIZED_PRECISIONS}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size {block_size!r} is not one of {BLOCK_SIZES}")
    if precision not in BLOCKED_PRECISIONS and block_size != BLOCK_SIZE:
        raise ValueError(f"block_size applies to {BLOCKED_PRECISIONS} only, not to {precision!r}")
    start = time.perf_counter()
    # onnxruntime's quantizers log every tensor at INFO (root logger and their own loggers)
    loggers = [
        logging.getLogger(name)
        for name in ("", "onnxruntime.quantization", "onnxruntime.quantization.matmul_nbits_quantizer")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        return _quantize(src, out_dir, precision, block_size, start)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _quantize(src: Path, out_dir: Path, precision: str, block_size: int, start: float) -> QuantizeResult:
    if precision == "dynamic-int8":
        from onnxruntime.quantization import QuantType, quantize_dynamic

        with tempfile.TemporaryDirectory() as tmp:
            raw = Path(tmp) / GRAPH_NAME
            quantize_dynamic(
                src,
                raw,
                op_types_to_quantize=["MatMul"],
                weight_type=QuantType.QInt8,
                per_channel=False,
                use_external_data_format=True,
            )
            path, size = write_onnx(onnx.load(str(raw)), out_dir)
    else:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        quantizer = MatMulNBitsQuantizer(
            onnx.load(str(src)),
            bits=8 if precision == "int8" else 4,
            block_size=block_size,
            is_symmetric=True,
            accuracy_level=ACCURACY_LEVEL,
        )
        quantizer.process()
        path, size = write_onnx(quantizer.model.model, out_dir)
    return QuantizeResult(path, time.perf_counter() - start, size)
