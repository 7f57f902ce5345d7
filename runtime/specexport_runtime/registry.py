"""The proposer registry: each proposer is declared once, here, and everything else reads it.

A ProposerSpec says what a proposer needs from an artifact, whether its drafts cost a model
call, which recipe defaults and calibration apply to it, and how it is built. The manifest
check, the recipe check, the generator's factory, `specexport calibrate`, the bench report,
the CLI and server choices and the test matrix (tests/runtime/test_proposer_matrix.py) all
ask this module rather than keeping name lists of their own.

Adding a proposer is one module (a proposers.Proposer subclass and a factory function taking a
proposers.ProposerContext) plus one ProposerSpec in PROPOSERS below; docs/proposers.md walks
through it. `register` and `extended` add specs from outside the package (tests do).

This module imports nothing heavy (no ONNX Runtime): the build side and the manifest reader
use it. Factories are named "module:function" and imported on first use.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .contract import ASSISTANT, DECODER, DFLASH_BLOCK, EAGLE3_HEAD, MTP
from .errors import InvalidArgument

NONE = "none"  # the proposer name of target-only decoding
# calibration: use the calibration of the proposer that runs the artifact's draft graph alone
DRAFT_SIDE = "draft side"
# calibrate: how `specexport calibrate` times one draft step of the proposer
LOOP = "loop"  # the draft seconds per drafted token of its own acceptance runs
MODEL_STEP = "model step"  # a draft model's 1-token call, timed apart
_KIND_WORDS = {
    DECODER: "a draft model",
    EAGLE3_HEAD: "an EAGLE-3 head",
    MTP: "an MTP head",
    DFLASH_BLOCK: "a DFlash block drafter",
    ASSISTANT: "a Gemma 4 assistant",
}
_NEED_WORDS = {
    DECODER: "a draft model",
    EAGLE3_HEAD: "an artifact with an EAGLE-3 draft head",
    MTP: "an artifact with the target's MTP head",
    DFLASH_BLOCK: "an artifact with a DFlash block drafter",
    ASSISTANT: "an artifact with a Gemma 4 assistant",
}


@dataclass(frozen=True)
class ProposerSpec:
    """One proposer. `needs`: the draft graph kinds (contract.GRAPH_KINDS) it can run with, any
    one of them; () = it needs no draft graph."""

    name: str
    factory: str | Callable[..., Any]  # "module:function" (".x" = this package's x) or f(ProposerContext) -> Proposer
    label: str  # what it drafts from, one line (CLI help, bench report)
    needs: tuple[str, ...] = ()
    corpus: bool = False  # also drafts from the artifact's corpus datastore when it has one (never required)
    free: bool = True  # every draft it makes is free (Proposal.free: no model call)
    recipe: bool = False  # a recipe may name it as speculation.proposer (with a draft form it runs with)
    recipe_default: bool = False  # the default speculation.proposer of the draft forms it runs with
    calibration: str | None = None  # whose calibration entry starts its gamma controller: a name, DRAFT_SIDE, None
    calibrate: str | None = None  # how `specexport calibrate` times its draft step (LOOP, MODEL_STEP); None: never
    # f(GeneratorConfig) -> what it keeps across a generator's requests: an object whose forget()
    # drops what it learned from earlier answers (SpecGenerator.learned / forget_history)
    learns: str | Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str) or self.name != self.name.strip().lower():
            raise InvalidArgument(f"a proposer name must be a non-empty lower-case string, got {self.name!r}")
        bad = [k for k in self.needs if k not in _KIND_WORDS]
        if bad:
            raise InvalidArgument(
                f"proposer {self.name!r}: needs {bad[0]!r} is not a draft graph kind ({', '.join(_KIND_WORDS)})"
            )
        if self.calibrate not in (None, LOOP, MODEL_STEP):
            raise InvalidArgument(
                f"proposer {self.name!r}: calibrate {self.calibrate!r} is not one of {LOOP!r}, {MODEL_STEP!r} or None"
            )

    @property
    def speculative(self) -> bool:
        """False only for target-only decoding."""
        return self.name != NONE

    @property
    def uses_draft(self) -> bool:
        """Whether it runs the artifact's draft graph (a draft model or a head)."""
        return bool(self.needs)

    def runs_with(self, draft_kind: str | None) -> bool:
        """Whether an artifact whose draft graph is of `draft_kind` (None: no draft graph) runs it."""
        return not self.needs or draft_kind in self.needs


