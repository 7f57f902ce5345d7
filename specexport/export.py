"""Export a Hugging Face causal LM to one ONNX graph following the graph contract."""

from __future__ import annotations

import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from specexport_runtime import contract
from specexport_runtime.contract import GraphSpec

from .decoder import ContractDecoder

GRAPH_NAME = "model.onnx"
DATA_NAME = "model.onnx.data"
OPSET = 17

# Distinct example sizes so that no dynamic dimension is frozen as a constant while tracing.
_EXAMPLE_S, _EXAMPLE_P, _EXAMPLE_R = 5, 7, 3


@dataclass(frozen=True)
class ExportResult:
    path: Path  # the .onnx file; weights in DATA_NAME beside it
    spec: GraphSpec
    seconds: float
    num_nodes: int
    bytes: int  # graph + external data


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.float16: "float16"}[dtype]


def graph_spec(decoder: ContractDecoder, dtype: torch.dtype) -> GraphSpec:
    return GraphSpec(
        num_layers=len(decoder.layers),
        num_kv_heads=decoder.num_kv_heads,
        head_dim=decoder.head_dim,
        embedding_rows=decoder.embedding_rows,
        kv_dtype=_dtype_name(dtype),
        feature_width=len(decoder.feature_layers) * decoder.hidden_size,
        tree=decoder.tree,
        slots=decoder.slots,
    )


