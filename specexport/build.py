"""`specexport build`: recipe -> validated, packaged artifact (docs/artifact.md).

Stages, each a small function: load models -> check the tokenizer pair -> export the target
-> validate it -> make the draft (export / quantize) -> validate it -> package. Everything is
written into a temporary sibling folder that is renamed to the output only at the end, so a
failure never leaves a partial artifact.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from specexport_runtime import contract
from specexport_runtime.constants import DEFAULT_NGRAM_SIZES
from specexport_runtime.manifest import (
    Manifest,
    ModelEntry,
    RetrievalEntry,
    SpeculationDefaults,
    TokenizerEntry,
    write_manifest,
)

from . import __version__
from .build_eagle import export_head, load_head
from .datastore import SUFFIX_ARRAY_NAME, TOKENS_NAME, build_datastore, corpus_files
from .errors import BuildError
from .export import ExportResult, export_graph
from .fused import build_fused, fused_refusal
from .model_config import NormalizedConfig, UnsupportedConfig, normalize, read_config
from .quantize import QUANTIZED_PRECISIONS, quantize_graph
from .quantized_target import QuantizedWeights
from .recipe_spec import BLOCK_SIZE, CHECKPOINT_TARGETS, QUANTIZED_TARGETS, ModelSpec, Recipe
from .sources import ModelSource, load_blocks, load_model, load_tokenizer, resolve_source
from .tokcheck import check_pair, tokenizer_hash
from .validate import FP16, FP32, QUANTIZED, QUANTIZED_TARGET, validate_export, validate_long_range

DEFAULT_PROBE = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
    "Speculative decoding drafts tokens cheaply and verifies them in one pass."
)


class OutputExists(BuildError):
    """The output folder exists and --force was not given."""


@dataclass
class BuildReport:
    output: Path
    manifest: Manifest
    seconds: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    validation: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "output": str(self.output),
            "seconds": self.seconds,
            "sizes": self.sizes,
            "validation": self.validation,
            "manifest": self.manifest.name,
        }


Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def check_output(output: Path, force: bool) -> None:
    if output.exists() and not force:
        raise OutputExists(f"output folder {str(output)!r} already exists (pass --force to replace it)")
    if output.exists() and not output.is_dir():
        raise BuildError(f"output {str(output)!r} exists and is not a folder")
    parent = output.parent if output.parent != Path("") else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise BuildError(f"output folder {str(output)!r} is not writable: {exc.strerror or exc}") from exc


def _dtype(precision: str) -> torch.dtype:
    return torch.float16 if precision == "fp16" else torch.float32


def _probe_ids(tokenizer, recipe: Recipe) -> list[int]:
    ids = tokenizer(recipe.validation.prompt or DEFAULT_PROBE)["input_ids"]
    while len(ids) < 16:
        ids = ids + ids
    return ids[:64]


def _source(spec: ModelSpec) -> ModelSource:
    return resolve_source(spec.model, spec.gguf_file, spec.revision)


@dataclass(frozen=True)
class Padding:
    """How a graph keeps its rows independent of its call's size (contract 1.2)."""

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


def check_config(spec: ModelSpec, recipe: Recipe) -> NormalizedConfig:
    """The model's normalized config from its config.json (a GGUF file's metadata) alone, before
    any weight is read: an architecture, config feature or graph form the exporter does not
    reproduce exactly is refused here with one line (model_config.normalize, fused_refusal)."""
    source = _source(spec)
    config = read_config(
        source.location, gguf_file=source.gguf_file, revision=source.revision, trust_remote_code=spec.trust_remote_code
    )
    norm = normalize(config, recipe.max_context)
    if recipe.layout.contrib_attention:  # what the fused exporter cannot write
        problem = fused_refusal(norm)
        if problem:
            raise UnsupportedConfig(f"{spec.model}: {problem}")
    return norm


def _loaded_config(model, expected: NormalizedConfig, max_context: int) -> NormalizedConfig:
    """The loaded model's normalized config, which must be the one checked before loading."""
    norm = normalize(model.config, max_context)
    if norm != expected:
        raise UnsupportedConfig(
            f"the loaded model's config ({norm.describe()}) differs from its config.json ({expected.describe()})"
        )
    return norm