PROPOSERS: dict[str, ProposerSpec] = {}


def register(spec: ProposerSpec) -> ProposerSpec:
    """Add a proposer; a name may be registered once."""
    if spec.name in PROPOSERS:
        raise InvalidArgument(f"proposer {spec.name!r} is registered already")
    PROPOSERS[spec.name] = spec
    return spec


@contextlib.contextmanager
def extended(*specs: ProposerSpec) -> Iterator[None]:
    """Register `specs` for the duration of a with-block (tests, plug-ins)."""
    for spec in specs:
        register(spec)
    try:
        yield
    finally:
        for spec in specs:
            PROPOSERS.pop(spec.name, None)


for _spec in (
    ProposerSpec(
        "draft",
        ".proposers:build_draft",
        "a draft model (a smaller model, or a quantized copy of the target)",
        needs=(DECODER,),
        free=False,
        recipe=True,
        recipe_default=True,
        calibration="draft",
        calibrate=MODEL_STEP,
    ),
    ProposerSpec(
        "ngram",
        ".proposers:build_ngram",
        "prompt lookup (what followed the last n-gram's earlier occurrence)",
        recipe=True,
        recipe_default=True,
        calibration="ngram",
        calibrate=LOOP,
    ),
    ProposerSpec(
        "hybrid",
        ".hybrid:build_hybrid",
        "retrieval where the text repeats (suffix drafts, then prompt lookup), else the draft model or head",
        needs=(DECODER, EAGLE3_HEAD),
        corpus=True,
        free=False,
        recipe=True,
        calibration=DRAFT_SIDE,
    ),
    ProposerSpec(
        "eagle",
        ".eagle:build_eagle",
        "an EAGLE-3 head reading the target's hidden states",
        needs=(EAGLE3_HEAD,),
        free=False,
        recipe=True,
        recipe_default=True,
        calibration="eagle",
        calibrate=LOOP,
    ),
    ProposerSpec(
        "dflash",
        ".dflash:build_dflash",
        "a DFlash block drafter: one call drafts a block from the target's hidden states",
        needs=(DFLASH_BLOCK,),
        free=False,
        recipe=True,
        recipe_default=True,
        calibration="dflash",
        calibrate=LOOP,
    ),
    ProposerSpec(
        "suffix",
        ".suffix:build_suffix",
        "suffix matches in the request, earlier answers and the artifact's corpus",
        corpus=True,
        calibration="suffix",
        learns=".suffix:SuffixHistory.create",
    ),
    ProposerSpec(
        "assistant",
        ".assistant:build_assistant",
        "a Gemma 4 assistant reading the target's K/V caches and last hidden row",
        needs=(ASSISTANT,),
        free=False,
        recipe=True,
        recipe_default=True,
        calibration="assistant",
    ),
    ProposerSpec(
        "mtp",
        ".mtp:build_mtp",
        "the target checkpoint's own MTP layer reading its last hidden rows",
        needs=(MTP,),
        free=False,
        recipe=True,
        recipe_default=True,
        calibration="mtp",
        calibrate=LOOP,
    ),
    ProposerSpec(NONE, ".proposers:build_none", "nothing: target-only decoding"),
):
    register(_spec)


# --------------------------------------------------------------------------- questions


def names() -> tuple[str, ...]:
    """Every registered proposer, 'none' (target only) included."""
    return tuple(PROPOSERS)


def speculative_names() -> tuple[str, ...]:
    """The proposers that draft (every one but 'none')."""
    return tuple(n for n, s in PROPOSERS.items() if s.speculative)


