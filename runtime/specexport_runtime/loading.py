"""What api.load opens before it builds a SpecGenerator: the artifact's manifest, tokenizer and
calibration (open_artifact, the same for every backend) and its models on one backend
(open_models).

Backends (constants.BACKENDS):
  * "onnxruntime": engine.OrtModel sessions on an execution provider (cpu, cuda, tensorrt);
    with batch=True the batch graphs as slots.SlotModel (slot 0 serves batch-1 calls); the
    target's tree graph (tree_model.TreeVerifier) and a head's (eagle_tree.HeadTree) on the CPU
    provider when the artifact has them.
  * "tensorrt": trt_backend.TrtModel on the engines `python -m specexport_runtime.trt_build`
    wrote for this GPU and TensorRT version (engines.json). Batch-1 graphs and chains only:
    check_backend refuses batch=True and tree_nodes > 0 before anything is read.
Everything else (signature, checksums, GeneratorConfig, proposers) is api.load's, the same for
both."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from .assistant import AssistantModel
from .constants import BACKENDS, ONNXRUNTIME, TENSORRT
from .contract import ASSISTANT, DFLASH_BLOCK
from .eagle_tree import WIDTH as TREE_WIDTH
from .eagle_tree import HeadTree
from .engine import OrtModel, SessionConfig
from .errors import ArtifactError, InvalidArgument
from .manifest import Manifest, ModelEntry, read_manifest, verify_files
from .model import Model
from .paths import check_graph, confined
from .slots import SlotModel, idle_rows, too_few_slots
from .tokenizer import TextCodec
from .tree_model import TreeVerifier

CALIBRATION_NAME = "calibration.json"


@dataclass(frozen=True)
class Models:
    """One artifact's models on one backend. target / draft: what batch-1 calls run on (a batch
    graph's slot 0 when slots is set); tree / head_tree: the tree graphs on the target's / the
    head's cache, or None."""

    target: Model
    draft: Model | None = None
    slots: SlotModel | None = None
    draft_slots: SlotModel | None = None
    tree: TreeVerifier | None = None
    head_tree: HeadTree | None = None


