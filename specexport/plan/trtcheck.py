"""Static TensorRT compatibility check of contract graphs (no GPU, no TensorRT needed).

    report = check_trt("artifact/target/model.onnx", trt_version="10.3")
    report.ok, report.errors, report.warnings, report.to_dict()
    check_artifact("artifact")          # every graph of the manifest (an EAGLE-3 head too)

What is checked, for the declared TensorRT version:
  * every node's (domain, op_type) is in TensorRT's ONNX operator support matrix for that
    version (the ONNX parser only implements the default ONNX domain; com.microsoft contrib ops
    such as MatMulNBits, and custom domains, need a TensorRT plugin and fail here);
  * the default-domain opset is within the parser's supported range;
  * a few restrictions of supported ops that these graphs can hit (constant axes inputs,
    zero Q/DQ zero points, TopK limits);
  * tensor types: float64 (cast down by TensorRT) and int64 (see INT64 below) are warnings;
    string, complex, 16-bit and unsigned integer tensors are errors; bfloat16/float8/int4 need
    TensorRT >= 9 / 9 / 10;
  * dynamic dimensions: every symbolic input dimension must be one the engine profiles define
    (seq S, past P, rows R; trt_engines.default_profiles), batch is fixed at 1, and no input
    dimension may be unnamed (-1 without a name).

INT64: TensorRT 8.x casts INT64 tensors to INT32 (clamping to +-INT32_MAX); since 9.0 INT64 is
a native type of a subset of layers (shape arithmetic, Gather indices, Cast, ...). Token ids and
positions stay far below 2**31, so int64 inputs and initializers are reported as warnings.

The check reads the graph structure only (external weight data is not loaded), so it takes well
under a second for any model size. It does not replace building the engine on the device
(`python -m specexport_runtime.trt_build ARTIFACT`): TensorRT can still refuse a node for a
reason not modelled here, and the matrix (trt_ops.py) is the documented one, not the parser's code.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, numpy_helper

from specexport_runtime import contract
from specexport_runtime.manifest import read_manifest
from specexport_runtime.trt_build import BuildOptions, resolve_max_gamma
from specexport_runtime.trt_engines import DIMS, STATE_ROWS, Profile, default_profiles

from ..errors import SpecExportError
from .trt_ops import (
    CONSTANT_INPUTS,
    CONTRIB_NOTES,
    DTYPE_ERRORS,
    DTYPE_NAMES,
    DTYPE_SINCE,
    KNOWN_VERSIONS,
    OPSET_RANGES,
    SUPPORTED_OPS,
    SUPPORTED_SINCE,
    UNSUPPORTED_OPS,
)

DEFAULT_TRT_VERSION = "10.3"  # JetPack 6.1/6.2 (Orin; 6.0 has 8.6); Jetson Thor / JetPack 7 ships a newer 10.x
BATCH = 1


class TrtCheckError(SpecExportError, ValueError):
    """The TensorRT version is unknown, or the graph file cannot be read."""


def parse_trt_version(version: str) -> tuple[int, int]:
    """ "10.3" / "10.3.0.30" -> (10, 3); versions older than 8.6 are refused."""
    try:
        parts = [int(p) for p in str(version).split(".")[:2]]
        major, minor = parts[0], parts[1] if len(parts) > 1 else 0
    except (ValueError, IndexError) as exc:
        raise TrtCheckError(f"TensorRT version {version!r} is not of the form MAJOR.MINOR (e.g. 10.3)") from exc
    if (major, minor) < (8, 6):
        raise TrtCheckError(
            f"TensorRT {version} is older than this check knows (8.6, JetPack 6.0, is the oldest);"
            f" known: {', '.join(KNOWN_VERSIONS)}"
        )
    return major, minor


def _v(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def opset_range(version: tuple[int, int]) -> tuple[int, int]:
    best = max(k for k in OPSET_RANGES if k <= version)
    return OPSET_RANGES[best]


def op_support(domain: str, op_type: str, version: tuple[int, int]) -> str | None:
    """None when TensorRT `version` parses (domain, op_type); else the reason it does not."""
    if domain not in ("", "ai.onnx"):
        note = CONTRIB_NOTES.get(op_type, "not an ONNX standard operator: TensorRT needs a plugin for it")
        return f"{domain}::{op_type}: {note}"
    if op_type in UNSUPPORTED_OPS:
        return f"{op_type}: {UNSUPPORTED_OPS[op_type]}"
    if op_type not in SUPPORTED_OPS:
        return f"{op_type}: not in TensorRT's ONNX operator support matrix"
    since = SUPPORTED_SINCE.get(op_type)
    if since and version < _v(since):
        return f"{op_type}: supported from TensorRT {since}, not in {version[0]}.{version[1]}"
    return None


# --------------------------------------------------------------------------- report


@dataclass
class TrtReport:
    graph: str
    trt_version: str
    ok: bool = True
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    opset: int | None = None
    nodes: int = 0
    op_counts: dict[str, int] = field(default_factory=dict)  # "domain::Op" (or "Op") -> nodes
    unsupported: dict[str, int] = field(default_factory=dict)  # same keys, unsupported ones only
    dtype_counts: dict[str, int] = field(default_factory=dict)  # tensors (inputs, initializers, values) per type
    initializers: int = 0
    parameters: int = 0
    dynamic_dims: dict[str, list[str]] = field(default_factory=dict)  # dim name -> inputs using it
    kind: str = contract.DECODER  # the manifest entry's graph kind (check_artifact): decoder or eagle3_head

    def error(self, message: str) -> None:
        self.errors.append(message)
        self.ok = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "graph": self.graph,
            "trt_version": self.trt_version,
            "ok": self.ok,
            "errors": list(self.errors),
            "warnings": list(self.warnings),
            "opset": self.opset,
            "nodes": self.nodes,
            "op_counts": dict(self.op_counts),
            "unsupported": dict(self.unsupported),
            "dtype_counts": dict(self.dtype_counts),
            "initializers": self.initializers,
            "parameters": self.parameters,
            "dynamic_dims": {k: list(v) for k, v in self.dynamic_dims.items()},
            "kind": self.kind,
        }

    def lines(self) -> list[str]:
        head = f"{self.graph}: {'OK' if self.ok else 'NOT BUILDABLE'} for TensorRT {self.trt_version}"
        head += f" ({self.nodes} nodes, {len(self.op_counts)} op types, opset {self.opset})"
        return [head, *(f"  error: {e}" for e in self.errors), *(f"  warning: {w}" for w in self.warnings)]


@dataclass
class ArtifactTrtReport:
    artifact: str
    trt_version: str
    graphs: dict[str, TrtReport] = field(default_factory=dict)  # target / draft -> report

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.graphs.values())

    @property
    def errors(self) -> list[str]:
        return [f"{name}: {e}" for name, r in self.graphs.items() for e in r.errors]

    @property
    def warnings(self) -> list[str]:
        return [f"{name}: {w}" for name, r in self.graphs.items() for w in r.warnings]

    def to_dict(self) -> dict[str, Any]:
        return {
            "artifact": self.artifact,
            "trt_version": self.trt_version,
            "ok": self.ok,
            "graphs": {name: r.to_dict() for name, r in self.graphs.items()},
        }

    def lines(self) -> list[str]:
        out = [f"{self.artifact}: {'OK' if self.ok else 'NOT BUILDABLE'} for TensorRT {self.trt_version}"]
        for name, report in self.graphs.items():
            label = f"{name}, EAGLE-3 head" if report.kind == contract.EAGLE3_HEAD else name
            out += [f"[{label}] {report.lines()[0]}", *report.lines()[1:]]
        return out


# --------------------------------------------------------------------------- the check


def _elem_type(value: onnx.ValueInfoProto) -> int:
    return value.type.tensor_type.elem_type if value.type.HasField("tensor_type") else 0


def _constants(graph: onnx.GraphProto) -> set[str]:
    names = {init.name for init in graph.initializer}
    names.update(out for node in graph.node if node.op_type == "Constant" for out in node.output)
    return names


# inputs whose axis 0 is not the batch: logits_index [R], a tree graph's tree_bias [S, S] (feature
# tree_verify), a hybrid's state_index [Rs] (feature recurrent_state)
_NO_BATCH_AXIS = (contract.LOGITS_INDEX, contract.TREE_BIAS, contract.STATE_INDEX)


def _check_dims(report: TrtReport, graph: onnx.GraphProto, covered: set[str]) -> None:
    init_names = {init.name for init in graph.initializer}
    for value in graph.input:
        if value.name in init_names:
            continue
        tensor = value.type.tensor_type
        if not tensor.HasField("shape"):
            report.error(f"input {value.name!r} has no shape; TensorRT needs a rank for every input")
            continue
        for axis, dim in enumerate(tensor.shape.dim):
            named = dim.HasField("dim_param") and bool(dim.dim_param)
            if axis == 0 and value.name not in _NO_BATCH_AXIS:
                if named or not dim.HasField("dim_value"):
                    report.error(f"input {value.name!r} has a dynamic batch axis; engines are built for batch {BATCH}")
                elif dim.dim_value != BATCH:
                    report.error(f"input {value.name!r} has batch {dim.dim_value}; engines are built for batch {BATCH}")
                continue
            if named:
                report.dynamic_dims.setdefault(dim.dim_param, []).append(value.name)
                if dim.dim_param not in covered:
                    report.error(
                        f"input {value.name!r} axis {axis} is the dynamic dimension {dim.dim_param!r}, which no engine"
                        f" profile defines (profiles define: {', '.join(sorted(covered))})"
                    )
            elif not dim.HasField("dim_value"):
                report.error(f"input {value.name!r} axis {axis} is dynamic without a name; no profile can cover it")


def _check_profiles(report: TrtReport, profiles: Sequence[Profile]) -> set[str]:
    covered = {*DIMS, STATE_ROWS}  # state_index's rows follow seq (trt_engines.input_shapes)
    for profile in profiles:
        if profile.seq[2] < 1 or profile.rows[2] < 1:
            report.error(f"profile {profile.name!r} allows no tokens (seq {profile.seq}, rows {profile.rows})")
    if profiles and max(p.rows[2] for p in profiles) > max(p.seq[2] for p in profiles):
        report.warnings.append("a profile allows more logits rows than input tokens (R > S never happens)")
    return covered


def _only_feeding(graph: onnx.GraphProto, bad_nodes: set[int]) -> set[str]:
    """Tensors consumed only by the given (unsupported) nodes: their types are already moot."""
    users: dict[str, set[int]] = {}
    for index, node in enumerate(graph.node):
        for name in node.input:
            users.setdefault(name, set()).add(index)
    return {name for name, nodes in users.items() if nodes and nodes <= bad_nodes}


def _check_types(report: TrtReport, model: onnx.ModelProto, version: tuple[int, int], skip: set[str]) -> None:
    graph = model.graph
    typed: dict[str, int] = {}
    for value in [*graph.input, *graph.output, *graph.value_info]:
        typed[value.name] = _elem_type(value)
    for init in graph.initializer:
        typed[init.name] = init.data_type
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    typed[node.output[0]] = attr.t.data_type
    counts = Counter(DTYPE_NAMES.get(t, str(t)) for t in typed.values() if t)
    report.dtype_counts = dict(sorted(counts.items()))
    by_type: dict[int, list[str]] = {}
    for name, elem in typed.items():
        if name not in skip:
            by_type.setdefault(elem, []).append(name)
    for elem, label in DTYPE_ERRORS.items():
        if elem in by_type:
            names = by_type[elem]
            report.error(f"{len(names)} {label} tensor(s), a type TensorRT does not support (e.g. {names[0]!r})")
    for elem, (label, since) in DTYPE_SINCE.items():
        if elem in by_type and version < _v(since):
            report.error(f"{len(by_type[elem])} {label} tensor(s): TensorRT supports {label} from {since}")
    if TensorProto.DOUBLE in by_type:
        report.warnings.append(
            f"{len(by_type[TensorProto.DOUBLE])} float64 tensor(s): TensorRT casts DOUBLE down to FLOAT (clamped)"
        )
    if TensorProto.UINT8 in by_type:
        io = {v.name for v in [*graph.input, *graph.output]}
        inner = [n for n in by_type[TensorProto.UINT8] if n not in io]
        if inner:
            message = (
                f"{len(inner)} uint8 tensor(s) inside the graph: TensorRT takes UINT8 only as network"
                " input/output (and, from 10.10, as Q/DQ constants)"
            )
            if version >= (10, 10):
                report.warnings.append(message)
            else:
                report.error(message)
    if TensorProto.INT64 in by_type:
        names = by_type[TensorProto.INT64]
        inputs = [v.name for v in graph.input if _elem_type(v) == TensorProto.INT64]
        inits = [i.name for i in graph.initializer if i.data_type == TensorProto.INT64]
        how = (
            "TensorRT 8.x casts INT64 to INT32, clamping to +-2**31-1"
            if version < (9, 0)
            else "TensorRT >= 9 runs INT64 natively in a subset of layers (shape arithmetic, Gather indices, Cast)"
        )
        report.warnings.append(
            f"int64 tensors: {len(names)} ({len(inputs)} graph inputs: {', '.join(inputs) or 'none'};"
            f" {len(inits)} initializers; the rest shape arithmetic and constants): {how}."
            " Token ids and positions are far below 2**31, so this is safe for these graphs"
        )


def _check_restrictions(report: TrtReport, graph: onnx.GraphProto, version: tuple[int, int]) -> None:
    constants = _constants(graph)
    inits = {init.name: init for init in graph.initializer}
    const_values = {
        node.output[0]: attr.t
        for node in graph.node
        if node.op_type == "Constant"
        for attr in node.attribute
        if attr.name == "value" and attr.HasField("t")
    }
    seen: set[tuple[str, str]] = set()
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        rule = CONSTANT_INPUTS.get(node.op_type)
        if rule is not None:
            index, what, since = rule
            if len(node.input) > index and node.input[index] and node.input[index] not in constants:
                if since is None or version < _v(since):
                    key = (node.op_type, what)
                    if key not in seen:
                        seen.add(key)
                        tail = f" before TensorRT {since}" if since else ""
                        report.warnings.append(
                            f"{node.op_type} {node.name!r}: input {what!r} is computed in the graph; TensorRT needs it"
                            f" to be a build-time constant{tail} (constant folding, e.g. polygraphy surgeon sanitize"
                            " --fold-constants, usually resolves this)"
                        )
        if node.op_type in ("QuantizeLinear", "DequantizeLinear") and len(node.input) > 2 and node.input[2]:
            zp = inits.get(node.input[2]) or const_values.get(node.input[2])
            if zp is None:
                report.warnings.append(
                    f"{node.op_type} {node.name!r}: zero point is not a constant; TensorRT needs zero"
                )
            elif zp.data_location != TensorProto.EXTERNAL and numpy_helper.to_array(zp).any():
                report.error(
                    f"{node.op_type} {node.name!r}: non-zero zero point (TensorRT supports symmetric Q/DQ only)"
                )
        if node.op_type == "TopK":
            for attr in node.attribute:
                if attr.name == "sorted" and attr.i == 0:
                    report.error(f"TopK {node.name!r}: sorted=0 is not supported by TensorRT")


def check_trt(
    graph_path: str | Path, trt_version: str = DEFAULT_TRT_VERSION, profiles: Sequence[Profile] | None = None
) -> TrtReport:
    """Check one ONNX graph against TensorRT `trt_version` (see the module docstring).

    profiles: the engine optimization profiles (trt_engines.Profile); None means the defaults
    trt_build uses (their dimension names are what matters here: seq, past, rows)."""
    version = parse_trt_version(trt_version)
    path = Path(graph_path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - onnx raises several types for unreadable files
        raise TrtCheckError(f"cannot read ONNX graph {str(path)!r}: {exc}") from exc
    try:
        model = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - types of intermediates are a bonus; the op check does not need them
        pass
    report = TrtReport(graph=str(path), trt_version=trt_version)
    if f"{version[0]}.{version[1]}" not in KNOWN_VERSIONS:
        report.warnings.append(
            f"TensorRT {trt_version} is newer than the support matrix recorded here ({KNOWN_VERSIONS[-1]}); using it"
        )
    graph = model.graph
    report.nodes = len(graph.node)
    report.initializers = len(graph.initializer)
    report.parameters = sum(int(_prod(init.dims)) for init in graph.initializer)
    opsets = {imp.domain or "": imp.version for imp in model.opset_import}
    report.opset = opsets.get("", opsets.get("ai.onnx"))
    lo, hi = opset_range(version)
    if report.opset is not None and report.opset > hi:
        report.error(
            f"opset {report.opset} is newer than TensorRT {trt_version} parses (opset {lo}..{hi});"
            " re-export with a lower opset"
        )
    elif report.opset is not None and report.opset < lo:
        report.warnings.append(f"opset {report.opset} is older than TensorRT's documented minimum {lo}")

    counts: Counter[str] = Counter()
    reasons: dict[str, str] = {}
    bad_nodes: set[int] = set()
    for index, node in _nodes(graph):
        key = f"{node.domain}::{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        counts[key] += 1
        reason = op_support(node.domain, node.op_type, version)
        if reason is not None:
            reasons[key] = reason
            bad_nodes.add(index)
    report.op_counts = dict(sorted(counts.items()))
    report.unsupported = {k: counts[k] for k in sorted(reasons)}
    for key in sorted(reasons):
        report.error(f"unsupported operator {reasons[key]} ({counts[key]} node(s))")

    layout = {p.key: p.value for p in model.metadata_props}.get(contract.META_KV_LAYOUT, contract.TIME_MAJOR)
    if layout not in contract.LAYOUTS or contract.LAYOUTS[layout].contrib_attention:  # GroupQueryAttention
        report.error(
            f"the graph uses the {layout} KV layout (a fused graph, ONNX Runtime contrib ops):"
            " TensorRT builds portable graphs; rebuild the artifact with `graph: portable`"
        )
    else:
        covered = _check_profiles(report, profiles if profiles is not None else default_profiles(2048))
        _check_dims(report, graph, covered)
    _check_types(report, model, version, _only_feeding(graph, bad_nodes))
    _check_restrictions(report, graph, version)
    return report


def _nodes(graph: onnx.GraphProto):
    """(top-level index, node) of every node, those of subgraphs (If branches, Scan and Loop
    bodies) under their top-level node's index."""
    for index, node in enumerate(graph.node):
        stack = [node]
        while stack:
            current = stack.pop()
            yield index, current
            for attr in current.attribute:
                subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
                stack.extend(n for sub in subgraphs for n in sub.node)


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= int(d)
    return out


