"""`specexport build`, loading: every config checked before any weight is read (refusals first),
then the target (float32 reference, or a checkpoint's quantized blocks) and the draft side (a
draft model with its tokenizer checked against the target's, or an EAGLE-3 head).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BuildError
from ..formats.hf_quantized import quantization_method
from ..graphs.decoder import fused_refusal
from ..models.assistant import is_assistant
from ..models.config import NormalizedConfig, UnsupportedConfig, normalize, read_config
from ..models.sources import (
    ModelSource,
    gguf_header,
    load_blocks,
    load_model,
    load_tokenizer,
    open_checkpoint,
    resolve_source,
    snapshot,
)
from ..models.streaming import open_streamed, streamable
from ..models.tokcheck import check_pair
from ..recipe.spec import CHECKPOINT_TARGETS, ModelSpec, Recipe
from .eagle import load_head

if TYPE_CHECKING:
    from .progress import Clock, Progress


def _source(spec: ModelSpec) -> ModelSource:
    return resolve_source(spec.model, spec.gguf_file, spec.revision)


def check_config(spec: ModelSpec, recipe: Recipe) -> NormalizedConfig:
    """The model's normalized config from its config.json (a GGUF file's metadata) alone, before
    any weight is read: an architecture, config feature or graph form the exporter does not
    reproduce exactly is refused here with one line (model_config.normalize, fused_refusal)."""
    source = _source(spec)
    if source.kind == "gguf":  # our own reading of the metadata; unsupported files refused here
        from ..formats.gguf_config import hf_config

        config = hf_config(gguf_header(source))
    else:
        config = read_config(
            source.location,
            gguf_file=source.gguf_file,
            revision=source.revision,
            trust_remote_code=spec.trust_remote_code,
        )
    norm = normalize(config, recipe.max_context)
    if recipe.layout.contrib_attention:  # what the fused exporter cannot write
        problem = fused_refusal(norm)
        if problem:
            raise UnsupportedConfig(f"{spec.model}: {problem}")
    problem = recurrent_refusal(norm, recipe)
    if problem:
        raise UnsupportedConfig(f"{spec.model}: {problem}")
    return norm


def recurrent_refusal(norm: NormalizedConfig, recipe: Recipe) -> str | None:
    """Why a hybrid model (recurrent layers, feature recurrent_state) cannot be built as the
    recipe asks, or None: its state rides through chain calls (batch slots too) in this contract."""
    if not norm.state_shapes:
        return None
    asked = []
    if recipe.tree_verify:
        asked.append(
            "tree_verify (a tree's recurrence, each node from its parent's state, measured 3-4x the"
            " chain's: docs/trees.md)"
        )
    if recipe.system_prompt is not None:
        asked.append(
            "a stored system prompt (a hybrid resumes a prompt only at a 256-row state checkpoint, which"
            " the artifact does not store; the run-time prefix pool reuses its prompts: docs/prefix-cache.md)"
        )
    if not asked:
        return None
    chain = "whose state rides through chain calls only"
    return f"{norm.family} has recurrent layers, {chain}: build without {'; '.join(asked)}"


def _loaded_config(model, expected: NormalizedConfig, max_context: int) -> NormalizedConfig:
    """The loaded model's normalized config, which must be the one checked before loading."""
    norm = normalize(model.config, max_context)
    # a multimodal checkpoint's causal LM may carry its text config (Qwen3.5: qwen3_5 -> qwen3_5_text)
    if norm != expected and replace(norm, family=expected.family) != expected:
        raise UnsupportedConfig(
            f"the loaded model's config ({norm.describe()}) differs from its config.json ({expected.describe()})"
        )
    return norm


def _load_float(source: ModelSource, spec: ModelSpec, recipe: Recipe, progress: Progress):
    """The float32 reference of a checkpoint, in either graph form: streamed (a transformers
    skeleton reading each weight from the checkpoint when it is needed; streaming.py) from a
    safetensors folder, a GGUF file (gguf_source.py) or a GPTQ / AWQ folder (quantized_source.py);
    a hub id through its snapshot folder; else loaded whole by transformers (a hub GGUF, a folder
    whose tensor names are not the model's)."""
    if source.kind == "hub" and not source.gguf_file:  # its files, safetensors only, as a local folder
        source = ModelSource("folder", str(snapshot(source)))
    streamed = open_checkpoint(source)
    if streamed is not None:
        progress(f"streaming the weights tensor by tensor ({_kind(source)})")
        return streamed
    folder = Path(source.location)
    if source.kind == "folder" and streamable(folder):
        config = read_config(source.location, trust_remote_code=spec.trust_remote_code)
        try:
            model = open_streamed(folder, config)
        except BuildError as exc:
            progress(f"{exc}; loading it whole instead")
        else:
            progress("streaming the weights tensor by tensor (safetensors)")
            return model
    return load_model(source, "float32", spec.trust_remote_code)