def _export(
    recipe: Recipe,
    model,
    out_dir: Path,
    tie_lm_head: bool = True,
    padding: Padding = Padding(),
    weights=None,
    features: tuple[int, ...] = (),
    norm: NormalizedConfig | None = None,
) -> ExportResult:
    """The recipe's graph form: portable (traced, time-major) or fused (contrib ops, in place)."""
    if recipe.layout.contrib_attention:
        return build_fused(
            model,
            out_dir,
            recipe.max_context,
            tie_lm_head=tie_lm_head,
            weights=weights,
            min_rows=padding.min_rows,
            pad_attention=padding.cache_pad > 0,
            feature_layers=features,
            norm=norm,
        )
    return export_graph(model, out_dir, tie_lm_head=tie_lm_head, feature_layers=features, norm=norm)


def _load_target(source: ModelSource, spec: ModelSpec) -> tuple[Any, dict]:
    """(float32 reference model, the checkpoint's quantized blocks; {} unless a checkpoint format)."""
    if spec.precision in CHECKPOINT_TARGETS:
        return load_blocks(source, spec.precision)
    return load_model(source, "float32", spec.trust_remote_code), {}


def _target_weights(spec: ModelSpec, blocks: dict, reference) -> QuantizedWeights | None:
    q = spec.quantization
    if spec.precision not in QUANTIZED_TARGETS or q is None:
        return None
    return QuantizedWeights(
        spec.precision,
        q.block_size or BLOCK_SIZE,
        q.accuracy_level,
        q.head,
        q.embedding,
        blocks,
        float_weights=dict(reference.named_parameters()),
    )


@dataclass(frozen=True)
class TargetExport:
    result: ExportResult
    validation: dict  # {} when not validated
    exactness: str | None  # measured; None when not validated
    padding: Padding


