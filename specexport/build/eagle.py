"""Build stages of an EAGLE-3 draft head (recipe `draft: {eagle3: ...}`): load and check the
published head against the target, export its graph, and report how often it agrees with the
target on the probe text (what its acceptance will roughly be; the strict numerical check of the
graph against an independent forward is in tests/build/test_eagle3.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from specexport_runtime import contract
from specexport_runtime.manifest import ModelEntry

from ..errors import BuildError
from ..formats.eagle3 import Eagle3Head, TargetShape, load_eagle3_head
from ..graphs.eagle import build_eagle3_head
from ..graphs.writer import share_weights
from ..models.config import normalize
from ..models.sources import ModelSource, resolve_source, snapshot
from ..models.streaming import input_embedding
from ..recipe.spec import Recipe

VOCAB_MAP = "draft/vocab_map.npy"  # int64 [V_draft]: the target id of each draft row


def head_folder(recipe: Recipe) -> tuple[Path, ModelSource]:
    """The head's local folder (a hub id is fetched as a safetensors-only snapshot)."""
    spec = recipe.draft.model
    path = Path(spec.model).expanduser()
    if path.is_dir():
        return path, ModelSource("folder", str(path))
    source = resolve_source(spec.model, revision=spec.revision)
    if source.kind != "hub":
        raise BuildError(f"draft.eagle3.model = {spec.model!r} is neither a head folder nor a hub id")
    return snapshot(source), source


def load_head(recipe: Recipe, reference) -> tuple[Eagle3Head, ModelSource]:
    folder, source = head_folder(recipe)
    shape = TargetShape.from_hf_config(reference.config)
    head = load_eagle3_head(folder, shape, allow_pickle=recipe.draft.allow_pickle, layers=recipe.draft.layers)
    return head, source


def target_embedding(reference) -> torch.Tensor:
    """The target's input embedding [V, H] in float32 as its decoder sees it (what the head
    embeds its tokens with; the trainer uses the same): the table times Gemma's sqrt(hidden) or
    Granite's embedding_multiplier, which transformers applies after the lookup."""
    table = input_embedding(reference).float()
    norm = normalize(reference.config)
    if norm.arch.embed_scale:
        table = table * torch.tensor(norm.hidden**0.5, dtype=torch.float32)
    if norm.embedding_multiplier is not None:
        table = table * norm.embedding_multiplier
    return table


def export_head(
    head: Eagle3Head,
    reference,
    root: Path,
    recipe: Recipe,
    source: ModelSource,
    vocab: int,
    target_graph=None,
    probe: list[int] | None = None,
) -> ModelEntry:
    """Write draft/model.onnx + the vocabulary map; with the target's ExportResult and the
    probe, also report the head's agreement with the target (validation)."""
    embedding = head.embed_tokens if head.embed_tokens is not None else target_embedding(reference)
    result = build_head_graph(head, embedding, root / "draft", recipe)
    np.save(root / VOCAB_MAP, head.draft_to_target(), allow_pickle=False)
    tree_graph = export_head_tree(head, embedding, result, recipe) if recipe.tree_verify else None
    validation: dict = {
        "layer_ids": list(head.config.layer_ids),
        "layer_ids_source": head.config.layer_ids_source,
        "layer_ids_reason": head.config.layer_ids_reason,
    }
    if target_graph is not None and probe is not None:
        validation.update(agreement(result, head, target_graph, probe))
        if tree_graph is not None:
            validation["tree_rows"] = head_tree_check(result, root / tree_graph, target_graph, probe)
    c = head.config
    return ModelEntry(
        graph="draft/model.onnx",
        source=source.describe(),
        architecture="eagle3",
        num_layers=1,
        num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        vocab_size=vocab,
        embedding_rows=c.draft_vocab_size,
        precision=recipe.draft.precision,
        kv_dtype=result.spec.kv_dtype,
        validation=validation,
        kv_layout=result.spec.kv_layout,
        feature_width=result.spec.feature_width,
        kind=contract.EAGLE3_HEAD,
        hidden_width=c.hidden_size,
        vocab_map=VOCAB_MAP,
        tree_graph=tree_graph,
    )


