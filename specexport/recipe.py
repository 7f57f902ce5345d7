"""Typed, validated build recipes (docs/recipes.md).

A recipe is a YAML file naming a target model, how its draft is obtained, and the speculation and
validation defaults baked into the artifact. This module checks shape, types and ranges only;
whether a model path or hub id exists is resolved at build time.

    recipe = load_recipe("recipes/smollm2-135m.yaml")
    recipe.draft.kind            # "from_target" | "model" | "ngram"
    recipe.to_dict()             # plain dict, recorded in the artifact manifest; parse_recipe() reads it back
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from specexport_runtime import registry
from specexport_runtime.constants import (
    DEFAULT_GAMMA,
    DEFAULT_HYBRID_RETRIEVAL,
    DEFAULT_MAX_GAMMA,
    DEFAULT_NGRAM_SIZES,
    EXACTNESS,
    HYBRID_RETRIEVALS,
    MAX_GAMMA,
    MAX_NGRAM,
    MIN_GAMMA,
)
from specexport_runtime.contract import DECODER, EAGLE3_HEAD, GRAPH_FORMS, KvLayout, layout_for_form

from .errors import RecipeError

__all__ = [
    "DEFAULT_RECIPE",
    "DRAFT_KINDS",
    "DRAFT_MODEL_PRECISIONS",
    "GRAPH_KINDS",
    "RECIPES_DIR",
    "SELF_DRAFT_PRECISIONS",
    "TARGET_PRECISIONS",
    "DraftSpec",
    "ModelSpec",
    "QuantizationSpec",
    "Recipe",
    "SpeculationSpec",
    "ValidationSpec",
    "bundled_recipes",
    "dump_recipe",
    "load_recipe",
    "parse_recipe",
    "resolve_recipe",
]

NAME_PATTERN = r"[a-z0-9._-]+"
_NAME_RE = re.compile(NAME_PATTERN + r"\Z")
BUILTIN_PREFIX = "builtin:"

FLOAT_TARGETS = ("fp32", "fp16")
RTN_TARGETS = ("int8", "int4")  # weight-only, quantized at build time (round to nearest)
CHECKPOINT_TARGETS = ("gguf", "gptq", "awq")  # the checkpoint's own quantized blocks, kept exactly
QUANTIZED_TARGETS = RTN_TARGETS + CHECKPOINT_TARGETS
TARGET_PRECISIONS = FLOAT_TARGETS + QUANTIZED_TARGETS
TENSOR_MODES = ("fp32", "int8", "int4", "checkpoint")  # how a quantized target stores its head / embedding
ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # MatMulNBits: 0/1 fp32 activations, 2 fp16, 3 bf16, 4 int8
DEFAULT_ACCURACY_LEVEL = 4
# exactness (constants.EXACTNESS): "bitwise" pads the target (its attention in a fused graph, else its
# calls to >= 2 rows; contract 1.2) so a row never depends on its call's size; "numerical" leaves it unpadded
DRAFT_MODEL_PRECISIONS = ("fp32", "fp16", "int8", "int4", "dynamic-int8")
SELF_DRAFT_PRECISIONS = ("int8", "int4", "dynamic-int8", "fp16")
DRAFT_KINDS = ("model", "from_target", "ngram", "eagle3")
# the artifact's draft graph kind of each draft form (None: no draft graph); which proposers a
# recipe may name with a form is the registry's answer for that kind (registry.recipe_choices)
DRAFT_GRAPH_KINDS = {"model": DECODER, "from_target": DECODER, "ngram": None, "eagle3": EAGLE3_HEAD}
# graph form of both models (docs/graph-contract.md): portable = ONNX standard ops, time-major
# cache (any EP, TensorRT); fused = ONNX Runtime contrib ops, in-place head-major cache (CPU/CUDA EPs).
# Each form is one contract.KvLayout (Recipe.layout)
GRAPH_KINDS = GRAPH_FORMS
DEFAULT_GRAPH = "portable"

MIN_CONTEXT = 16
MAX_CONTEXT = 131072
DEFAULT_SELF_DRAFT_PRECISION = "int8"
BLOCKED_PRECISIONS = ("int8", "int4")  # weight-only MatMulNBits: one scale per block of input rows
BLOCK_SIZE = 32  # default block: finest scales, highest agreement with the fp32 source
BLOCK_SIZES = (16, 32, 64, 128, 256)  # MatMulNBits needs a power of two >= 16

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
DEFAULT_RECIPE = "smollm2-135m"

_TOP_KEYS = (
    "name",
    "description",
    "max_context",
    "graph",
    "target",
    "draft",
    "speculation",
    "validation",
    "retrieval",
    "notes",
    "tested_here",
)
_RETRIEVAL_KEYS = ("corpus", "max_tokens")
DEFAULT_RETRIEVAL_TOKENS = 10_000_000
MAX_RETRIEVAL_TOKENS = 1 << 31
_TOP_REQUIRED = ("name", "max_context", "target", "draft")
_MODEL_KEYS = ("model", "gguf_file", "precision", "revision", "trust_remote_code")
_TARGET_KEYS = _MODEL_KEYS + ("quantization", "exactness")
_QUANTIZATION_KEYS = ("block_size", "accuracy_level", "head", "embedding", "dtype")
QUANTIZED_DTYPES = ("fp32", "fp16")
_SPECULATION_KEYS = ("gamma", "max_gamma", "adaptive", "proposer", "hybrid_retrieval")
_VALIDATION_KEYS = ("enabled", "prompt")
_FROM_TARGET_KEYS = ("precision", "block_size")
_EAGLE3_KEYS = ("model", "layers", "precision", "revision", "allow_pickle")
EAGLE3_PRECISIONS = ("fp32", "fp16", "int8")  # eagle_graph.HEAD_PRECISIONS
PORTABLE_EAGLE3_PRECISIONS = ("fp32", "fp16")  # eagle_portable.PORTABLE_HEAD_PRECISIONS (int8: MatMulNBits, fused only)
# draft forms: kind -> (the key that selects the form, the keys allowed with it)
_DRAFT_FORMS = {
    "model": ("model", _MODEL_KEYS),
    "from_target": ("from_target", ("from_target",)),
    "ngram": ("proposer", ("proposer", "ngram_sizes")),
    "eagle3": ("eagle3", ("eagle3",)),
}
_DRAFT_KEYS = tuple(dict.fromkeys(k for _, keys in _DRAFT_FORMS.values() for k in keys))


# --------------------------------------------------------------------------- typed recipe


@dataclass(frozen=True)
class QuantizationSpec:
    """How a quantized target (QUANTIZED_TARGETS) stores its weights (specexport/quantized_target.py).

    block_size: inputs per scale for int8 / int4 (None for checkpoint formats, whose blocks are
    the checkpoint's); accuracy_level: MatMulNBits's (4: int8 activations, the fast path; 0/1:
    fp32 activations); head / embedding: TENSOR_MODES ("checkpoint": the checkpoint's own blocks
    when it holds the tensor quantized, else fp32); dtype: the graph's float dtype (fp16 for the
    CUDA provider, whose GroupQueryAttention needs an fp16 cache)."""

    block_size: int | None = BLOCK_SIZE
    accuracy_level: int = DEFAULT_ACCURACY_LEVEL
    head: str = "int8"
    embedding: str = "fp32"
    dtype: str = "fp32"  # activations, scales and KV cache: fp32 (CPU) or fp16 (CUDA / Jetson)

    def to_dict(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "accuracy_level": self.accuracy_level, "head": self.head,
                "embedding": self.embedding, "dtype": self.dtype}


@dataclass(frozen=True)
class ModelSpec:
    """Where a model comes from: a local HF folder, a hub id, a .gguf file or builtin:NAME.

    quantization / exactness: targets only (None for drafts)."""

    model: str
    precision: str = "fp32"
    gguf_file: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    quantization: QuantizationSpec | None = None  # set exactly when precision is in QUANTIZED_TARGETS
    exactness: str | None = None  # EXACTNESS (targets)

    @property
    def builtin_name(self) -> str | None:
        """NAME for `builtin:NAME`, else None."""
        return self.model[len(BUILTIN_PREFIX) :] if self.model.startswith(BUILTIN_PREFIX) else None

    @property
    def is_gguf(self) -> bool:
        """True when the weights come from a GGUF file (a .gguf path or `gguf_file` inside a folder)."""
        return self.gguf_file is not None or self.model.lower().endswith(".gguf")

    def to_dict(self) -> dict[str, Any]:
        data = {
            "model": self.model,
            "gguf_file": self.gguf_file,
            "precision": self.precision,
            "revision": self.revision,
            "trust_remote_code": self.trust_remote_code,
        }
        if self.quantization is not None:
            data["quantization"] = self.quantization.to_dict()
        if self.exactness is not None:
            data["exactness"] = self.exactness
        return data


@dataclass(frozen=True)
class DraftSpec:
    """How draft tokens are proposed.

    kind "model":       a separate model (`model`; `precision` == model.precision)
    kind "from_target": a quantized copy of the target (`precision` in SELF_DRAFT_PRECISIONS;
                        `block_size`: rows per scale for int8 / int4, None = quantize.BLOCK_SIZE)
    kind "ngram":       the n-gram proposer, no draft graph (`ngram_sizes`, longest tried first)
    kind "eagle3":      an EAGLE-3 head (`model`: its folder or hub id; `layers`: the target's
                        feature layers, None = the head's config or the default; `allow_pickle`)
    """

    kind: str
    precision: str | None = None
    model: ModelSpec | None = None
    ngram_sizes: tuple[int, ...] = ()
    block_size: int | None = None
    layers: tuple[int, ...] | None = None  # eagle3: entering-layer ids of the target's features
    allow_pickle: bool = False  # eagle3: read a pytorch_model.bin (torch.load weights_only)

    def __post_init__(self) -> None:
        if self.kind not in DRAFT_KINDS:
            raise RecipeError(f"draft kind {self.kind!r} is not one of {', '.join(DRAFT_KINDS)}")
        if self.block_size is not None and (self.kind != "from_target" or self.precision not in BLOCKED_PRECISIONS):
            raise RecipeError(f"draft block_size applies to from_target drafts of precision {' or '.join(BLOCKED_PRECISIONS)}"
                              f" only, not to a {self.kind} draft of precision {self.precision!r}")
        if self.block_size is not None and self.block_size not in BLOCK_SIZES:
            raise RecipeError(f"draft block_size {self.block_size!r} is not one of {', '.join(map(str, BLOCK_SIZES))}")
        if (self.kind in ("model", "eagle3")) != (self.model is not None):
            raise RecipeError("draft.model is set exactly when the draft kind is 'model' or 'eagle3'")
        if self.kind == "model" and self.precision != self.model.precision:
            raise RecipeError(
                f"draft precision {self.precision!r} differs from draft.model precision {self.model.precision!r}"
            )
        if (self.kind == "ngram") != bool(self.ngram_sizes):
            raise RecipeError("draft ngram_sizes are set exactly when the draft kind is 'ngram'")

    @property
    def has_graph(self) -> bool:
        """Whether the artifact holds a draft ONNX graph (False for the n-gram proposer)."""
        return self.kind != "ngram"

    @property
    def graph_kind(self) -> str | None:
        """The kind of the draft graph this form builds (contract.GRAPH_KINDS), None without one."""
        return DRAFT_GRAPH_KINDS[self.kind]

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "model":
            return self.model.to_dict()
        if self.kind == "from_target":
            inner: dict[str, Any] = {"precision": self.precision}
            if self.block_size is not None:
                inner["block_size"] = self.block_size
            return {"from_target": inner}
        if self.kind == "eagle3":
            return {"eagle3": {"model": self.model.model, "revision": self.model.revision, "precision": self.precision,
                               "layers": "auto" if self.layers is None else list(self.layers),
                               "allow_pickle": self.allow_pickle}}
        return {"proposer": "ngram", "ngram_sizes": list(self.ngram_sizes)}


@dataclass(frozen=True)
class SpeculationSpec:
    gamma: int = DEFAULT_GAMMA
    max_gamma: int = DEFAULT_MAX_GAMMA
    adaptive: bool = True  # False: the runtime keeps gamma at its start (calibrated, else `gamma`)
    proposer: str | None = None  # None: the draft form's default (registry.recipe_default)
    hybrid_retrieval: str = DEFAULT_HYBRID_RETRIEVAL  # what `hybrid` retrieves with (constants.HYBRID_RETRIEVALS)

    def to_dict(self) -> dict[str, Any]:
        return {"gamma": self.gamma, "max_gamma": self.max_gamma, "adaptive": self.adaptive, "proposer": self.proposer,
                "hybrid_retrieval": self.hybrid_retrieval}


@dataclass(frozen=True)
class ValidationSpec:
    enabled: bool = True
    prompt: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "prompt": self.prompt}


@dataclass(frozen=True)
class RetrievalSpec:
    """A corpus datastore built into the artifact (specexport/datastore.py): files, folders or
    globs (relative to the working directory), at most max_tokens tokens."""

    corpus: tuple[str, ...]
    max_tokens: int = DEFAULT_RETRIEVAL_TOKENS

    def to_dict(self) -> dict[str, Any]:
        return {"corpus": list(self.corpus), "max_tokens": self.max_tokens}


@dataclass(frozen=True)
class Recipe:
    name: str
    max_context: int
    target: ModelSpec
    draft: DraftSpec
    speculation: SpeculationSpec = SpeculationSpec()
    validation: ValidationSpec = ValidationSpec()
    graph: str = DEFAULT_GRAPH  # GRAPH_KINDS, for target and draft alike
    retrieval: RetrievalSpec | None = None
    description: str | None = None
    notes: str | None = None
    tested_here: bool = False
    source: str | None = field(default=None, compare=False)  # file it was read from; not in to_dict

    @property
    def proposer(self) -> str:
        """The manifest's speculation.proposer: as given, else the draft form's default
        (registry.recipe_default: "draft", "eagle" or "ngram")."""
        if self.speculation.proposer is not None:
            return self.speculation.proposer
        return registry.recipe_default(self.draft.graph_kind)

    @property
    def layout(self) -> KvLayout:
        """The KV layout of the graphs this recipe's `graph` form builds (target and draft alike)."""
        return layout_for_form(self.graph)

    def to_dict(self) -> dict[str, Any]:
        """Plain, fully explicit dict (every default filled in); `parse_recipe(r.to_dict()) == r`."""
        return {
            "name": self.name,
            "description": self.description,
            "max_context": self.max_context,
            "graph": self.graph,
            "target": self.target.to_dict(),
            "draft": self.draft.to_dict(),
            "speculation": self.speculation.to_dict(),
            "validation": self.validation.to_dict(),
            "retrieval": None if self.retrieval is None else self.retrieval.to_dict(),
            "notes": self.notes,
            "tested_here": self.tested_here,
        }

    def with_overrides(self, overrides: Mapping[str, Any]) -> "Recipe":
        """A validated copy with dotted-path overrides, e.g. {"speculation.gamma": 6, "max_context": 4096}."""
        data = self.to_dict()
        for dotted, value in overrides.items():
            parts = dotted.split(".")
            node = data
            for part in parts[:-1]:
                child = node.get(part)
                if not isinstance(child, dict):
                    child = {}
                    node[part] = child
                node = child
            node[parts[-1]] = value
        return parse_recipe(data, self.source or f"recipe {self.name!r} with overrides")


# --------------------------------------------------------------------------- validation helpers

_MISSING = object()


def _a(value: Any) -> str:
    """The type name of a YAML value with its article: "an integer", "a string"."""
    name = _type_name(value)
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "mapping"
    return type(value).__name__


class _Reader:
    """Reads one recipe dict; every error names the source, the field path and what was expected."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, message: str) -> RecipeError:
        return RecipeError(f"{self.source}: {message}")

    def mapping(self, value: Any, path: str) -> dict:
        if not isinstance(value, Mapping):
            where = f"{path!r}" if path else "the recipe"
            raise self.fail(f"{where} must be a mapping of keys to values, got {_a(value)} {value!r:.80}")
        return dict(value)

    def check_keys(self, data: dict, path: str, allowed: tuple[str, ...]) -> None:
        section = f"in section {path!r}" if path else "at the top level"
        for key in data:
            if key in allowed:
                continue
            hint = ""
            if isinstance(key, str):
                close = difflib.get_close_matches(key, allowed, n=1)
                if close:
                    hint = f" (did you mean {close[0]!r}?)"
            raise self.fail(f"unknown key {key!r} {section}{hint}; allowed keys: {', '.join(allowed)}")

    def require(self, data: dict, key: str, path: str, expected: str) -> Any:
        value = data.get(key)
        if value is None:
            full = f"{path}.{key}" if path else key
            section = f"section {path!r}" if path else "the top level"
            raise self.fail(f"required key {full!r} is missing from {section} (expected {expected})")
        return value

    def string(
        self, data: dict, key: str, path: str, *, default: Any = _MISSING, choices: tuple[str, ...] | None = None
    ) -> Any:
        full = f"{path}.{key}" if path else key
        expected = f"one of {', '.join(choices)}" if choices else "a string"
        value = data.get(key)
        if value is None:
            if default is _MISSING:
                self.require(data, key, path, expected)
            return default
        if choices is not None:
            if not isinstance(value, str) or value not in choices:
                raise self.fail(f"{full} = {value!r} is not allowed; allowed values: {', '.join(choices)}")
            return value
        if not isinstance(value, str):
            quote = f' (quote it in YAML: "{value}")' if isinstance(value, (int, float)) else ""
            raise self.fail(f"{full} = {value!r} is {_a(value)}; expected a string{quote}")
        if not value.strip():
            raise self.fail(f"{full} is an empty string; expected non-empty text")
        return value

    def integer(self, data: dict, key: str, path: str, *, lo: int, hi: int, default: Any = _MISSING) -> Any:
        full = f"{path}.{key}" if path else key
        value = data.get(key)
        if value is None:
            if default is _MISSING:
                self.require(data, key, path, f"an integer in {lo}..{hi}")
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(f"{full} = {value!r} is {_a(value)}; expected an integer in {lo}..{hi}")
        if not lo <= value <= hi:
            raise self.fail(f"{full} = {value!r} is out of range; allowed values: integers {lo}..{hi}")
        return value

    def boolean(self, data: dict, key: str, path: str, *, default: bool) -> bool:
        full = f"{path}.{key}" if path else key
        value = data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.fail(f"{full} = {value!r} is {_a(value)}; allowed values: true, false")
        return value

    # -- sections

    def model_spec(self, data: dict, path: str, precisions: tuple[str, ...], default_precision: str) -> ModelSpec:
        model = self.string(data, "model", path)
        if model.startswith(BUILTIN_PREFIX) and not _NAME_RE.match(model[len(BUILTIN_PREFIX) :]):
            raise self.fail(
                f"{path}.model = {model!r}: a builtin model is written builtin:NAME with NAME matching {NAME_PATTERN}"
            )
        gguf_file = self.string(data, "gguf_file", path, default=None)
        if gguf_file is not None:
            if not gguf_file.lower().endswith(".gguf"):
                raise self.fail(f"{path}.gguf_file = {gguf_file!r}: expected a file name ending in .gguf")
            if model.lower().endswith(".gguf"):
                raise self.fail(
                    f"{path}.gguf_file = {gguf_file!r} is set but {path}.model = {model!r} is already a .gguf file;"
                    " gguf_file picks a file inside a folder, wheel or hub repository"
                )
        return ModelSpec(
            model=model,
            precision=self.string(data, "precision", path, default=default_precision, choices=precisions),
            gguf_file=gguf_file,
            revision=self.string(data, "revision", path, default=None),
            trust_remote_code=self.boolean(data, "trust_remote_code", path, default=False),
        )

    def target(self, data: dict) -> ModelSpec:
        spec = self.model_spec(data, "target", TARGET_PRECISIONS, "fp32")
        precision = spec.precision
        if precision == "gguf" and not (spec.is_gguf or spec.builtin_name is not None):  # builtins are GGUF files
            raise self.fail(f"target.precision = 'gguf' keeps a GGUF file's own blocks, but target.model = {spec.model!r}"
                            " is not a GGUF source (give a .gguf file, gguf_file, or a builtin model)")
        if precision in ("gptq", "awq") and spec.is_gguf:
            raise self.fail(f"target.precision = {precision!r} needs a Hugging Face folder with a {precision} checkpoint,"
                            f" not the GGUF source {spec.model!r}")
        quant = data.get("quantization")
        if quant is not None and precision not in QUANTIZED_TARGETS:
            raise self.fail(f"target.quantization is set, but target.precision = {precision!r} is not quantized;"
                            f" it applies to precision {', '.join(QUANTIZED_TARGETS)}")
        quantization = self.quantization(quant, precision) if precision in QUANTIZED_TARGETS else None
        exactness = self.string(data, "exactness", "target", default="bitwise", choices=EXACTNESS)
        return ModelSpec(model=spec.model, precision=precision, gguf_file=spec.gguf_file, revision=spec.revision,
                         trust_remote_code=spec.trust_remote_code, quantization=quantization, exactness=exactness)

    def quantization(self, value: Any, precision: str) -> QuantizationSpec:
        path = "target.quantization"
        data = {} if value is None else self.mapping(value, path)
        self.check_keys(data, path, _QUANTIZATION_KEYS)
        block = data.get("block_size")
        if precision in RTN_TARGETS:
            if block is None:
                block = BLOCK_SIZE
            if isinstance(block, bool) or block not in BLOCK_SIZES:
                raise self.fail(f"{path}.block_size = {block!r} is not allowed; allowed values: {', '.join(map(str, BLOCK_SIZES))}")
        elif block is not None:
            raise self.fail(f"{path}.block_size is set, but a {precision} target keeps the checkpoint's own blocks;"
                            f" block_size applies to precision {' or '.join(RTN_TARGETS)}")
        level = self.integer(data, "accuracy_level", path, lo=min(ACCURACY_LEVELS), hi=max(ACCURACY_LEVELS),
                             default=DEFAULT_ACCURACY_LEVEL)
        modes = TENSOR_MODES if precision in CHECKPOINT_TARGETS else tuple(m for m in TENSOR_MODES if m != "checkpoint")
        head_default = "checkpoint" if precision in CHECKPOINT_TARGETS else "int8"
        head = self.string(data, "head", path, default=head_default, choices=modes)
        embedding = self.string(data, "embedding", path, default="fp32", choices=modes)
        dtype = self.string(data, "dtype", path, default="fp32", choices=QUANTIZED_DTYPES)
        return QuantizationSpec(block_size=block, accuracy_level=level, head=head, embedding=embedding, dtype=dtype)

    def draft(self, value: Any) -> DraftSpec:
        data = self.mapping(value, "draft")
        self.check_keys(data, "draft", _DRAFT_KEYS)
        forms = [kind for kind, (marker, _) in _DRAFT_FORMS.items() if marker in data]
        how = (
            "give exactly one of draft.model (a separate draft model), draft.from_target (a quantized copy"
            " of the target, e.g. from_target: {precision: int8}) or draft.proposer: ngram"
        )
        if not forms:
            got = f"; got only {', '.join(map(repr, data))}" if data else ""
            raise self.fail(f"section 'draft' names no draft form: {how}{got}")
        if len(forms) > 1:
            markers = ", ".join(f"draft.{_DRAFT_FORMS[k][0]}" for k in forms)
            raise self.fail(f"section 'draft' names several draft forms ({markers}): {how}")
        kind = forms[0]
        marker, allowed = _DRAFT_FORMS[kind]
        for key in data:
            if key not in allowed:
                owner = next(k for k, (_, keys) in _DRAFT_FORMS.items() if key in keys)
                hint = " (put it inside from_target, e.g. from_target: {precision: int8})" if (
                    kind == "from_target" and key in _FROM_TARGET_KEYS
                ) else ""
                raise self.fail(
                    f"key {key!r} is not allowed in section 'draft' next to draft.{marker}: it belongs to the"
                    f" draft.{_DRAFT_FORMS[owner][0]} form{hint}; allowed keys with draft.{marker}: {', '.join(allowed)}"
                )
        if kind == "model":
            spec = self.model_spec(data, "draft", DRAFT_MODEL_PRECISIONS, "fp32")
            return DraftSpec(kind="model", precision=spec.precision, model=spec)
        if kind == "eagle3":
            return self.eagle3(data["eagle3"])
        if kind == "from_target":
            inner = data["from_target"]
            inner = {} if inner is None else self.mapping(inner, "draft.from_target")
            self.check_keys(inner, "draft.from_target", _FROM_TARGET_KEYS)
            precision = self.string(
                inner,
                "precision",
                "draft.from_target",
                default=DEFAULT_SELF_DRAFT_PRECISION,
                choices=SELF_DRAFT_PRECISIONS,
            )
            block = inner.get("block_size")
            if block is not None:
                if precision not in BLOCKED_PRECISIONS:
                    raise self.fail(f"draft.from_target.block_size is set, but precision {precision!r} has no blocks;"
                                    f" block_size applies to precision {' or '.join(BLOCKED_PRECISIONS)}")
                if isinstance(block, bool) or block not in BLOCK_SIZES:
                    raise self.fail(f"draft.from_target.block_size = {block!r} is not allowed;"
                                    f" allowed values: {', '.join(map(str, BLOCK_SIZES))}")
            return DraftSpec(kind="from_target", precision=precision, block_size=block)
        self.string(data, "proposer", "draft", choices=registry.recipe_choices(None))
        sizes = data.get("ngram_sizes")
        if sizes is None:
            sizes = list(DEFAULT_NGRAM_SIZES)
        if not isinstance(sizes, (list, tuple)) or not sizes:
            raise self.fail(
                f"draft.ngram_sizes = {sizes!r} is {_a(sizes)}; expected a non-empty list of"
                f" integers in 1..{MAX_NGRAM}, e.g. [3, 2, 1]"
            )
        for i, n in enumerate(sizes):
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_NGRAM:
                raise self.fail(
                    f"draft.ngram_sizes[{i}] = {n!r} is not allowed; allowed values: integers 1..{MAX_NGRAM}"
                )
        if len(set(sizes)) != len(sizes):
            raise self.fail(f"draft.ngram_sizes = {list(sizes)!r} repeats a size; list each n once")
        return DraftSpec(kind="ngram", ngram_sizes=tuple(sizes))

    def eagle3(self, value: Any) -> DraftSpec:
        path = "draft.eagle3"
        data = self.mapping(value, path)
        self.check_keys(data, path, _EAGLE3_KEYS)
        model = self.string(data, "model", path)
        layers = data.get("layers", "auto")
        if layers != "auto":
            if (not isinstance(layers, (list, tuple)) or len(layers) != 3
                    or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)):
                raise self.fail(f"{path}.layers = {layers!r} is not allowed; expected auto or three layer indices"
                                " [i, j, k] >= 0 (the residual streams entering those target layers)")
            layers = tuple(layers)
        else:
            layers = None
        spec = ModelSpec(model=model, revision=self.string(data, "revision", path, default=None))
        precision = self.string(data, "precision", path, default="fp32", choices=EAGLE3_PRECISIONS)
        return DraftSpec(kind="eagle3", precision=precision, model=spec, layers=layers,
                         allow_pickle=self.boolean(data, "allow_pickle", path, default=False))

    def speculation(self, value: Any) -> SpeculationSpec:
        data = {} if value is None else self.mapping(value, "speculation")
        self.check_keys(data, "speculation", _SPECULATION_KEYS)
        gamma = self.integer(data, "gamma", "speculation", lo=MIN_GAMMA, hi=MAX_GAMMA, default=DEFAULT_GAMMA)
        max_gamma = self.integer(
            data, "max_gamma", "speculation", lo=MIN_GAMMA, hi=MAX_GAMMA, default=max(DEFAULT_MAX_GAMMA, gamma)
        )
        if max_gamma < gamma:
            raise self.fail(
                f"speculation.max_gamma = {max_gamma} is smaller than speculation.gamma = {gamma};"
                f" allowed values: integers {gamma}..{MAX_GAMMA}"
            )
        adaptive = self.boolean(data, "adaptive", "speculation", default=True)
        named = (registry.recipe_choices(kind) for kind in dict.fromkeys(DRAFT_GRAPH_KINDS.values()))
        proposer = self.string(data, "proposer", "speculation", default=None,
                               choices=tuple(dict.fromkeys(name for names in named for name in names)))
        retrieval = self.string(data, "hybrid_retrieval", "speculation", default=DEFAULT_HYBRID_RETRIEVAL,
                                choices=HYBRID_RETRIEVALS)
        return SpeculationSpec(gamma=gamma, max_gamma=max_gamma, adaptive=adaptive, proposer=proposer,
                               hybrid_retrieval=retrieval)

    def validation(self, value: Any) -> ValidationSpec:
        data = {} if value is None else self.mapping(value, "validation")
        self.check_keys(data, "validation", _VALIDATION_KEYS)
        return ValidationSpec(
            enabled=self.boolean(data, "enabled", "validation", default=True),
            prompt=self.string(data, "prompt", "validation", default=None),
        )

    def recipe(self, value: Any) -> Recipe:
        data = self.mapping(value, "")
        self.check_keys(data, "", _TOP_KEYS)
        name = self.string(data, "name", "")
        if not _NAME_RE.match(name):
            raise self.fail(
                f"name = {name!r} is not allowed; use lower-case letters, digits, '.', '_' and '-' ({NAME_PATTERN})"
            )
        max_context = self.integer(data, "max_context", "", lo=MIN_CONTEXT, hi=MAX_CONTEXT)
        target_data = self.mapping(self.require(data, "target", "", "a mapping with at least 'model'"), "target")
        self.check_keys(target_data, "target", _TARGET_KEYS)
        target = self.target(target_data)
        draft = self.draft(self.require(data, "draft", "", "exactly one draft form"))
        speculation = self.speculation(data.get("speculation"))
        allowed = registry.recipe_choices(draft.graph_kind)
        if speculation.proposer is not None and speculation.proposer not in allowed:
            form = "an EAGLE-3 head" if draft.kind == "eagle3" else "a draft model" if draft.has_graph else "the n-gram proposer"
            raise self.fail(f"speculation.proposer = {speculation.proposer!r} is not allowed with {form};"
                            f" allowed values: {', '.join(allowed)}")
        graph = self.string(data, "graph", "", default=DEFAULT_GRAPH, choices=GRAPH_KINDS)
        # MatMulNBits weights are written only into the graphs built with ONNX Runtime's contrib ops (fused)
        contrib = layout_for_form(graph).contrib_attention
        if draft.kind == "eagle3" and not contrib and draft.precision not in PORTABLE_EAGLE3_PRECISIONS:
            raise self.fail(f"draft.eagle3.precision = {draft.precision!r} needs graph: fused (MatMulNBits weights);"
                            f" with graph = {graph!r} expected one of {', '.join(PORTABLE_EAGLE3_PRECISIONS)}")
        if target.precision in QUANTIZED_TARGETS and not contrib:
            raise self.fail(f"target.precision = {target.precision!r} needs graph: fused (MatMulNBits weights in the"
                            f" fused graph form); graph = {graph!r}")
        return Recipe(
            name=name,
            max_context=max_context,
            target=target,
            draft=draft,
            speculation=speculation,
            validation=self.validation(data.get("validation")),
            graph=graph,
            retrieval=self.retrieval(data.get("retrieval")),
            description=self.string(data, "description", "", default=None),
            notes=self.string(data, "notes", "", default=None),
            tested_here=self.boolean(data, "tested_here", "", default=False),
            source=self.source,
        )


    def retrieval(self, value: Any) -> RetrievalSpec | None:
        if value is None:
            return None
        data = self.mapping(value, "retrieval")
        self.check_keys(data, "retrieval", _RETRIEVAL_KEYS)
        corpus = self.require(data, "corpus", "retrieval", "a list of files, folders or globs")
        if isinstance(corpus, str):
            corpus = [corpus]
        if not isinstance(corpus, list) or not corpus or any(not isinstance(c, str) or not c.strip() for c in corpus):
            raise self.fail(f"retrieval.corpus = {corpus!r} is not allowed; expected a non-empty list of paths or globs")
        max_tokens = self.integer(data, "max_tokens", "retrieval", lo=16, hi=MAX_RETRIEVAL_TOKENS,
                                  default=DEFAULT_RETRIEVAL_TOKENS)
        return RetrievalSpec(tuple(corpus), max_tokens)


# --------------------------------------------------------------------------- YAML


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys (PyYAML silently keeps the last one)."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    loader.flatten_mapping(node)
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, Hashable):
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    f"duplicate key {key!r} (first given on line {seen[key] + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def _yaml_error(source: str, exc: yaml.YAMLError) -> RecipeError:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    detail = f"{problem} ({context})" if context else problem
    return RecipeError(f"{source}: YAML syntax error{where}: {detail}")


# --------------------------------------------------------------------------- public functions


def parse_recipe(data: Any, source_name: str = "<recipe>") -> Recipe:
    """Validate a recipe dict (as read from YAML or produced by Recipe.to_dict)."""
    return _Reader(source_name).recipe(data)


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe YAML file; every problem raises RecipeError naming the file."""
    path = Path(path)
    source = str(path)
    if not path.exists():
        raise RecipeError(f"recipe file {source!r} does not exist")
    if not path.is_file():
        raise RecipeError(f"recipe path {source!r} is not a file (expected a .yaml recipe)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"{source}: not valid UTF-8 text ({exc})") from exc
    except OSError as exc:
        raise RecipeError(f"recipe file {source!r} cannot be read: {exc}") from exc
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as exc:
        raise _yaml_error(source, exc) from exc
    if data is None:
        raise RecipeError(f"{source}: the file is empty (expected a recipe mapping, see docs/recipes.md)")
    return parse_recipe(data, source)


def dump_recipe(recipe: Recipe) -> str:
    """The recipe as YAML text (fully explicit); load_recipe reads it back to an equal Recipe."""
    data = recipe.to_dict()
    text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    if yaml.safe_load(text) != data:  # PyYAML mangles a few line-break characters (U+0085) when unescaped
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=False)
    return text


def bundled_recipes() -> list[Path]:
    """The recipe files shipped in the repository's recipes/ folder, sorted by name."""
    return sorted(RECIPES_DIR.glob("*.yaml"))


def resolve_recipe(name_or_path: str | Path) -> Path:
    """A recipe file path: an existing file as given, else a bundled recipe by name (with or without .yaml)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    text = str(name_or_path)
    if "/" not in text and "\\" not in text:
        stem = text[:-5] if text.endswith(".yaml") else text
        candidate = RECIPES_DIR / f"{stem}.yaml"
        if candidate.is_file():
            return candidate
    names = ", ".join(p.stem for p in bundled_recipes()) or "none"
    raise RecipeError(f"recipe {text!r} is neither a file nor a bundled recipe; bundled recipes: {names}")