def get(name: str) -> ProposerSpec:
    spec = PROPOSERS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise InvalidArgument(f"proposer {name!r} is not one of {', '.join(map(repr, PROPOSERS))}")
    return spec


def available(draft_kind: str | None) -> tuple[str, ...]:
    """The drafting proposers an artifact with a draft graph of `draft_kind` (None: none) runs."""
    return tuple(n for n, s in PROPOSERS.items() if s.speculative and s.runs_with(draft_kind))


def check_available(name: str, draft_kind: str | None) -> ProposerSpec:
    """The spec of `name`, or InvalidArgument saying what the artifact lacks and what it runs."""
    spec = get(name)
    if spec.runs_with(draft_kind):
        return spec
    if draft_kind is None:
        free = " or ".join(repr(n) for n in available(None) if PROPOSERS[n].recipe_default)
        raise InvalidArgument(f"proposer {name!r} needs an artifact with a draft model; this one has none (use {free})")
    others = " or ".join(repr(n) for n in recipe_choices(draft_kind))
    raise InvalidArgument(
        f"proposer {name!r} needs {_NEED_WORDS[spec.needs[0]]}; this artifact's draft is"
        f" {_KIND_WORDS.get(draft_kind, repr(draft_kind))} (use {others})"
    )


def recipe_choices(draft_kind: str | None) -> tuple[str, ...]:
    """What a recipe whose draft form builds a graph of `draft_kind` (None: no draft graph) may
    name as speculation.proposer: the recipe proposers that use exactly that draft, the
    default first."""
    fits = [
        s
        for s in PROPOSERS.values()
        if s.recipe and s.uses_draft == (draft_kind is not None) and s.runs_with(draft_kind)
    ]
    return tuple(s.name for s in sorted(fits, key=lambda s: not s.recipe_default))


def recipe_default(draft_kind: str | None) -> str:
    """The speculation.proposer of a recipe that names none, for its draft form's graph kind."""
    choices = recipe_choices(draft_kind)
    if not choices or not PROPOSERS[choices[0]].recipe_default:
        raise InvalidArgument(f"no registered proposer is the default for draft kind {draft_kind!r}")
    return choices[0]


def draft_side(draft_kind: str) -> str:
    """The proposer that runs a draft graph of `draft_kind` alone ('draft' or 'eagle'); the
    calibration and the draft half of proposers that compose it (hybrid)."""
    return recipe_default(draft_kind)


def calibration_name(name: str, draft_kind: str | None) -> str | None:
    """Whose calibration.json entry starts `name`'s gamma controller (None: none applies)."""
    return calibration_of(get(name), draft_kind)


def calibration_of(spec: ProposerSpec, draft_kind: str | None) -> str | None:
    """calibration_name for an entry already resolved."""
    source = spec.calibration
    if source == DRAFT_SIDE:
        return draft_side(draft_kind) if draft_kind is not None else None
    return source


def calibrated(draft_kind: str | None) -> tuple[str, ...]:
    """The proposers `specexport calibrate` measures on an artifact with this draft kind, those
    that run the draft graph first."""
    fits = [s for s in PROPOSERS.values() if s.calibrate and s.runs_with(draft_kind)]
    return tuple(s.name for s in sorted(fits, key=lambda s: not s.uses_draft))


def resolve(ref: str | Callable[..., Any]) -> Callable[..., Any]:
    """A factory: a callable as given, or "module:attr.attr" imported now."""
    if callable(ref):
        return ref
    module, _, attr = ref.partition(":")
    obj: Any = importlib.import_module(module, __package__ if module.startswith(".") else None)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


__all__ = [
    "DRAFT_SIDE",
    "LOOP",
    "MODEL_STEP",
    "NONE",
    "PROPOSERS",
    "ProposerSpec",
    "available",
    "calibrated",
    "calibration_name",
    "calibration_of",
    "check_available",
    "draft_side",
    "extended",
    "get",
    "names",
    "recipe_choices",
    "recipe_default",
    "register",
    "resolve",
    "speculative_names",
]