def check_artifact(
    artifact: str | Path, trt_version: str = DEFAULT_TRT_VERSION, profiles: Sequence[Profile] | None = None
) -> ArtifactTrtReport:
    """check_trt on every graph the artifact's manifest lists (a tree graph as "target tree"),
    with the artifact's own profiles."""
    root = Path(artifact)
    manifest = read_manifest(root)
    if profiles is None:
        gamma_max = resolve_max_gamma(manifest, BuildOptions())
        profiles = default_profiles(
            manifest.max_context, max_gamma=min(gamma_max, manifest.max_context - 1), gamma=manifest.speculation.gamma
        )
    report = ArtifactTrtReport(artifact=str(root), trt_version=trt_version)
    for name, entry in (("target", manifest.target), ("draft", manifest.draft)):
        if entry is not None:
            graph = report.graphs[name] = check_trt(root / entry.graph, trt_version, profiles)
            graph.kind = entry.kind
            if entry.kind == contract.EAGLE3_HEAD or entry.feature_width:
                graph.warnings.append(NATIVE_FEATURES_NOTE)
            if entry.tree_graph:
                tree = report.graphs[f"{name} tree"] = check_trt(root / entry.tree_graph, trt_version, profiles)
                tree.kind = entry.kind
                tree.warnings.append(TREE_NOTE)
    return report


# an EAGLE-3 head's features / draft_hidden inputs and hidden_out output, and a target's
# hidden_states output: bound by the native backend (trt_backend.TrtModel.forward), never run on a GPU
NATIVE_FEATURES_NOTE = (
    "EAGLE-3 tensors (features, draft_hidden, hidden_out, hidden_states): the native backend"
    " (trt_build / trt_backend) binds them but has not run on a GPU yet; the ONNX Runtime TensorRT"
    " provider (--provider tensorrt) runs this graph too"
)

# a tree graph (feature tree_verify): the TensorRT backends build no engine for it yet
TREE_NOTE = (
    "tree graph: neither trt_build nor the ONNX Runtime TensorRT provider path runs it yet (tree rounds run"
    " on ONNX Runtime's CPU provider); its position_ids [1, seq] and tree_bias [seq, seq] need a profile"
    " of seq up to the tree's rows"
)