def _export_target(
    recipe: Recipe,
    reference,
    blocks: dict,
    out_dir: Path,
    probe: list[int],
    validate: bool,
    progress: Progress = _quiet,
    features: tuple[int, ...] = (),
    norm: NormalizedConfig | None = None,
) -> TargetExport:
    """Export the target, validate it against the float32 reference and measure its row
    invariance. exactness bitwise: the paddings of BITWISE_* in turn until one measures bitwise
    (the last is kept, measured numerical, when none does); numerical: no padding."""
    spec = recipe.target
    weights = _target_weights(spec, blocks, reference)
    fp16 = spec.precision == "fp16" or (spec.quantization is not None and spec.quantization.dtype == "fp16")
    model = copy.deepcopy(reference).to(torch.float16) if fp16 else reference
    # padded attention is GroupQueryAttention's (the fused form)
    tries = (
        (Padding(),)
        if spec.exactness != "bitwise"
        else BITWISE_FUSED
        if recipe.layout.contrib_attention
        else BITWISE_PORTABLE
    )
    if not validate:  # nothing measured: the first (cheapest) padding of the recipe's choice
        return TargetExport(
            _export(recipe, model, out_dir, padding=tries[0], weights=weights, features=features, norm=norm),
            {},
            None,
            tries[0],
        )
    for padding in tries:
        result = _export(recipe, model, out_dir, padding=padding, weights=weights, features=features, norm=norm)
        rows = measure_rows(result.path, result.spec, recipe.max_context, padding, probe)
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
    return TargetExport(result, report, rows.exactness, padding)


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
    from specexport.rowcheck import DEFAULT_SIZES, row_invariance
    from specexport_runtime.engine import OrtModel, SessionConfig

    n = max(DEFAULT_SIZES)
    tokens = (probe * (n // len(probe) + 1))[:n]  # the probe, repeated if short
    model = OrtModel(
        path, spec, max_context, SessionConfig(provider="cpu"), min_rows=padding.min_rows, cache_pad=padding.cache_pad
    )
    return row_invariance(model, probe[: len(probe) // 2], tokens)


def _entry(
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
    )


def _eos_ids(tokenizer, model) -> tuple[int, ...]:
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    for value in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if item is not None and int(item) not in ids:
                ids.append(int(item))
    return tuple(ids)


def build_artifact(
    recipe: Recipe, output: Path, *, force: bool = False, validate: bool | None = None, progress: Progress = _quiet
) -> BuildReport:
    output = Path(output)
    check_output(output, force)
    validate = recipe.validation.enabled if validate is None else validate
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    try:
        report = _build_into(recipe, tmp, validate, progress)
        if output.exists():
            old = output.with_name(f".{output.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            output.rename(old)
            tmp.rename(output)
            shutil.rmtree(old)
        else:
            tmp.rename(output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report.output = output
    return report


class _Clock:
    """Seconds per build stage, in order."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def stage(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(now - self._last, 2)
        self._last = now


@dataclass
class _Models:
    """What the build loaded: the target (its float32 reference, the checkpoint's blocks, its
    normalized config) and the draft side (a draft model, or an EAGLE-3 head) when it has one."""

    source: ModelSource
    tokenizer: Any
    reference: Any
    blocks: dict
    norm: NormalizedConfig
    draft_source: ModelSource | None = None
    draft: Any = None  # a draft model (recipe draft.model)
    draft_norm: NormalizedConfig | None = None
    head: Any = None  # an EAGLE-3 head (recipe draft.eagle3)


def _load(recipe: Recipe, progress: Progress, clock: _Clock) -> _Models:
    """Configs first (refusals before any weight), then target, then the draft side."""
    progress(f"checking configs (max_context {recipe.max_context}, {recipe.graph} graphs)")
    t_norm = check_config(recipe.target, recipe)
    d_norm = check_config(recipe.draft.model, recipe) if recipe.draft.kind == "model" else None
    progress(f"target: {t_norm.describe()}")
    clock.stage("check_config")
    progress(f"loading target {recipe.target.model}")
    source = _source(recipe.target)
    tokenizer = load_tokenizer(source, recipe.target.trust_remote_code)
    reference, blocks = _load_target(source, recipe.target)
    m = _Models(source, tokenizer, reference, blocks, _loaded_config(reference, t_norm, recipe.max_context))
    clock.stage("load_target")
    if recipe.draft.kind == "eagle3":
        progress(f"loading EAGLE-3 head {recipe.draft.model.model}")
        m.head, m.draft_source = load_head(recipe, reference)
        progress(f"EAGLE-3 head: target features {m.head.config.layer_ids_reason}")
        clock.stage("load_draft")
    elif recipe.draft.kind == "model":
        progress(f"loading draft {recipe.draft.model.model}")
        m.draft_source = _source(recipe.draft.model)
        d_tok = load_tokenizer(m.draft_source, recipe.draft.model.trust_remote_code)
        m.draft = load_model(m.draft_source, "float32", recipe.draft.model.trust_remote_code)
        m.draft_norm = _loaded_config(m.draft, d_norm, recipe.max_context)
        compat = check_pair(
            tokenizer,
            d_tok,
            reference.get_output_embeddings().weight.shape[0],
            m.draft.get_output_embeddings().weight.shape[0],
        )
        compat.raise_if_incompatible()  # rows the draft lacks are padded at run time (proposers.DraftModelProposer)
        clock.stage("load_draft")
    return m


def _build_into(recipe: Recipe, root: Path, validate: bool, progress: Progress) -> BuildReport:
    clock = _Clock()
    m = _load(recipe, progress, clock)
    probe, vocab = _probe_ids(m.tokenizer, recipe), len(m.tokenizer)
    progress(f"exporting target ({recipe.target.precision})")
    features = tuple(m.head.config.layer_ids) if m.head is not None else ()
    target = _export_target(recipe, m.reference, m.blocks, root / "target", probe, validate, progress, features, m.norm)
    m.blocks = {}
    clock.stage("export_target" + ("+validate" if validate else ""))
    if validate and recipe.target.exactness == "bitwise" and target.exactness != "bitwise":
        progress(
            "warning: target rows differ between call sizes"
            f" (max |diff| {target.validation['rows']['max_abs_diff']:.3g});"
            " the manifest records exactness 'numerical'"
        )
    target_entry = _entry(
        "target/model.onnx",
        m.source,
        m.reference,
        recipe.target.precision,
        target.result.spec,
        vocab,
        target.validation,
        padding=target.padding,
        exactness=target.exactness,
        feature_layers=features,
    )
    draft_entry = None
    if m.head is not None:
        progress("exporting the EAGLE-3 head")
        draft_entry = export_head(
            m.head, m.reference, root, recipe, m.draft_source, vocab, target.result if validate else None, probe
        )
        clock.stage("draft" + ("+validate" if validate else ""))
    elif recipe.draft.has_graph:
        progress(f"making draft ({recipe.draft.kind}, {recipe.draft.precision})")
        draft_entry = _export_draft(recipe, m, root, probe, vocab, validate)
        clock.stage("draft" + ("+validate" if validate else ""))
    progress("packaging")
    manifest = _package(recipe, root, m, target_entry, draft_entry, progress, clock)
    clock.stage("package")
    sizes = {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}
    validation = {"target": target.validation, **({"draft": draft_entry.validation} if draft_entry else {})}
    return BuildReport(root, manifest, clock.seconds, sizes, validation)


def _export_draft(recipe: Recipe, m: _Models, root: Path, probe: list[int], vocab: int, validate: bool) -> ModelEntry:
    """A draft graph (a draft model, or a copy of the target) at the recipe's draft precision:
    quantized ones are exported float, then quantized (their agreement is reported, not
    required); float ones validated like a target."""
    precision = recipe.draft.precision
    base, norm = (m.draft, m.draft_norm) if m.draft is not None else (m.reference, m.norm)
    with tempfile.TemporaryDirectory(dir=root) as scratch:
        if precision in QUANTIZED_PRECISIONS:
            raw = _export(recipe, base, Path(scratch), tie_lm_head=False, norm=norm)
            quantize_graph(raw.path, root / "draft", precision, recipe.draft.block_size or BLOCK_SIZE)
            spec, tol = raw.spec, QUANTIZED
        else:
            model = base if precision == "fp32" else copy.deepcopy(base).to(_dtype(precision))
            spec = _export(recipe, model, root / "draft", norm=norm).spec
            tol = FP16 if precision == "fp16" else FP32
    validation: dict = {}
    if validate:
        validation = validate_export(base, root / "draft" / "model.onnx", spec, probe, tol).to_dict()
        if tol is QUANTIZED:
            validation["note"] = "quantized draft: agreement with its fp32 source is reported, not required"
    return _entry("draft/model.onnx", m.draft_source or m.source, base, precision, spec, vocab, validation)


def _package(
    recipe: Recipe,
    root: Path,
    m: _Models,
    target_entry: ModelEntry,
    draft_entry: ModelEntry | None,
    progress: Progress,
    clock: _Clock,
) -> Manifest:
    """Tokenizer, chat template, recipe, datastore and the manifest beside the graphs."""
    tok = m.tokenizer
    tok.backend_tokenizer.save(str(root / "tokenizer.json"))
    template = getattr(tok, "chat_template", None)
    if isinstance(template, str) and template:
        (root / "chat_template.jinja").write_text(template, encoding="utf-8")
    (root / "recipe.json").write_text(json.dumps(recipe.to_dict(), indent=2), encoding="utf-8")
    retrieval = None
    if recipe.retrieval is not None:
        progress("datastore")
        retrieval = _datastore(recipe, root)
        clock.stage("datastore")
    manifest = Manifest(
        name=recipe.name,
        max_context=recipe.max_context,
        target=target_entry,
        draft=draft_entry,
        tokenizer=TokenizerEntry(
            file="tokenizer.json",
            chat_template="chat_template.jinja" if (root / "chat_template.jinja").exists() else None,
            eos_token_ids=_eos_ids(tok, m.reference),
            bos_token_id=tok.bos_token_id,
            add_bos=bool(tok("a")["input_ids"][:1] == [tok.bos_token_id]) if tok.bos_token_id is not None else False,
            sha256=tokenizer_hash(tok),
        ),
        speculation=SpeculationDefaults(
            proposer=recipe.proposer,
            gamma=recipe.speculation.gamma,
            ngram_sizes=tuple(recipe.draft.ngram_sizes) or DEFAULT_NGRAM_SIZES,
            hybrid_retrieval=recipe.speculation.hybrid_retrieval,
        ),
        generation={"max_gamma": recipe.speculation.max_gamma, "adaptive": recipe.speculation.adaptive},
        tools=_tool_versions(),
        retrieval=retrieval,
        contract_version=_declared_version(target_entry, draft_entry),
    )
    write_manifest(root, manifest)
    return manifest


def _datastore(recipe: Recipe, root: Path) -> RetrievalEntry:
    """Tokenize recipe.retrieval.corpus with the artifact's own tokenizer (tokenizer.json, as the
    runtime will) into retrieval/*.npy."""
    from tokenizers import Tokenizer

    spec = recipe.retrieval
    files = corpus_files(spec.corpus, Path.cwd())
    info = build_datastore(files, Tokenizer.from_file(str(root / "tokenizer.json")), spec.max_tokens, root)
    return RetrievalEntry(
        tokens=TOKENS_NAME,
        suffix_array=SUFFIX_ARRAY_NAME,
        token_count=info.tokens,
        info={**info.to_dict(), "corpus": list(spec.corpus), "max_tokens": spec.max_tokens},
    )


def _declared_version(*entries: ModelEntry | None) -> str:
    """The lowest contract version defining every graph's layout, so that older runtimes still
    read artifacts that do not need the newer layout."""
    versions = [e.required_version for e in entries if e is not None]
    return max(versions, key=contract.parse_version)


def _tool_versions() -> dict[str, str]:
    import onnx
    import onnxruntime
    import transformers

    return {
        "specexport": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": onnxruntime.__version__,
    }