def _kind(source: ModelSource) -> str:
    return "GGUF" if source.kind == "gguf" else quantization_method(Path(source.location)) or "safetensors"


def _load_target(source: ModelSource, spec: ModelSpec, recipe: Recipe, progress: Progress) -> tuple[Any, dict]:
    """(float32 reference model, the checkpoint's quantized blocks; {} unless a checkpoint format)."""
    if spec.precision in CHECKPOINT_TARGETS:
        return load_blocks(source, spec.precision)
    return _load_float(source, spec, recipe, progress), {}


@dataclass
class LoadedModels:
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
    drafter: Any = None  # a DFlash block drafter (recipe draft.model, a DFlash folder)
    assistant: Any = None  # a Gemma 4 assistant's AssistantFacts (recipe draft.model; m.draft is the model)
    mtp: Any = None  # the target checkpoint's own MTP layer (recipe draft.mtp): models/mtp.mtp_model


def load_models(recipe: Recipe, progress: Progress, clock: Clock) -> LoadedModels:
    """Configs first (refusals before any weight), then target, then the draft side."""
    progress(f"checking configs (max_context {recipe.max_context}, {recipe.graph} graphs)")
    t_norm = check_config(recipe.target, recipe)
    dflash = recipe.draft.dflash  # a DFlash drafter folder: its own config check (build/dflash.py)
    spec = recipe.draft.model
    assistant = recipe.draft.kind == "model" and not dflash and is_assistant(spec.model, spec.revision)
    own = recipe.draft.kind == "model" and not dflash and not assistant
    d_norm = check_config(recipe.draft.model, recipe) if own else None
    facts = None
    if assistant:  # checked against the target's config before any weight (build/assistant.py)
        from .assistant import check_assistant

        facts = check_assistant(recipe, t_norm)
    mtp_folder = None
    if recipe.draft.kind == "mtp":  # the checkpoint's own mtp.* tensors, by name only (build/mtp.py)
        from . import mtp

        mtp_folder = mtp.check(recipe, _source(recipe.target), t_norm)
    progress(f"target: {t_norm.describe()}")
    clock.stage("check_config")
    progress(f"loading target {recipe.target.model}")
    source = _source(recipe.target)
    tokenizer = load_tokenizer(source, recipe.target.trust_remote_code)
    reference, blocks = _load_target(source, recipe.target, recipe, progress)
    m = LoadedModels(source, tokenizer, reference, blocks, _loaded_config(reference, t_norm, recipe.max_context))
    clock.stage("load_target")
    if mtp_folder is not None:
        from . import mtp

        progress("reading the target checkpoint's MTP layer")
        m.mtp = mtp.load(reference, mtp_folder)
    elif recipe.draft.kind != "mtp":
        from . import mtp

        offered = mtp.note(source)
        if offered:
            progress(offered)
    if recipe.draft.kind == "eagle3":
        progress(f"loading EAGLE-3 head {recipe.draft.model.model}")
        m.head, m.draft_source = load_head(recipe, reference)
        progress(f"EAGLE-3 head: target features {m.head.config.layer_ids_reason}")
        clock.stage("load_draft")
    elif dflash:
        from .dflash import load_drafter

        progress(f"loading DFlash drafter {recipe.draft.model.model}")
        m.drafter, m.draft_source = load_drafter(recipe, reference)
    elif facts is not None:
        from .assistant import load

        progress(f"loading Gemma 4 assistant {recipe.draft.model.model}")
        m.draft, m.draft_source = load(recipe)
        m.assistant = facts
        clock.stage("load_draft")
    elif recipe.draft.kind == "model":
        progress(f"loading draft {recipe.draft.model.model}")
        m.draft_source = _source(recipe.draft.model)
        d_tok = load_tokenizer(m.draft_source, recipe.draft.model.trust_remote_code)
        m.draft = _load_float(m.draft_source, recipe.draft.model, recipe, progress)
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
