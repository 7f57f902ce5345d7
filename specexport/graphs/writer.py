"""Writing ONNX graphs directly (no tracing): a tiny node writer, how weights are stored, saving.

Used by the decoder (decoder_graph.py, both forms), quantized targets (quantized_target.py) and
the EAGLE-3 head (eagle_graph.py). A Graph made with a `DataFile` appends each initializer over 1 KiB to
model.onnx.data as it is made (the writer then holds no weight after writing it); without one it
keeps them in memory until save_graph.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from io import BufferedWriter
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec
from specexport_runtime.manifest import sha256_file

from ..errors import BuildError
from ..models.streaming import Part

OPSET = 17
MS = "com.microsoft"
GRAPH_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"
ONNX_DTYPE = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16}
NP_DTYPE = {torch.float32: np.float32, torch.float16: np.float16}


@dataclass(frozen=True)
class ExportResult:
    path: Path  # the .onnx file; weights in DATA_NAME beside it
    spec: GraphSpec
    seconds: float
    num_nodes: int
    bytes: int  # graph + external data


def write_onnx(proto: onnx.ModelProto, out_dir: Path) -> tuple[Path, int]:
    """Write proto as out_dir/model.onnx with every tensor over 1 KiB in out_dir/model.onnx.data;
    returns the graph's path and the bytes of both files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / GRAPH_NAME
    data = out_dir / DATA_NAME
    data.unlink(missing_ok=True)  # onnx appends to an existing data file
    onnx.save_model(
        proto,
        str(path),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=DATA_NAME,
        size_threshold=1024,
    )
    return path, path.stat().st_size + (data.stat().st_size if data.exists() else 0)


INLINE_BYTES = 1024  # initializers up to this size stay inside model.onnx
ALIGN_FROM, ALIGN = 1 << 20, 1 << 16  # tensors of 1 MiB or more start at a 64 KiB offset (mmap-able)


