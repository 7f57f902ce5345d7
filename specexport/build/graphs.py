"""`specexport build`, the graphs: the target exported and validated against its float32 reference
with its row invariance measured (the padding a bitwise target needs), the draft graph exported
(or quantized) from a draft model or a copy of the target, and each graph's manifest entry.
"""

from __future__ import annotations

import gc
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specexport_runtime.manifest import ModelEntry

from ..errors import BuildError
from ..graphs.decoder import build_decoder
from ..graphs.quantize import ACCURACY_LEVEL, QUANTIZED_PRECISIONS, quantize_graph
from ..graphs.quantized_target import QuantizedWeights
from ..graphs.writer import ExportResult, share_weights
from ..models.config import NormalizedConfig
from ..models.sources import ModelSource
from ..recipe.spec import BLOCK_SIZE, BLOCKED_PRECISIONS, QUANTIZED_TARGETS, ModelSpec, Recipe
from .validate import FP16, FP32, QUANTIZED, QUANTIZED_TARGET, validate_export, validate_long_range

if TYPE_CHECKING:
    from .load import LoadedModels
    from .progress import Progress


def _dtype(precision: str) -> torch.dtype:
    return torch.float16 if precision == "fp16" else torch.float32


@dataclass(frozen=True)
class Padding:
    """How a graph keeps its rows independent of its call's size (feature row_padding)."""

    min_rows: int = 1  # the runtime pads every call to this many rows
    cache_pad: int = 0  # the fused graph pads its attention by this many rows itself

    def describe(self) -> str:
        if self.cache_pad:
            return "padded attention"
        return "padded calls" if self.min_rows > 1 else "no padding"


# what a bitwise target tries, cheapest first: the fused graph's padded attention keeps its
# 1-row calls (fast MatMul paths); padded calls are the general fallback (docs/graph-contract.md)
BITWISE_FUSED = (Padding(cache_pad=1), Padding(min_rows=2))
BITWISE_PORTABLE = (Padding(), Padding(min_rows=2))


def _export(
    recipe: Recipe,
    model,
    out_dir: Path,
    tie_lm_head: bool = True,
    padding: Padding = Padding(),
    weights=None,
    features: tuple[int, ...] = (),
    norm: NormalizedConfig | None = None,
    slots: int = 1,
    dtype: torch.dtype = torch.float32,
    progress: Progress | None = None,
) -> ExportResult:
    """The recipe's graph form (its KV layout picks the operators: decoder_graph.py), written one
    weight at a time in `dtype`; slots > 1: the batch graph (features cache_slots, idle_slots)."""
    return build_decoder(
        model,
        out_dir,
        recipe.max_context,
        kv_layout=recipe.layout.name,
        tie_lm_head=tie_lm_head,
        weights=weights,
        min_rows=padding.min_rows,
        pad_attention=padding.cache_pad > 0,
        feature_layers=features,
        norm=norm,
        slots=slots,
        dtype=dtype,
        on_layer=_layer_progress(progress) if progress else None,
    )