def example_inputs(spec: GraphSpec, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    if spec.slots > 1:  # slot b: S + b rows after a past of P + b (distinct, so that none is frozen)
        K = spec.slots
        counts = torch.arange(_EXAMPLE_S, _EXAMPLE_S + K, dtype=torch.int64)  # slot_rows [K]
        n = int(counts.sum())
        ids = torch.arange(n, dtype=torch.int64).unsqueeze(0) % spec.embedding_rows  # [1, N]
        rows = torch.arange(n - _EXAMPLE_R, n, dtype=torch.int64)  # [R]
        past = [
            torch.randn(1, _EXAMPLE_P + b, spec.num_kv_heads, spec.head_dim, dtype=dtype)
            for _ in range(spec.num_layers)
            for b in range(K)
            for _ in range(2)
        ]
        return (ids, rows, counts, *past)
    ids = torch.arange(_EXAMPLE_S, dtype=torch.int64).unsqueeze(0) % spec.embedding_rows  # [1, S]
    rows = torch.arange(_EXAMPLE_S - _EXAMPLE_R, _EXAMPLE_S, dtype=torch.int64)  # [R]
    past = [
        torch.randn(1, _EXAMPLE_P, spec.num_kv_heads, spec.head_dim, dtype=dtype) for _ in range(2 * spec.num_layers)
    ]
    if not spec.tree:
        return (ids, rows, *past)
    # a tree graph (contract 1.9): a root with S - 1 children, positions [1, S] P, P + 1, ..., bias [S, S]
    depths = torch.ones(_EXAMPLE_S, dtype=torch.int64)
    depths[0] = 0
    allowed = torch.eye(_EXAMPLE_S, dtype=torch.bool)
    allowed[:, 0] = True
    bias = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
    return (ids, rows, (_EXAMPLE_P + depths).unsqueeze(0), bias, *past)


def dynamic_axes(spec: GraphSpec) -> dict[str, dict[int, str]]:
    axes: dict[str, dict[int, str]] = {contract.INPUT_IDS: {1: "seq"}, contract.LOGITS_INDEX: {0: "rows"}}
    if spec.tree:
        axes[contract.POSITION_IDS] = {1: "seq"}
        axes[contract.TREE_BIAS] = {0: "seq", 1: "seq"}
    axes[contract.LOGITS] = {1: "rows"}
    if spec.feature_width:
        axes[contract.HIDDEN_STATES] = {1: "seq"}
    for i in range(spec.num_layers):
        for b in spec.slot_ids:  # a slot's own past and rows (contract 1.10)
            tag = "" if b is None else f"_slot{b}"
            axes[contract.past_key(i, b)] = {1: f"past{tag}"}
            axes[contract.past_value(i, b)] = {1: f"past{tag}"}
            axes[contract.new_key(i, b)] = {1: f"seq{tag}"}
            axes[contract.new_value(i, b)] = {1: f"seq{tag}"}
    return axes


def export_graph(
    model: torch.nn.Module,
    out_dir: Path,
    *,
    tie_lm_head: bool = True,
    feature_layers: tuple[int, ...] = (),
    norm=None,
    tree: bool = False,
    slots: int = 1,
) -> ExportResult:
    """Trace `model` (in its own dtype, fp32 or fp16) into out_dir/model.onnx (+ .data).
    feature_layers: add the `hidden_states` output of those entering layers (ContractDecoder);
    norm: the model's NormalizedConfig (default: normalized from model.config); tree: the
    tree-verify graph (contract 1.9: position_ids, tree_bias inputs); slots: K > 1 cache slots
    (contract 1.10: slot_rows and per-slot caches)."""
    start = time.perf_counter()
    dtype = next(model.parameters()).dtype
    decoder = ContractDecoder(
        model, norm, tie_lm_head=tie_lm_head, feature_layers=feature_layers, tree=tree, slots=slots
    ).eval()
    spec = graph_spec(decoder, dtype)
    proto = trace_module(decoder, example_inputs(spec, dtype), spec, dynamic_axes(spec), out_dir)
    if tie_lm_head:
        _share_tied_embedding(proto)
    _fix_output_dims(proto, spec)
    # a plain portable graph is 1.0's; target features need 1.2, a tree graph 1.9, cache slots 1.10
    version = contract.version_for(contract.TIME_MAJOR, 2 if spec.feature_width else 1, tree=tree, slots=slots)
    return save_traced(proto, spec, version, out_dir, start)


def trace_module(
    module: torch.nn.Module,
    inputs: tuple[torch.Tensor, ...],
    spec: GraphSpec,
    axes: dict[str, dict[int, str]],
    out_dir: Path,
) -> onnx.ModelProto:
    """torch.onnx.export of `module` on `inputs`, named by the contract (spec's input and output
    names); returns the loaded graph (weights inline)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tracer warnings about python ints are expected here
        raw = Path(tmp) / "raw.onnx"
        torch.onnx.export(
            module,
            inputs,
            str(raw),
            input_names=spec.input_names(),
            output_names=spec.output_names(),
            dynamic_axes=axes,
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )
        return onnx.load(str(raw))


def save_traced(
    proto: onnx.ModelProto, spec: GraphSpec, version: str | None, out_dir: Path, start: float
) -> ExportResult:
    """Write a traced time-major graph as out_dir/model.onnx + model.onnx.data with its contract
    metadata (`version`: the contract minor it needs, None for 1.0)."""
    proto.producer_name = "specexport"
    onnx.helper.set_model_props(proto, contract.graph_metadata(contract.TIME_MAJOR, version))
    path, size = write_onnx(proto, out_dir)
    return ExportResult(path, spec, time.perf_counter() - start, len(proto.graph.node), size)


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


def _share_tied_embedding(proto: onnx.ModelProto) -> None:
    """Store a tied embedding once.

    The tracer constant-folds the output projection's transpose into a second [hidden, V]
    initializer. Replace that MatMul by Gemm(transB=1) on the embedding itself (A is the
    [R, hidden] row matrix, so Gemm's 2-D requirement holds) and drop the copy."""
    graph = proto.graph
    inits = {init.name: init for init in graph.initializer}
    gathers = {n.input[0] for n in graph.node if n.op_type == "Gather" and n.input[0] in inits}
    for node in graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        b = inits[node.input[1]]
        for name in gathers:
            emb = inits[name]
            if list(emb.dims) != list(b.dims)[::-1]:
                continue
            if not np.array_equal(numpy_helper.to_array(emb).T, numpy_helper.to_array(b)):
                continue
            node.op_type = "Gemm"
            node.input[1] = name
            node.attribute.append(onnx.helper.make_attribute("transB", 1))
            if not any(n.input and b.name in n.input for n in graph.node):
                graph.initializer.remove(b)
            return


def _fix_output_dims(proto: onnx.ModelProto, spec: GraphSpec) -> None:
    """Declare the contract's output shapes: logits [1, rows, V], hidden_states [1, seq, F],
    new_* [1, seq, H_kv, D] (the tracer names the split outputs' dims with free symbols)."""
    shapes = {contract.LOGITS: (1, "rows", spec.embedding_rows)}
    if spec.feature_width:
        shapes[contract.HIDDEN_STATES] = (1, "seq", spec.feature_width)
    fix_output_dims(proto, shapes, spec)


def fix_output_dims(proto: onnx.ModelProto, shapes: dict[str, tuple], spec: GraphSpec) -> None:
    """Set each graph output's dims to `shapes` (int: fixed, str: symbolic) plus new_* [1, seq, H_kv, D]
    (a slot's [1, seq_slot{b}, H_kv, D])."""
    shapes = dict(shapes)
    for i in range(spec.num_layers):
        for b in spec.slot_ids:  # a slot's rows: seq_slot{b} (contract 1.10)
            for name in (contract.new_key(i, b), contract.new_value(i, b)):
                shapes[name] = (1, "seq" if b is None else f"seq_slot{b}", spec.num_kv_heads, spec.head_dim)
    for output in proto.graph.output:
        dims = output.type.tensor_type.shape.dim
        for dim, value in zip(dims, shapes[output.name]):
            if isinstance(value, int):
                dim.Clear()
                dim.dim_value = value
            else:
                dim.Clear()
                dim.dim_param = value