class DataFile:
    """out_dir/model.onnx.data written as initializers are made: raw little-endian bytes, each
    tensor's (offset, length) recorded in its TensorProto."""

    def __init__(self, out_dir: Path):
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / DATA_NAME
        self._file: BufferedWriter | None = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self.offset = 0

    def tensor(self, name: str, array: np.ndarray) -> TensorProto:
        assert self._file is not None, "data file closed"
        array = np.ascontiguousarray(array)
        if array.nbytes >= ALIGN_FROM and self.offset % ALIGN:
            pad = ALIGN - self.offset % ALIGN
            self._file.write(b"\0" * pad)
            self.offset += pad
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
        t.data_location = TensorProto.EXTERNAL
        for key, value in (("location", DATA_NAME), ("offset", str(self.offset)), ("length", str(array.nbytes))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        self._file.write(memoryview(array.reshape(-1).view(np.uint8)))
        self.offset += array.nbytes
        return t

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@dataclass
class Graph:
    """A tiny ONNX graph writer: unique names, initializers from numpy (streamed to `data`
    when given)."""

    dtype: torch.dtype
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    data: DataFile | None = None
    _n: int = 0

    def name(self, stem: str) -> str:
        self._n += 1
        return f"{stem}_{self._n}"

    def const(self, stem: str, array: np.ndarray) -> str:
        name = self.name(stem)
        if self.data is not None and array.nbytes > INLINE_BYTES:
            self.inits.append(self.data.tensor(name, array))
        else:
            self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def scalar(self, stem: str, value: float) -> str:
        """A float constant in the graph dtype."""
        return self.const(stem, np.array(value, self.np_dtype))

    @property
    def elem(self) -> int:
        """ONNX element type of the graph's float tensors."""
        return ONNX_DTYPE[self.dtype]

    @property
    def dtype_name(self) -> str:
        return "float32" if self.dtype == torch.float32 else "float16"

    @property
    def np_dtype(self) -> type:
        """numpy dtype of the graph's float tensors (activations, scales)."""
        return NP_DTYPE[self.dtype]

    def weight(self, stem: str, tensor: torch.Tensor) -> str:
        """A weight in the graph dtype."""
        return self.const(stem, tensor.detach().to(self.dtype).cpu().numpy())

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", **attrs) -> list[str]:
        names = [self.name(op_type) for _ in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(
            helper.make_node(op_type, inputs, names, name=self.name(f"n_{op_type}"), domain=domain or None, **attrs)
        )
        return names


@dataclass(frozen=True)
class AttentionShape:
    """What every attention site of a graph shares (both operator sets read it)."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float  # on q.k
    softcap: float | None  # scores -> tanh(scores / c) * c
    ropes: dict  # rope key -> (inv_freq [rotary_dim / 2] float32 tensor, attention scaling); {}: none
    rotary_dim: int  # rotated dims of each q/k head (< head_dim: partial rotary)
    windows: tuple[int, ...] = ()  # distinct attention windows of the layers


@dataclass(frozen=True)
class Linear:
    """One weight of the graph: `parts` stacked along the output dimension (q|k|v, gate|up)."""

    stem: str  # initializer name stem, e.g. "l3_qkv"
    parts: tuple[Part, ...]

    @property
    def out_features(self) -> int:
        return sum(p.shape[0] for p in self.parts)


class WeightPlan(Protocol):
    """How the graph stores its weights: float MatMuls (FloatWeights) or block-quantized
    MatMulNBits (quantized_target.QuantizedWeights)."""

    def linear(self, g: Graph, x: str, site: Linear) -> str:
        """x [1, S, K] -> [1, S, N]."""

    def embedding(self, g: Graph, ids: str, site: Linear) -> tuple[str, str | None]:
        """ids [1, S] -> ([1, S, hidden], the float table's initializer name or None); `site`
        holds the table [V, hidden]."""

    def head(self, g: Graph, h: str, site: Linear, table: str | None) -> str:
        """h [R, hidden] -> logits [R, V]; `table`: the float embedding initializer when the head
        is tied to it (a plan may share it), else None."""


class FloatWeights:
    """Weights in the graph dtype: MatMul [K, N] per linear; a tied head is a Gemm on the
    embedding table itself (stored once); an untied head its own [hidden, V] MatMul weight,
    which weight-only quantizers of drafts compress (quantize.py)."""

    def linear(self, g: Graph, x: str, site: Linear) -> str:
        w = torch.cat([p.read().detach() for p in site.parts], 0)  # [N, K]
        return g.op("MatMul", [x, g.weight(site.stem, w.t())])[0]

    def embedding(self, g: Graph, ids: str, site: Linear) -> tuple[str, str | None]:
        table = g.weight(site.stem, site.parts[0].read())
        return g.op("Gather", [table, ids])[0], table

    def head(self, g: Graph, h: str, site: Linear, table: str | None) -> str:
        if table is not None:  # Gemm transB on the embedding itself: the tied matrix is stored (and read) once
            return g.op("Gemm", [h, table], transB=1)[0]
        return self.linear(g, h, site)


def activation(g: Graph, x: str, act: str) -> str:
    if act == "relu2":  # relu(x)^2 (Nemotron-H)
        (r,) = g.op("Relu", [x])
        return g.op("Mul", [r, r])[0]
    if act == "silu":  # x * sigmoid(x); ONNX Runtime fuses the pair
        (s,) = g.op("Sigmoid", [x])
        return g.op("Mul", [x, s])[0]
    if act in ("gelu_pytorch_tanh", "gelu_new"):
        return g.op("FastGelu", [x], domain=MS)[0]
    return g.op("Gelu", [x], domain=MS)[0]  # exact (erf) GELU


def softcap(g: Graph, x: str, cap: float) -> str:
    """tanh(x / cap) * cap."""
    (y,) = g.op("Div", [x, g.scalar("cap", cap)])
    (y,) = g.op("Tanh", [y])
    return g.op("Mul", [y, g.scalar("cap", cap)])[0]


def save_graph(
    g: Graph, name: str, inputs: list, outputs: list, spec: GraphSpec, version: str | None, out_dir: Path, start: float
) -> ExportResult:
    """Write g's nodes as out_dir/model.onnx with external data (model.onnx.data), its contract
    metadata (`version`: the contract minor the graph needs, None for the layout's own)."""
    graph = helper.make_graph(g.nodes, name, inputs, outputs, g.inits)
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)], producer_name="specexport"
    )
    proto.ir_version = 8
    helper.set_model_props(proto, contract.graph_metadata(spec.kv_layout, version))
    if g.data is None:
        path, size = write_onnx(proto, out_dir)
    else:  # the weights are in g.data already
        g.data.close()
        path = out_dir / GRAPH_NAME
        onnx.save_model(proto, str(path))
        size = path.stat().st_size + g.data.path.stat().st_size
    return ExportResult(path, spec, time.perf_counter() - start, len(g.nodes), size)


def share_weights(graph: Path, solo_graph: Path, name: str, what: str) -> str:
    """Move `graph` beside the batch-1 graph as `name` once its weights file is checked to be byte
    for byte the batch-1 graph's (it then reads that file); returns its artifact-relative path.
    what: the option that asked for it, named by the error."""
    data = graph.with_name(graph.name + ".data")
    if sha256_file(data) != sha256_file(solo_graph.with_name(solo_graph.name + ".data")):
        raise BuildError(
            f"the {name} graph's weights differ from {solo_graph.parent.name}/{solo_graph.name}'s; cannot share one"
            f" weights file; build without {what}"
        )
    graph.replace(solo_graph.parent / name)  # its external data location is the same file name
    return f"{solo_graph.parent.name}/{name}"
