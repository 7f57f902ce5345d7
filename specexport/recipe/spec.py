"""The typed recipe: its dataclasses and the vocabularies they take values from (docs/recipes.md).

Every spec is a frozen dataclass whose `to_dict()` is fully explicit (every default filled in);
`recipe_reader.parse_recipe` reads such a dict back to an equal object. Reading and checking YAML
is `recipe_reader.py`; files and bundled recipes are `recipe.py`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specexport_runtime import registry
from specexport_runtime.constants import DEFAULT_GAMMA, DEFAULT_HYBRID_RETRIEVAL, DEFAULT_MAX_GAMMA
from specexport_runtime.contract import DECODER, DFLASH_BLOCK, EAGLE3_HEAD, GRAPH_FORMS, MTP, KvLayout, layout_for_form

from ..errors import RecipeError

BUILTIN_PREFIX = "builtin:"

FLOAT_TARGETS = ("fp32", "fp16")
RTN_TARGETS = ("int8", "int4")  # weight-only, quantized at build time (round to nearest)
CHECKPOINT_TARGETS = ("gguf", "gptq", "awq")  # the checkpoint's own quantized blocks, kept exactly
QUANTIZED_TARGETS = RTN_TARGETS + CHECKPOINT_TARGETS
TARGET_PRECISIONS = FLOAT_TARGETS + QUANTIZED_TARGETS
TENSOR_MODES = ("fp32", "int8", "int4", "checkpoint")  # how a quantized target stores its head / embedding
ACCURACY_LEVELS = (0, 1, 2, 3, 4)  # MatMulNBits: 0/1 fp32 activations, 2 fp16, 3 bf16, 4 int8
DEFAULT_ACCURACY_LEVEL = 4
INT8_ACTIVATIONS = 4  # the accuracy_level whose rows are not row-invariant across attention paths (no trees)
# exactness (constants.EXACTNESS): "bitwise" pads the target (its attention in a fused graph, else its
# calls to >= 2 rows; feature row_padding) so a row never depends on its call's size; "numerical" leaves it unpadded
DRAFT_MODEL_PRECISIONS = ("fp32", "fp16", "int8", "int4", "dynamic-int8")
SELF_DRAFT_PRECISIONS = ("int8", "int4", "dynamic-int8", "fp16")
DRAFT_KINDS = ("model", "from_target", "ngram", "eagle3", "mtp")
# the artifact's draft graph kind of each draft form (None: no draft graph); which proposers a
# recipe may name with a form is the registry's answer for that kind (registry.recipe_choices)
DRAFT_GRAPH_KINDS = {"model": DECODER, "from_target": DECODER, "ngram": None, "eagle3": EAGLE3_HEAD, "mtp": MTP}
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
DEFAULT_RETRIEVAL_TOKENS = 10_000_000
QUANTIZED_DTYPES = ("fp32", "fp16")
EAGLE3_PRECISIONS = ("fp32", "fp16", "int8")  # eagle_graph.HEAD_PRECISIONS
# eagle_graph.PORTABLE_HEAD_PRECISIONS (int8: MatMulNBits, fused only)
PORTABLE_EAGLE3_PRECISIONS = ("fp32", "fp16")


# --------------------------------------------------------------------------- typed recipe


@dataclass(frozen=True)
class QuantizationSpec:
    """How a quantized target (QUANTIZED_TARGETS) stores its weights (specexport/graphs/quantized_target.py).

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
        return {
            "block_size": self.block_size,
            "accuracy_level": self.accuracy_level,
            "head": self.head,
            "embedding": self.embedding,
            "dtype": self.dtype,
        }


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
    kind "mtp":         the target checkpoint's own MTP layer (`mtp.*` tensors; specexport/models/mtp.py)
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
            raise RecipeError(
                f"draft block_size applies to from_target drafts of precision"
                f" {' or '.join(BLOCKED_PRECISIONS)}"
                f" only, not to a {self.kind} draft of precision {self.precision!r}"
            )
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
    def dflash(self) -> bool:
        """A draft model whose local folder is a DFlash block drafter (its config.json names
        target_layer_ids, block_size and mask_token_id; specexport.models.dflash)."""
        if self.kind != "model":
            return False
        config = Path(self.model.model).expanduser() / "config.json"
        try:
            raw = json.loads(config.read_text()) if config.is_file() else {}
        except (OSError, ValueError):
            return False
        inner = raw.get("dflash_config")
        return (isinstance(inner, dict) and "target_layer_ids" in inner) or all(
            k in raw for k in ("target_layer_ids", "block_size", "mask_token_id")
        )

    @property
    def graph_kind(self) -> str | None:
        """The kind of the draft graph this form builds (contract.GRAPH_KINDS), None without one."""
        return DFLASH_BLOCK if self.dflash else DRAFT_GRAPH_KINDS[self.kind]

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "model":
            return self.model.to_dict()
        if self.kind == "from_target":
            inner: dict[str, Any] = {"precision": self.precision}
            if self.block_size is not None:
                inner["block_size"] = self.block_size
            return {"from_target": inner}
        if self.kind == "eagle3":
            return {
                "eagle3": {
                    "model": self.model.model,
                    "revision": self.model.revision,
                    "precision": self.precision,
                    "layers": "auto" if self.layers is None else list(self.layers),
                    "allow_pickle": self.allow_pickle,
                }
            }
        if self.kind == "mtp":
            return {"mtp": {}}
        return {"proposer": "ngram", "ngram_sizes": list(self.ngram_sizes)}


@dataclass(frozen=True)
class SpeculationSpec:
    gamma: int = DEFAULT_GAMMA
    max_gamma: int = DEFAULT_MAX_GAMMA
    adaptive: bool = True  # False: the runtime keeps gamma at its start (calibrated, else `gamma`)
    proposer: str | None = None  # None: the draft form's default (registry.recipe_default)
    hybrid_retrieval: str = DEFAULT_HYBRID_RETRIEVAL  # what `hybrid` retrieves with (constants.HYBRID_RETRIEVALS)

    def to_dict(self) -> dict[str, Any]:
        return {
            "gamma": self.gamma,
            "max_gamma": self.max_gamma,
            "adaptive": self.adaptive,
            "proposer": self.proposer,
            "hybrid_retrieval": self.hybrid_retrieval,
        }


@dataclass(frozen=True)
class ValidationSpec:
    enabled: bool = True
    prompt: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "prompt": self.prompt}


@dataclass(frozen=True)
class RetrievalSpec:
    """A corpus datastore built into the artifact (specexport/build/datastore.py): files, folders or
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
    max_batch: int = 1  # cache slots of the target's batch graph (feature cache_slots); 1: no batch graph
    tree_verify: bool = False  # tree graphs: the target's (tree_verify), an EAGLE-3 head's (eagle3_head_tree, fused)
    # a UTF-8 file (relative to the current folder) whose text is stored prefilled as the system
    # prompt (build/prompt.py, docs/prefix-cache.md); None: none
    system_prompt: str | None = None
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
            "max_batch": self.max_batch,
            "tree_verify": self.tree_verify,
            "graph": self.graph,
            "target": self.target.to_dict(),
            "draft": self.draft.to_dict(),
            "speculation": self.speculation.to_dict(),
            "validation": self.validation.to_dict(),
            "retrieval": None if self.retrieval is None else self.retrieval.to_dict(),
            "notes": self.notes,
            "tested_here": self.tested_here,
            **({"system_prompt": self.system_prompt} if self.system_prompt is not None else {}),
        }
