"""`specexport build`: recipe -> validated, packaged artifact (docs/artifact.md).

Stages, each a small function: load models -> check the tokenizer pair (build_load.py) -> export
the target -> validate it -> make the draft (export / quantize) -> validate it (build_graphs.py;
an EAGLE-3 head: build_eagle.py) -> package (build_package.py) -> with a system prompt, its rows
prefilled by the runtime on the packaged folder (build/prompt.py). Everything is written into a
temporary sibling folder that is renamed to the output only at the end, so a failure never leaves
a partial artifact.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from specexport_runtime.manifest import Manifest

from ..errors import BuildError
from ..recipe.spec import Recipe
from .dflash import export_dflash
from .eagle import export_head
from .graphs import export_draft, export_target, model_entry
from .load import load_models
from .package import package_artifact
from .progress import Clock, Progress, quiet
from .prompt import read_system_prompt, store_system_prompt

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


def _probe_ids(tokenizer, recipe: Recipe) -> list[int]:
    ids = tokenizer(recipe.validation.prompt or DEFAULT_PROBE)["input_ids"]
    while len(ids) < 16:
        ids = ids + ids
    return ids[:64]


def build_artifact(
    recipe: Recipe, output: Path, *, force: bool = False, validate: bool | None = None, progress: Progress = quiet
) -> BuildReport:
    output = Path(output)
    check_output(output, force)
    validate = recipe.validation.enabled if validate is None else validate
    # the system prompt file is read before the slow part
    system = read_system_prompt(recipe.system_prompt) if recipe.system_prompt is not None else None
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", suffix=".tmp", dir=output.parent))
    try:
        report = _build_into(recipe, tmp, validate, progress, system)
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


def _build_into(recipe: Recipe, root: Path, validate: bool, progress: Progress, system: str | None) -> BuildReport:
    clock = Clock()
    m = load_models(recipe, progress, clock)
    probe, vocab = _probe_ids(m.tokenizer, recipe), len(m.tokenizer)
    progress(f"exporting target ({recipe.target.precision})")
    features = tuple(m.head.config.layer_ids) if m.head is not None else ()
    features = m.drafter.config.feature_layers if m.drafter is not None else features
    if m.assistant is not None:  # a Gemma 4 assistant reads the final-normed stream of every row
        features = (m.norm.num_layers,)
        recipe = replace(recipe, speculation=replace(recipe.speculation, proposer="assistant"))
    if m.mtp is not None:  # an MTP head reads the final-normed stream of every row, as vLLM's target returns it
        features = (m.norm.num_layers,)
    target = export_target(recipe, m.reference, m.blocks, root / "target", probe, validate, progress, features, m.norm)
    m.blocks = {}
    clock.stage("export_target" + ("+validate" if validate else ""))
    if validate and recipe.target.exactness == "bitwise" and target.exactness != "bitwise":
        progress(
            "warning: target rows differ between call sizes"
            f" (max |diff| {target.validation['rows']['max_abs_diff']:.3g});"
            " the manifest records exactness 'numerical'"
        )
    target_entry = model_entry(
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
        batch=target.batch,
        tree_graph=target.tree,
    )
    draft_entry = None
    if m.head is not None:
        progress("exporting the EAGLE-3 head")
        draft_entry = export_head(
            m.head, m.reference, root, recipe, m.draft_source, vocab, target.result if validate else None, probe
        )
        clock.stage("draft" + ("+validate" if validate else ""))
    elif m.drafter is not None:
        progress("exporting the DFlash drafter")
        draft_entry = export_dflash(
            m.drafter, m.reference, root, m.draft_source, vocab, target.result if validate else None, probe
        )
        clock.stage("draft" + ("+validate" if validate else ""))
    elif m.assistant is not None:
        from .assistant import export_assistant

        progress("exporting the Gemma 4 assistant")
        draft_entry = export_assistant(
            m.draft, m.assistant, m.reference, m.norm, root, recipe, m.draft_source, vocab, probe if validate else None
        )
        clock.stage("draft" + ("+validate" if validate else ""))
    elif m.mtp is not None:
        from .mtp import export_mtp

        progress("exporting the MTP head")
        draft_entry = export_mtp(m.mtp, m.reference, root, recipe, m.source, vocab, probe if validate else None)
        clock.stage("draft" + ("+validate" if validate else ""))
    elif recipe.draft.has_graph:
        progress(f"making draft ({recipe.draft.kind}, {recipe.draft.precision})")
        draft_entry = export_draft(recipe, m, root, probe, vocab, validate)
        clock.stage("draft" + ("+validate" if validate else ""))
    progress("packaging")
    manifest = package_artifact(recipe, root, m, target_entry, draft_entry, progress, clock)
    clock.stage("package")
    if system is not None:
        manifest = store_system_prompt(root, system, progress)
        clock.stage("system_prompt")
    sizes = {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}
    validation = {"target": target.validation, **({"draft": draft_entry.validation} if draft_entry else {})}
    return BuildReport(root, manifest, clock.seconds, sizes, validation)