HEAD_TREE_GRAPH = "tree.onnx"


def export_head_tree(head: Eagle3Head, embedding: torch.Tensor, solo, recipe: Recipe) -> str:
    """The head's tree graph (feature eagle3_head_tree) as draft/tree.onnx beside its graph, reading the same
    weights file; returns its artifact-relative path. The fused form only (recipe_reader refuses
    tree_verify with the portable graph form, whose head has a time-major cache)."""
    if not recipe.layout.contrib_attention:
        raise BuildError("tree_verify with an EAGLE-3 head needs graph: fused (the portable head has no tree graph)")
    with tempfile.TemporaryDirectory(dir=solo.path.parent.parent) as scratch:
        build_eagle3_head(
            head, embedding, Path(scratch), recipe.max_context, precision=recipe.draft.precision, tree=True
        )
        return share_weights(Path(scratch) / "model.onnx", solo.path, HEAD_TREE_GRAPH, "tree_verify")


def head_tree_check(result, tree_path: Path, target_graph, probe: list[int]) -> dict:
    """rowcheck.head_tree_rows on the probe: the target's features of its first half as the
    catch-up, then the probe's next tokens as the tree's nodes."""
    from specexport_runtime.eagle_tree import HeadTree
    from specexport_runtime.engine import OrtModel, SessionConfig

    from .rowcheck import HEAD_TREE_PARENTS, head_tree_rows
    from .validate import FeedRunner

    runner = FeedRunner(target_graph.path, target_graph.spec)
    runner.run(probe, [len(probe) - 1])
    k = max(1, len(probe) // 2)
    need = k + 1 + len(HEAD_TREE_PARENTS)
    tokens = (list(probe) * (need // len(probe) + 1))[:need]
    config = SessionConfig(provider="cpu")
    head = OrtModel(result.path, result.spec, len(tokens) + 8, config, max_rows=max(k, 8))
    report = head_tree_rows(head, HeadTree(tree_path, head, config), runner.features[:k], tokens)
    return report.to_dict()


def build_head_graph(head: Eagle3Head, embedding: torch.Tensor, out_dir: Path, recipe: Recipe):
    """The head graph in the recipe's form: fused (contrib ops, in-place head-major cache) or
    portable (standard ops, time-major cache)."""
    return build_eagle3_head(
        head, embedding, out_dir, recipe.max_context, precision=recipe.draft.precision, kv_layout=recipe.layout.name
    )


def agreement(result, head: Eagle3Head, target_graph, probe: list[int]) -> dict:
    """Top-1 agreement of the head's first draft step with the target's own next token over the
    probe, teacher forced: head row t pairs the target's features of position t with probe[t + 1]
    and predicts position t + 2, which the target predicts from its logits row t + 1."""
    from specexport_runtime.engine import OrtModel, SessionConfig

    from .validate import FeedRunner

    runner = FeedRunner(target_graph.path, target_graph.spec)
    target_logits = runner.run(probe, list(range(len(probe))))  # [N, V]
    features = runner.features  # [N, F]
    n = len(probe) - 2
    model = OrtModel(result.path, result.spec, len(probe) + 1, SessionConfig(provider="cpu"), max_rows=len(probe))
    logits = model.forward(probe[1 : n + 1], last_rows=n, features=features[:n])  # [n, V_draft]
    if not np.all(np.isfinite(logits)):
        raise BuildError("the EAGLE-3 head graph returned non-finite logits on the probe")
    drafted = head.draft_to_target()[logits.argmax(-1)]
    hits = float(np.mean(drafted == target_logits[1 : n + 1].argmax(-1)))
    return {
        "target_agreement": hits,
        "probe_rows": n,
        "note": "top-1 agreement of the head's first draft step with the target's next token (teacher forced)",
    }
