"""Build stages of a DFlash block drafter (recipe `draft: {model: PATH}` whose folder is a DFlash
drafter, recipe.spec.DraftSpec.dflash): read and check it against the target before anything is
written, write its graph with the target's embedding and output head, and report how often its
first draft agrees with the target on the probe (what its acceptance will roughly be; the strict
check of the graph against transformers' forward is tests/build/test_dflash.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specexport_runtime import contract
from specexport_runtime.manifest import ModelEntry

from ..errors import BuildError
from ..graphs.dflash import build_dflash_graph
from ..models.dflash import DFlashDrafter, load_dflash
from ..models.sources import ModelSource
from ..models.streaming import source_of
from ..recipe.spec import Recipe
from .eagle import target_embedding

GRAPH = "draft/model.onnx"


def load_drafter(recipe: Recipe, reference) -> tuple[DFlashDrafter, ModelSource]:
    """The drafter of recipe.draft.model (a local folder), checked against the target's config."""
    folder = Path(recipe.draft.model.model).expanduser()
    if recipe.draft.precision != "fp32":
        raise BuildError(f"a DFlash drafter is built in fp32; got draft precision {recipe.draft.precision!r}")
    return load_dflash(folder, reference.config), ModelSource("folder", str(folder))


def target_head(reference) -> torch.Tensor | None:
    """The target's output head [V, H] float32, or None when it is the input embedding as the
    decoder sees it (tied and unscaled: the graph stores the table once)."""
    out, embed = reference.get_output_embeddings(), reference.get_input_embeddings()
    names = {id(m): n for n, m in reference.named_modules()}
    source = source_of(reference)
    head_name, embed_name = f"{names[id(out)]}.weight", f"{names[id(embed)]}.weight"
    tied = source.canonical(head_name) == source.canonical(embed_name)
    if tied and torch.equal(target_embedding(reference)[:1], source.get(embed_name)[:1].float()):
        return None
    return source.get(head_name).detach().float()


def export_dflash(
    drafter: DFlashDrafter, reference, root: Path, source: ModelSource, vocab: int, target_graph=None, probe=None
) -> ModelEntry:
    """Write draft/model.onnx; with the target's ExportResult and the probe, also report the
    drafter's agreement with the target (validation)."""
    result = build_dflash_graph(drafter, target_embedding(reference), target_head(reference), root / "draft")
    c = drafter.config
    validation: dict = {"target_layer_ids": list(c.target_layer_ids), "block_size": c.block_size}
    if target_graph is not None and probe:
        validation.update(agreement(result, drafter, target_graph, probe))
    return ModelEntry(
        graph=GRAPH,
        source=source.describe(),
        architecture="dflash",
        num_layers=c.num_layers,
        num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        vocab_size=vocab,
        embedding_rows=result.spec.embedding_rows,
        precision="fp32",
        validation=validation,
        kv_layout=contract.TIME_MAJOR,
        feature_width=c.feature_width,
        kind=contract.DFLASH_BLOCK,
        block_size=c.block_size,
        mask_token_id=c.mask_token_id,
    )


def agreement(result, drafter: DFlashDrafter, target_graph, probe: list[int]) -> dict:
    """Top-1 agreement of the first draft of a block with the target's next token over the probe,
    teacher forced: a block anchored at position t + 1 after the context 0 .. t drafts position t + 2."""
    from specexport_runtime.dflash import DFlashModel
    from specexport_runtime.engine import SessionConfig

    from .validate import FeedRunner

    runner = FeedRunner(target_graph.path, target_graph.spec)
    target_logits = runner.run(probe, list(range(len(probe))))  # [N, V]
    features = runner.features  # [N, F]
    c = drafter.config
    model = DFlashModel(result.path, result.spec, len(probe) + 1, SessionConfig(provider="cpu"), c.block_size)
    hits, n = 0, len(probe) - 2
    for t in range(n):
        block = [probe[t + 1]] + [c.mask_token_id] * (c.block_size - 1)
        logits = model.forward(block, last_rows=c.block_size - 1, features=features[t : t + 1])
        if not np.all(np.isfinite(logits)):
            raise BuildError("the DFlash drafter graph returned non-finite logits on the probe")
        hits += int(logits[0].argmax() == target_logits[t + 1].argmax())
    return {
        "target_agreement": hits / max(n, 1),
        "probe_rows": n,
        "note": "top-1 agreement of a block's first draft with the target's next token (teacher forced)",
    }