def check_backend(
    backend: str,
    *,
    batch: bool = False,
    tree_nodes: int = 0,
    provider: str = "cpu",
    threads: int | None = None,
    prepack: bool = True,
) -> None:
    """InvalidArgument, one line naming the value, for a backend or a combination `backend`
    cannot run; reads and loads nothing. The ONNX Runtime options (provider, threads, prepack)
    must keep their defaults on "tensorrt"."""
    if backend not in BACKENDS:
        raise InvalidArgument(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == ONNXRUNTIME:
        return
    if batch:
        raise InvalidArgument(
            f"batched generation (batch=True, serve --max-batch > 1) needs backend {ONNXRUNTIME!r}: backend"
            f" {TENSORRT!r} has no batch graphs yet (max_batch 1)"
        )
    if tree_nodes:
        raise InvalidArgument(
            f"tree_nodes {tree_nodes} needs backend {ONNXRUNTIME!r}: backend {TENSORRT!r} verifies chains only"
            " (tree_nodes 0)"
        )
    if provider != "cpu":
        raise InvalidArgument(
            f"provider {provider!r} is an ONNX Runtime execution provider: backend {TENSORRT!r} runs its engines"
            " without ONNX Runtime (leave provider 'cpu', or use backend 'onnxruntime')"
        )
    if threads is not None:
        raise InvalidArgument(
            f"threads {threads} sets ONNX Runtime's intra-op threads: backend {TENSORRT!r} has none (leave it None)"
        )
    if not prepack:
        raise InvalidArgument(f"prepack=False is ONNX Runtime's weight mapping: backend {TENSORRT!r} has no such mode")


def import_backend(backend: str) -> None:
    """Import the backend's libraries now, so that a missing one fails (TensorRTUnavailable)
    before the artifact is hashed."""
    if backend == TENSORRT:
        from . import trt_backend  # noqa: PLC0415 - only on this backend

        trt_backend.import_tensorrt()
        trt_backend.import_cudart()


def open_models(root: Path, manifest: Manifest, backend: str, base: SessionConfig, batch: bool = False) -> Models:
    """The artifact's target and draft (and their batch / tree graphs) on `backend`, whose
    arguments check_backend accepted. base: the draft's ONNX Runtime session settings (the
    target's spinning follows from the draft's presence); "tensorrt" reads only its device_id."""
    if backend == TENSORRT:
        from .trt_backend import TrtModel  # noqa: PLC0415 - only on this backend

        if manifest.draft is not None and manifest.draft.kind == ASSISTANT:
            raise InvalidArgument(
                "a Gemma 4 assistant runs on the onnxruntime backend only (it binds the target's caches)"
            )
        target = TrtModel.from_entry(root, manifest, "target", base.device_id)
        draft = None if manifest.draft is None else TrtModel.from_entry(root, manifest, "draft", base.device_id)
        return Models(target, draft)
    return _open_ort(root, manifest, base, batch)


def _open_ort(root: Path, manifest: Manifest, base: SessionConfig, batch: bool) -> Models:
    has_draft = manifest.draft is not None
    target_config = replace(base, spinning=not has_draft)
    if batch:  # spinning as for a lone session unless the draft's batch graph shares the cores
        if manifest.target.max_batch < 2:
            raise too_few_slots(root, manifest.target.max_batch, 4)  # batch=True: any number of slots > 1
        target_config = replace(base, spinning=not (has_draft and manifest.draft.max_batch > 1))
    target, slots = _open_graph(root, manifest, manifest.target, "target", target_config, batch)
    tree = None
    if manifest.target.tree_graph and not batch and base.provider == "cpu":  # its cache: the batch-1 graph's
        graph = check_graph(root, manifest.target.tree_graph, "target tree graph")
        tree = TreeVerifier(graph, target, target_config)
    draft = draft_slots = None
    if has_draft and manifest.draft.kind == ASSISTANT:  # no cache: it reads the target's (assistant.py)
        if batch:
            raise InvalidArgument("a Gemma 4 assistant drafts for batch-1 generation only; load without batch")
        graph = check_graph(root, manifest.draft.graph, "draft graph")
        rows = max(manifest.max_gamma + 1, TREE_WIDTH)  # a chain's steps, or a tree depth's frontier
        draft = AssistantModel(graph, manifest.draft.graph_spec(), target, base, max_rows=rows)
        return Models(target, draft, slots, None, tree, None)
    if has_draft:  # the draft's batch graph when it has one, its slot 0 serving batch-1 calls
        draft, draft_slots = _open_graph(
            root, manifest, manifest.draft, "draft", base, batch and manifest.draft.max_batch > 1
        )
    head_tree = None
    if tree is not None and draft is not None and manifest.draft.tree_graph:  # on the head's cache
        head_tree = HeadTree(check_graph(root, manifest.draft.tree_graph, "draft tree graph"), draft, base)
    return Models(target, draft, slots, draft_slots, tree, head_tree)


def _open_graph(
    root: Path, manifest: Manifest, entry: ModelEntry, role: str, config: SessionConfig, batch: bool
) -> tuple[Model, SlotModel | None]:
    """One manifest entry's graph on ONNX Runtime: its batch graph with slot 0 as the Model
    (batch), or its batch-1 graph."""
    if not batch:
        graph = check_graph(root, entry.graph, f"{role} graph")
        spec = entry.graph_spec()
        if spec.kind == DFLASH_BLOCK:  # its own cache: context rows kept, a block's rows dropped (dflash.py)
            from .dflash import DFlashModel  # noqa: PLC0415

            return DFlashModel(graph, spec, manifest.max_context, config, entry.block_size), None
        # a recurrent model keeps the state after each of its last max_rows + 1 positions: its calls after
        # the prompt hold at most 1 + max_gamma rows (19.3 MiB a position for Qwen3.5-0.8B)
        rows = {"max_rows": max(manifest.max_gamma + 1, entry.min_rows)} if spec.states else {}
        model = OrtModel(
            graph, spec, manifest.max_context, config, min_rows=entry.min_rows, cache_pad=entry.cache_pad, **rows
        )
        return model, None
    slots = SlotModel(
        check_graph(root, entry.batch_graph, f"{role} batch graph"),
        entry.graph_spec(slots=entry.max_batch),
        manifest.max_context,
        config,
        max_rows=manifest.max_gamma + 1,
        cache_pad=entry.cache_pad,
        min_rows=entry.min_rows,
        idle_rows=idle_rows(manifest.contract_version),
    )
    return slots.view(0), slots


def open_artifact(root: Path, verify: bool = True) -> tuple[Manifest, TextCodec, dict | None]:
    """Manifest (checksums verified), tokenizer/chat template and calibration of an artifact:
    everything but the models, shared by every backend."""
    root = Path(root)
    manifest = read_manifest(root)
    if verify:
        verify_files(root, manifest, lazy=True)  # a stored system prompt's files: on first use
    tok = manifest.tokenizer
    template = (root / tok.chat_template).read_text(encoding="utf-8") if tok.chat_template else None
    vocab = json.loads((root / tok.file).read_text(encoding="utf-8"))
    eos_text = bos_text = None
    for added in vocab.get("added_tokens", []):
        if added["id"] in tok.eos_token_ids and eos_text is None:
            eos_text = added["content"]
        if tok.bos_token_id is not None and added["id"] == tok.bos_token_id:
            bos_text = added["content"]
    codec = TextCodec(root / tok.file, template, bos=bos_text, eos=eos_text)
    calibration = None
    if confined(root, CALIBRATION_NAME, "calibration file").is_file():  # a symlink leaving the folder is refused
        try:
            calibration = json.loads((root / CALIBRATION_NAME).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ArtifactError(f"{CALIBRATION_NAME} is not valid JSON: {exc}") from exc
    return manifest, codec, calibration