def _layer_progress(progress: Progress):
    """on_layer for build_decoder: a line every tenth of the layers (and the last)."""

    def on_layer(i: int, n: int) -> None:
        if (i + 1) % max(1, n // 10) == 0 or i + 1 == n:
            progress(f"  wrote layer {i + 1}/{n}")

    return on_layer


def _target_weights(spec: ModelSpec, blocks: dict, reference) -> QuantizedWeights | None:
    q = spec.quantization
    if spec.precision not in QUANTIZED_TARGETS or q is None:
        return None
    return QuantizedWeights(spec.precision, q.block_size or BLOCK_SIZE, q.accuracy_level, q.head, q.embedding, blocks)


@dataclass(frozen=True)
class BatchGraph:
    """A target's or draft's batch graph (feature cache_slots), next to its batch-1 graph and sharing its
    weights file."""

    graph: str  # relative to the artifact root
    slots: int
    rows: dict  # rowcheck.BatchRowReport.to_dict(); {} when not measured (a draft, or no validation)


BATCH_GRAPH = "batch.onnx"


@dataclass(frozen=True)
class TargetExport:
    result: ExportResult
    validation: dict  # {} when not validated
    exactness: str | None  # measured; None when not validated
    padding: Padding
    batch: BatchGraph | None = None
    tree: str | None = None  # the tree-verify graph (feature tree_verify), artifact-relative


def export_target(
    recipe: Recipe,
    reference,
    blocks: dict,
    out_dir: Path,
    probe: list[int],
    validate: bool,
    progress: Progress,
    features: tuple[int, ...] = (),
    norm: NormalizedConfig | None = None,
) -> TargetExport:
    """Export the target, validate it against the float32 reference and measure its row
    invariance. exactness bitwise: the paddings of BITWISE_* in turn until one measures bitwise
    (the last is kept, measured numerical, when none does); numerical: no padding."""
    spec = recipe.target
    weights = _target_weights(spec, blocks, reference)
    fp16 = spec.precision == "fp16" or (spec.quantization is not None and spec.quantization.dtype == "fp16")
    dtype = torch.float16 if fp16 else torch.float32
    # padded attention is GroupQueryAttention's (the fused form)
    tries = (
        (Padding(),)
        if spec.exactness != "bitwise"
        else BITWISE_FUSED
        if recipe.layout.contrib_attention
        else BITWISE_PORTABLE
    )
    if not validate:  # nothing measured: the first (cheapest) padding of the recipe's choice
        result = _export(
            recipe,
            reference,
            out_dir,
            padding=tries[0],
            weights=weights,
            features=features,
            norm=norm,
            dtype=dtype,
            progress=progress,
        )
        batch = export_batch(recipe, reference, result, tries[0], weights, norm, None, dtype)
        tree = export_tree(recipe, reference, result, tries[0], weights, norm, None, features, dtype)
        return TargetExport(result, {}, None, tries[0], batch, tree and tree.graph)
    for padding in tries:
        result = _export(
            recipe,
            reference,
            out_dir,
            padding=padding,
            weights=weights,
            features=features,
            norm=norm,
            dtype=dtype,
            progress=progress,
        )
        rows = measure_rows(result.path, result.spec, recipe.max_context, padding, probe)
        gc.collect()  # its session (the weights repacked: 5.9 GB for a 1B fp32 target) goes now
        if rows.bitwise:
            break
        if spec.exactness == "bitwise":
            progress(
                f"target rows depend on the call size with {padding.describe()} (max |diff| {rows.max_abs_diff:.3g})"
            )
    tol_class = _target_tolerance(spec)
    tol = QUANTIZED_TARGET[tol_class] if tol_class else FP16 if spec.precision == "fp16" else FP32
    report = validate_export(reference, result.path, result.spec, probe, tol).to_dict()
    report["tolerance"] = tol.to_dict()
    length = max(norm.long_range_length(recipe.max_context) if norm else 0, min(recipe.max_context, LONG_PROBE_TOKENS))
    if length > len(probe):  # past every window, within max_context
        progress(f"validating the target over a {length}-token probe")
        report["long_range"] = {
            "tokens": length,
            **validate_long_range(reference, result.path, result.spec, probe, length, tol).to_dict(),
        }
    if weights is not None:
        source = (
            "the same weights dequantized" if tol_class == "checkpoint" else "the float weights it was quantized from"
        )
        report["note"] = (
            f"{spec.precision} target against its float32 reference ({source}): tolerance"
            f" {tol_class} (docs/validation.md), argmax agreement reported"
        )
        report["weights"] = weights.describe()
    report["rows"] = {**rows.to_dict(), "padding": padding.describe()}
    batch = export_batch(recipe, reference, result, padding, weights, norm, probe, dtype)
    if batch is not None:
        report["batch_rows"] = batch.rows
        if batch.rows["exactness"] != rows.exactness:
            progress(f"warning: the batch graph's rows are {batch.rows['exactness']} (batch-1: {rows.exactness})")
    tree = export_tree(recipe, reference, result, padding, weights, norm, probe, features, dtype)
    if tree is not None:
        report["tree_rows"] = tree.rows
    return TargetExport(result, report, rows.exactness, padding, batch, tree and tree.graph)


def export_batch(
    recipe: Recipe,
    model,
    solo: ExportResult,
    padding: Padding,
    weights,
    norm,
    probe: list[int] | None,
    dtype: torch.dtype = torch.float32,
) -> BatchGraph | None:
    """The batch graph of recipe.max_batch slots as target/batch.onnx beside the batch-1 graph,
    reading the same weights file (checked byte for byte), and with a probe its rows measured
    against the batch-1 graph's (rowcheck.batch_rows). None when max_batch is 1."""
    K = recipe.max_batch
    if K < 2:
        return None
    out_dir = solo.path.parent
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as scratch:
        result = _export(
            recipe, model, Path(scratch), padding=padding, weights=weights, norm=norm, slots=K, dtype=dtype
        )
        share_weights(result.path, solo.path, BATCH_GRAPH, f"max_batch {K}")
    rows = {} if probe is None else measure_batch_rows(solo, out_dir / BATCH_GRAPH, K, recipe, padding, probe)
    return BatchGraph(f"{out_dir.name}/{BATCH_GRAPH}", K, rows)


@dataclass(frozen=True)
class TreeGraph:
    """A target's tree-verify graph (feature tree_verify) beside its batch-1 graph, sharing
    its weights file."""

    graph: str  # relative to the artifact root
    rows: dict  # rowcheck.tree_rows(...).to_dict(); {} when not measured


TREE_GRAPH = "tree.onnx"


def export_tree(
    recipe: Recipe,
    model,
    solo: ExportResult,
    padding: Padding,
    weights,
    norm,
    probe: list[int] | None,
    features: tuple[int, ...] = (),
    dtype: torch.dtype = torch.float32,
) -> TreeGraph | None:
    """The tree-verify graph as target/tree.onnx (recipe.tree_verify), reading the batch-1
    graph's weights file, with the batch-1 graph's feature layers (what an EAGLE-3 head reads
    after a tree round), and with a probe its rows measured against the batch-1 graph's
    (rowcheck.tree_rows). None without tree_verify. The recipe's graph form: fused
    (GroupQueryAttention) or portable (standard ops, time_major)."""
    if not recipe.tree_verify:
        return None
    with tempfile.TemporaryDirectory(dir=solo.path.parent.parent) as scratch:
        rows = recipe.max_context + padding.min_rows - 1 + padding.cache_pad  # the batch-1 graph's rotary tables
        result = build_decoder(
            model,
            Path(scratch),
            recipe.max_context,
            kv_layout=recipe.layout.name,
            weights=weights,
            norm=norm,
            tree=True,
            table_rows=rows,
            feature_layers=features,
            dtype=dtype,
        )
        rel = share_weights(result.path, solo.path, TREE_GRAPH, "tree_verify")
    if probe is None:
        return TreeGraph(rel, {})
    from .rowcheck import tree_rows

    path = solo.path.parent / TREE_GRAPH
    report = tree_rows(solo, path, recipe.max_context, probe, padding.min_rows, padding.cache_pad).to_dict()
    if report["argmax_agreement"] < 1.0:  # greedy trees would leave target-only output on such rows
        raise BuildError(
            f"tree_verify: the tree graph's rows agree with the batch-1 graph's argmax on only"
            f" {report['argmax_agreement']:.0%} of {report['rows']} rows (max |logit diff|"
            f" {report['max_abs_diff']:.3g}), so trees would change greedy output; build without tree_verify"
        )
    return TreeGraph(rel, report)


def measure_batch_rows(solo: ExportResult, path: Path, slots: int, recipe: Recipe, padding: Padding, probe) -> dict:
    from specexport_runtime.engine import OrtModel, SessionConfig
    from specexport_runtime.slots import SlotModel

    from .rowcheck import batch_rows

    config = SessionConfig(provider="cpu")
    one = OrtModel(
        solo.path, solo.spec, recipe.max_context, config, min_rows=padding.min_rows, cache_pad=padding.cache_pad
    )
    many = SlotModel(
        path,
        replace(solo.spec, slots=slots),
        recipe.max_context,
        config,
        max_rows=9,
        cache_pad=padding.cache_pad,
        min_rows=padding.min_rows,
    )
    n = 5 + slots
    tokens = (probe * (n // len(probe) + 1))[:n]
    return batch_rows(one, many, probe[: max(2, len(probe) // 2)], tokens).to_dict()


LONG_PROBE_TOKENS = 256  # the long-range probe of a model without windows (within max_context)


def _target_tolerance(spec: ModelSpec) -> str | None:
    """The QUANTIZED_TARGET class of a quantized target (None: a float target): round-to-nearest
    int4 anywhere (layers, head, embedding) makes it int4, then int8; else the checkpoint's own
    blocks, compared with their exact dequantization."""
    q = spec.quantization
    if spec.precision not in QUANTIZED_TARGETS or q is None:
        return None
    modes = {spec.precision if spec.precision in ("int8", "int4") else "checkpoint", q.head, q.embedding}
    return "int4" if "int4" in modes else "int8" if "int8" in modes else "checkpoint"


def measure_rows(path: Path, spec, max_context: int, padding: Padding, probe: list[int]):
    """rowcheck.row_invariance of a graph on the CPU provider, as the runtime will call it."""
    from specexport.build.rowcheck import DEFAULT_SIZES, row_invariance
    from specexport_runtime.engine import OrtModel, SessionConfig

    n = max(DEFAULT_SIZES)
    tokens = (probe * (n // len(probe) + 1))[:n]  # the probe, repeated if short
    model = OrtModel(
        path, spec, max_context, SessionConfig(provider="cpu"), min_rows=padding.min_rows, cache_pad=padding.cache_pad
    )
    return row_invariance(model, probe[: len(probe) // 2], tokens)


def export_draft(
    recipe: Recipe, m: LoadedModels, root: Path, probe: list[int], vocab: int, validate: bool
) -> ModelEntry:
    """A draft graph (a draft model, or a copy of the target) at the recipe's draft precision:
    quantized ones are written quantized (fused: the writer's round-to-nearest MatMulNBits, one
    weight at a time; portable and dynamic-int8: exported float, then quantized), their
    agreement reported, not required; float ones validated like a target. With max_batch > 1 it
    gets a batch graph too, draft/batch.onnx on the same weights file."""
    precision = recipe.draft.precision
    base, norm = (m.draft, m.draft_norm) if m.draft is not None else (m.reference, m.norm)
    block = recipe.draft.block_size or BLOCK_SIZE

    def write(out: Path, slots: int):
        if precision in BLOCKED_PRECISIONS and recipe.layout.contrib_attention:
            weights = QuantizedWeights(precision, block, ACCURACY_LEVEL, precision, "fp32", {})
            spec = _export(recipe, base, out, tie_lm_head=False, weights=weights, norm=norm, slots=slots).spec
            return spec, QUANTIZED
        with tempfile.TemporaryDirectory(dir=root) as scratch:
            if precision in QUANTIZED_PRECISIONS:
                raw = _export(recipe, base, Path(scratch), tie_lm_head=False, norm=norm, slots=slots)
                quantize_graph(raw.path, out, precision, block)
                return raw.spec, QUANTIZED
            spec = _export(recipe, base, out, norm=norm, slots=slots, dtype=_dtype(precision)).spec
            return spec, FP16 if precision == "fp16" else FP32

    spec, tol = write(root / "draft", 1)
    batch = None
    if recipe.max_batch > 1:
        with tempfile.TemporaryDirectory(dir=root) as scratch:
            write(Path(scratch), recipe.max_batch)
            rel = share_weights(
                Path(scratch) / "model.onnx",
                root / "draft" / "model.onnx",
                BATCH_GRAPH,
                f"max_batch {recipe.max_batch}",
            )
            batch = BatchGraph(rel, recipe.max_batch, {})
    validation: dict = {}
    if validate:
        validation = validate_export(base, root / "draft" / "model.onnx", spec, probe, tol).to_dict()
        if tol is QUANTIZED:
            validation["note"] = "quantized draft: agreement with its fp32 source is reported, not required"
    return model_entry(
        "draft/model.onnx", m.draft_source or m.source, base, precision, spec, vocab, validation, batch=batch
    )


def model_entry(
    graph: str,
    source: ModelSource,
    model,
    precision: str,
    result_spec,
    vocab: int,
    validation: dict,
    padding: Padding = Padding(),
    exactness: str | None = None,
    feature_layers: tuple[int, ...] = (),
    batch: BatchGraph | None = None,
    tree_graph: str | None = None,
) -> ModelEntry:
    return ModelEntry(
        graph=graph,
        source=source.describe(),
        architecture=model.config.model_type,
        num_layers=result_spec.num_layers,
        num_kv_heads=result_spec.num_kv_heads,
        head_dim=result_spec.head_dim,
        vocab_size=vocab,
        embedding_rows=result_spec.embedding_rows,
        precision=precision,
        kv_dtype=result_spec.kv_dtype,
        validation=validation,
        kv_layout=result_spec.kv_layout,
        min_rows=padding.min_rows,
        cache_pad=padding.cache_pad,
        exactness=exactness,
        feature_layers=feature_layers,
        feature_width=result_spec.feature_width,
        attention_windows=result_spec.windows,
        batch_graph=batch.graph if batch else None,
        max_batch=batch.slots if batch else 1,
        tree_graph=tree_graph,
        states=result_spec.states,
    )
