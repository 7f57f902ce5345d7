"""Quantized targets: where each weight of a fused graph comes from and how it is stored.

    precision int8 / int4   every linear weight round-to-nearest quantized (formats/blocks.py
                            rtn_quantize, symmetric) into blocks of `block_size` inputs
    precision gguf          the GGUF file's own blocks (formats/gguf.py), exactly
    precision gptq / awq    the checkpoint's own packed int4/int8 codes (formats/gptq.py, awq.py)

Linear weights become MatMulNBits nodes (nbits.py) at `accuracy_level`; the output head and
the embedding follow their own recipe choice (`head`, `embedding`): fp32, int8 / int4
(round-to-nearest), or `checkpoint` (the checkpoint's blocks when it holds the tensor
quantized, else fp32). A weight the checkpoint holds in float (e.g. a GGUF F16 tensor) stays a
float MatMul, so nothing is ever re-quantized from a dequantized copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import BuildError
from ..formats.blocks import BlockQuantized, compatible, concat_rows, rtn_quantize
from .nbits import gather_nbits, matmul_nbits
from .writer import FloatWeights, Graph, Linear, Part

RTN_PRECISIONS = ("int8", "int4")  # quantized here from float weights
CHECKPOINT_PRECISIONS = ("gguf", "gptq", "awq")  # the checkpoint's own blocks
QUANTIZED_TARGETS = RTN_PRECISIONS + CHECKPOINT_PRECISIONS
TENSOR_MODES = ("fp32", "int8", "int4", "checkpoint")  # head / embedding choices
_BITS = {"int8": 8, "int4": 4}


@dataclass(frozen=True)
class QuantizedWeights:
    """A fused.WeightPlan storing weights as MatMulNBits / GatherBlockQuantized.

    blocks: the checkpoint's quantized tensors by Hugging Face parameter name (empty for int8 /
    int4, which quantize every linear weight here); a streamed checkpoint's mapping decodes one
    tensor when asked (gguf_source.GGUFBlocks, quantized_source), and a GGUF one's `summary()`
    (which types were kept exactly, which dequantized) goes into describe()."""

    precision: str
    block_size: int
    accuracy_level: int
    head_mode: str
    embedding_mode: str
    blocks: Mapping[str, BlockQuantized]

    def _layer(self, part: Part) -> BlockQuantized | None:
        if self.precision in RTN_PRECISIONS:
            return self._rtn(part, _BITS[self.precision])
        return self.blocks.get(part.name)  # None: the checkpoint holds this weight in float

    def _tensor(self, mode: str, part: Part) -> BlockQuantized | None:
        if mode == "fp32":
            return None
        if mode == "checkpoint":
            return self.blocks.get(part.name)
        return self._rtn(part, _BITS[mode])

    def _rtn(self, part: Part, bits: int) -> BlockQuantized:
        name, K = part.name, part.shape[1]
        if K % self.block_size:
            raise BuildError(
                f"block_size {self.block_size} does not divide the {K} inputs of {name!r};"
                f" choose a block size dividing {K} (16, 32 or 64 usually do)"
            )
        return rtn_quantize(part.read().detach().float().numpy(), bits, self.block_size)  # the source's own weights

    def linear(self, g: Graph, x: str, site: Linear) -> str:
        parts = [self._layer(p) for p in site.parts]
        return self._stored(g, x, site, parts)

    def _stored(self, g: Graph, x: str, site: Linear, parts: list[BlockQuantized | None]) -> str:
        if all(p is not None for p in parts) and compatible(parts):  # one node for q|k|v, gate|up
            return matmul_nbits(g, x, concat_rows(parts), site.stem, self.accuracy_level)
        if all(p is None for p in parts):
            return FloatWeights().linear(g, x, site)
        outs = []  # mixed formats: one node per part, outputs concatenated along N
        for j, (part, p) in enumerate(zip(site.parts, parts)):
            one = Linear(f"{site.stem}_{j}", (part,))
            outs.append(
                FloatWeights().linear(g, x, one) if p is None else matmul_nbits(g, x, p, one.stem, self.accuracy_level)
            )
        return g.op("Concat", outs, axis=-1)[0]

    def embedding(self, g: Graph, ids: str, site: Linear) -> tuple[str, str | None]:
        table = self._tensor(self.embedding_mode, site.parts[0])
        if table is None or table.offset is not None or table.g_idx is not None:
            # float rows (GatherBlockQuantized holds no per-block offset: such a table is
            # gathered from its exact float32 dequantization instead)
            return FloatWeights().embedding(g, ids, site)
        return gather_nbits(g, ids, table, site.stem), None

    def head(self, g: Graph, h: str, site: Linear, table: str | None) -> str:
        stored = self._tensor(self.head_mode, site.parts[0])
        if stored is None:
            return FloatWeights().head(g, h, site, table)
        return matmul_nbits(g, h, stored, site.stem, self.accuracy_level)

    def describe(self) -> dict:
        """What the manifest records of the weights (beside the precision)."""
        out = {
            "block_size": self.block_size if self.precision in RTN_PRECISIONS else None,
            "accuracy_level": self.accuracy_level,
            "head": self.head_mode,
            "embedding": self.embedding_mode,
        }
        summary = getattr(self.blocks, "summary", None)  # a GGUF file's: kept exactly / dequantized, by type
        if summary is not None:
            out["checkpoint_tensors"] = summary()
        return out


def checkpoint_formats(blocks: Mapping[str, BlockQuantized]) -> dict[str, int]:
    """{'4-bit block 32 + offset': n, ...}: what a checkpoint's quantized tensors are, for reports."""
    counts: dict[str, int] = {}
    for w in blocks.values():
        key = (
            f"{w.bits}-bit block {w.block}"
            + (" + offset" if w.offset is not None else "")
            + (" act-order" if w.g_idx is not None else "")
        )
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


def weight_bytes(blocks: Mapping[str, BlockQuantized]) -> int:
    """Bytes the blocks take packed (codes + scales + zero points + offsets)."""
    total = 0
    for w in blocks.values():
        N, K = w.shape
        total += N * K * w.bits // 8 + w.scale.nbytes + (0 if w.zero is None else w.zero.size * w.bits // 8)
        total += 0 if w.offset is None else w.offset.nbytes
    return int(total)


__all__ = [
    "CHECKPOINT_PRECISIONS",
    "QUANTIZED_TARGETS",
    "RTN_PRECISIONS",
    "TENSOR_MODES",
    "QuantizedWeights",
    "checkpoint_formats",
    "weight_bytes",
]
