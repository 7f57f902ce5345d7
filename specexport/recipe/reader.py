"""Reading and checking a recipe dict into the typed Recipe (recipe_spec.py).

The dict comes from YAML (recipe.load_recipe) or from Recipe.to_dict. Only shape, types and ranges
are checked here; whether a model path or hub id exists is resolved at build time. Every error is
one RecipeError line naming the source, the field path, the value and what is allowed. The
readers of single fields are recipe_fields.py; this module reads the sections.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

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
from specexport_runtime.contract import layout_for_form

from .fields import FieldReader, a_type
from .spec import (
    ACCURACY_LEVELS,
    BLOCK_SIZE,
    BLOCK_SIZES,
    BLOCKED_PRECISIONS,
    BUILTIN_PREFIX,
    CHECKPOINT_TARGETS,
    DEFAULT_ACCURACY_LEVEL,
    DEFAULT_GRAPH,
    DEFAULT_RETRIEVAL_TOKENS,
    DEFAULT_SELF_DRAFT_PRECISION,
    DRAFT_GRAPH_KINDS,
    DRAFT_MODEL_PRECISIONS,
    EAGLE3_PRECISIONS,
    GRAPH_KINDS,
    INT8_ACTIVATIONS,
    MAX_CONTEXT,
    MIN_CONTEXT,
    PORTABLE_EAGLE3_PRECISIONS,
    QUANTIZED_DTYPES,
    QUANTIZED_TARGETS,
    RTN_TARGETS,
    SELF_DRAFT_PRECISIONS,
    TARGET_PRECISIONS,
    TENSOR_MODES,
    DraftSpec,
    ModelSpec,
    QuantizationSpec,
    Recipe,
    RetrievalSpec,
    SpeculationSpec,
    ValidationSpec,
)

__all__ = ["parse_recipe"]

NAME_PATTERN = r"[a-z0-9][a-z0-9._-]{0,127}"  # within the runtime's manifest name rule (NAME_RE)
_NAME_RE = re.compile(NAME_PATTERN + r"\Z")

# the keys allowed in each section of a recipe
_TOP_KEYS = (
    "name",
    "description",
    "max_context",
    "max_batch",
    "tree_verify",
    "graph",
    "target",
    "draft",
    "speculation",
    "validation",
    "retrieval",
    "notes",
    "tested_here",
    "system_prompt",
)
_RETRIEVAL_KEYS = ("corpus", "max_tokens")
MAX_BATCH = 64
MAX_RETRIEVAL_TOKENS = 1 << 31
_TOP_REQUIRED = ("name", "max_context", "target", "draft")
_MODEL_KEYS = ("model", "gguf_file", "precision", "revision", "trust_remote_code")
_TARGET_KEYS = _MODEL_KEYS + ("quantization", "exactness")
_QUANTIZATION_KEYS = ("block_size", "accuracy_level", "head", "embedding", "dtype")
_SPECULATION_KEYS = ("gamma", "max_gamma", "adaptive", "proposer", "hybrid_retrieval")
_VALIDATION_KEYS = ("enabled", "prompt")
_FROM_TARGET_KEYS = ("precision", "block_size")
_EAGLE3_KEYS = ("model", "layers", "precision", "revision", "allow_pickle")
# draft forms: kind -> (the key that selects the form, the keys allowed with it)
_DRAFT_FORMS = {
    "model": ("model", _MODEL_KEYS),
    "from_target": ("from_target", ("from_target",)),
    "ngram": ("proposer", ("proposer", "ngram_sizes")),
    "eagle3": ("eagle3", ("eagle3",)),
    "mtp": ("mtp", ("mtp",)),
}
_DRAFT_KEYS = tuple(dict.fromkeys(k for _, keys in _DRAFT_FORMS.values() for k in keys))


class _Reader(FieldReader):
    """Reads one recipe dict section by section (the field readers: recipe_fields.py); every error
    names the source, the field path and what was expected."""

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
            raise self.fail(
                f"target.precision = 'gguf' keeps a GGUF file's own blocks,"
                f" but target.model = {spec.model!r}"
                " is not a GGUF source (give a .gguf file, gguf_file, or a builtin model)"
            )
        if precision in ("gptq", "awq") and spec.is_gguf:
            raise self.fail(
                f"target.precision = {precision!r} needs a Hugging Face folder"
                f" with a {precision} checkpoint, not the GGUF source {spec.model!r}"
            )
        quant = data.get("quantization")
        if quant is not None and precision not in QUANTIZED_TARGETS:
            raise self.fail(
                f"target.quantization is set, but target.precision = {precision!r} is not quantized;"
                f" it applies to precision {', '.join(QUANTIZED_TARGETS)}"
            )
        quantization = self.quantization(quant, precision) if precision in QUANTIZED_TARGETS else None
        exactness = self.string(data, "exactness", "target", default="bitwise", choices=EXACTNESS)
        return ModelSpec(
            model=spec.model,
            precision=precision,
            gguf_file=spec.gguf_file,
            revision=spec.revision,
            trust_remote_code=spec.trust_remote_code,
            quantization=quantization,
            exactness=exactness,
        )

    def quantization(self, value: Any, precision: str) -> QuantizationSpec:
        path = "target.quantization"
        data = {} if value is None else self.mapping(value, path)
        self.check_keys(data, path, _QUANTIZATION_KEYS)
        block = data.get("block_size")
        if precision in RTN_TARGETS:
            if block is None:
                block = BLOCK_SIZE
            if isinstance(block, bool) or block not in BLOCK_SIZES:
                raise self.fail(
                    f"{path}.block_size = {block!r} is not allowed; allowed values: {', '.join(map(str, BLOCK_SIZES))}"
                )
        elif block is not None:
            raise self.fail(
                f"{path}.block_size is set, but a {precision} target keeps the checkpoint's own blocks;"
                f" block_size applies to precision {' or '.join(RTN_TARGETS)}"
            )
        level = self.integer(
            data,
            "accuracy_level",
            path,
            lo=min(ACCURACY_LEVELS),
            hi=max(ACCURACY_LEVELS),
            default=DEFAULT_ACCURACY_LEVEL,
        )
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
                hint = (
                    " (put it inside from_target, e.g. from_target: {precision: int8})"
                    if (kind == "from_target" and key in _FROM_TARGET_KEYS)
                    else ""
                )
                raise self.fail(
                    f"key {key!r} is not allowed in section 'draft' next to draft.{marker}: it belongs to the"
                    f" draft.{_DRAFT_FORMS[owner][0]} form{hint};"
                    f" allowed keys with draft.{marker}: {', '.join(allowed)}"
                )
        if kind == "model":
            spec = self.model_spec(data, "draft", DRAFT_MODEL_PRECISIONS, "fp32")
            return DraftSpec(kind="model", precision=spec.precision, model=spec)
        if kind == "eagle3":
            return self.eagle3(data["eagle3"])
        if kind == "mtp":  # the target checkpoint's own MTP layer: nothing to choose yet
            inner = data["mtp"]
            self.check_keys({} if inner is None else self.mapping(inner, "draft.mtp"), "draft.mtp", ())
            return DraftSpec(kind="mtp", precision="fp32")
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
                    raise self.fail(
                        f"draft.from_target.block_size is set, but precision {precision!r} has no blocks;"
                        f" block_size applies to precision {' or '.join(BLOCKED_PRECISIONS)}"
                    )
                if isinstance(block, bool) or block not in BLOCK_SIZES:
                    raise self.fail(
                        f"draft.from_target.block_size = {block!r} is not allowed;"
                        f" allowed values: {', '.join(map(str, BLOCK_SIZES))}"
                    )
            return DraftSpec(kind="from_target", precision=precision, block_size=block)
        self.string(data, "proposer", "draft", choices=registry.recipe_choices(None))
        sizes = data.get("ngram_sizes")
        if sizes is None:
            sizes = list(DEFAULT_NGRAM_SIZES)
        if not isinstance(sizes, (list, tuple)) or not sizes:
            raise self.fail(
                f"draft.ngram_sizes = {sizes!r} is {a_type(sizes)}; expected a non-empty list of"
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
            if (
                not isinstance(layers, (list, tuple))
                or len(layers) != 3
                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)
            ):
                raise self.fail(
                    f"{path}.layers = {layers!r} is not allowed; expected auto or three layer indices"
                    " [i, j, k] >= 0 (the residual streams entering those target layers)"
                )
            layers = tuple(layers)
        else:
            layers = None
        spec = ModelSpec(model=model, revision=self.string(data, "revision", path, default=None))
        precision = self.string(data, "precision", path, default="fp32", choices=EAGLE3_PRECISIONS)
        return DraftSpec(
            kind="eagle3",
            precision=precision,
            model=spec,
            layers=layers,
            allow_pickle=self.boolean(data, "allow_pickle", path, default=False),
        )

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
        proposer = self.string(
            data,
            "proposer",
            "speculation",
            default=None,
            choices=tuple(dict.fromkeys(name for names in named for name in names)),
        )
        retrieval = self.string(
            data, "hybrid_retrieval", "speculation", default=DEFAULT_HYBRID_RETRIEVAL, choices=HYBRID_RETRIEVALS
        )
        return SpeculationSpec(
            gamma=gamma, max_gamma=max_gamma, adaptive=adaptive, proposer=proposer, hybrid_retrieval=retrieval
        )

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
            form = (
                "an EAGLE-3 head"
                if draft.kind == "eagle3"
                else "a draft model"
                if draft.has_graph
                else "the n-gram proposer"
            )
            raise self.fail(
                f"speculation.proposer = {speculation.proposer!r} is not allowed with {form};"
                f" allowed values: {', '.join(allowed)}"
            )
        graph = self.string(data, "graph", "", default=DEFAULT_GRAPH, choices=GRAPH_KINDS)
        # MatMulNBits weights are written only into the graphs built with ONNX Runtime's contrib ops (fused)
        contrib = layout_for_form(graph).contrib_attention
        if draft.kind == "eagle3" and not contrib and draft.precision not in PORTABLE_EAGLE3_PRECISIONS:
            raise self.fail(
                f"draft.eagle3.precision = {draft.precision!r} needs graph: fused (MatMulNBits weights);"
                f" with graph = {graph!r} expected one of {', '.join(PORTABLE_EAGLE3_PRECISIONS)}"
            )
        max_batch = self.integer(data, "max_batch", "", lo=1, hi=MAX_BATCH, default=1)
        if max_batch > 1 and draft.kind in ("eagle3", "mtp"):
            raise self.fail(
                f"max_batch = {max_batch} with {'an EAGLE-3 head' if draft.kind == 'eagle3' else 'an MTP head'}:"
                " the batch graph has no feature output; use max_batch 1 or another draft form"
            )
        tree_verify = self.boolean(data, "tree_verify", "", default=False)
        if tree_verify and not contrib and draft.kind in ("eagle3", "mtp"):
            raise self.fail(
                f"tree_verify = true with {'an EAGLE-3 head' if draft.kind == 'eagle3' else 'an MTP head'} needs"
                f" graph: fused (the portable head has no tree graph); graph = {graph!r}"
            )
        if tree_verify and target.quantization is not None and target.quantization.accuracy_level == INT8_ACTIVATIONS:
            raise self.fail(
                f"tree_verify = true with target.quantization.accuracy_level = {INT8_ACTIVATIONS}: int8 activations"
                " turn the tree graph's attention rounding into logit differences of about one (2.46 on"
                " smollm2-135m-q4, argmax 12/13 rows), so trees would change greedy output; use"
                " accuracy_level 0 (fp32 activations) or leave tree_verify off"
            )
        if target.precision in QUANTIZED_TARGETS and not contrib:
            raise self.fail(
                f"target.precision = {target.precision!r} needs graph: fused (MatMulNBits weights in the"
                f" fused graph form); graph = {graph!r}"
            )
        return Recipe(
            name=name,
            max_context=max_context,
            max_batch=max_batch,
            tree_verify=tree_verify,
            target=target,
            draft=draft,
            speculation=speculation,
            validation=self.validation(data.get("validation")),
            graph=graph,
            retrieval=self.retrieval(data.get("retrieval")),
            description=self.string(data, "description", "", default=None),
            notes=self.string(data, "notes", "", default=None),
            tested_here=self.boolean(data, "tested_here", "", default=False),
            system_prompt=self.string(data, "system_prompt", "", default=None),
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
            raise self.fail(
                f"retrieval.corpus = {corpus!r} is not allowed; expected a non-empty list of paths or globs"
            )
        max_tokens = self.integer(
            data, "max_tokens", "retrieval", lo=16, hi=MAX_RETRIEVAL_TOKENS, default=DEFAULT_RETRIEVAL_TOKENS
        )
        return RetrievalSpec(tuple(corpus), max_tokens)


def parse_recipe(data: Any, source_name: str = "<recipe>") -> Recipe:
    """Validate a recipe dict (as read from YAML or produced by Recipe.to_dict)."""
    return _Reader(source_name).recipe(data)


def with_overrides(recipe: Recipe, overrides: Mapping[str, Any]) -> Recipe:
    """A validated copy of `recipe` with dotted-path overrides, e.g. {"speculation.gamma": 6,
    "max_context": 4096}."""
    data = recipe.to_dict()
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
    return parse_recipe(data, recipe.source or f"recipe {recipe.name!r} with overrides")
