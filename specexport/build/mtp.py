"""Building a target checkpoint's own MTP layer as the draft (recipe `draft: {mtp: {}}`; kind mtp,
proposer mtp): the checks before any weight is read, the skeleton after the target is loaded,
and the export with its check against the MTP equations on the target's own hidden rows; with
tree_verify (graph: fused) also its tree graph, draft/tree.onnx on the same weights file, whose
rows are checked against chain calls of each path (rowcheck.head_tree_rows)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch

from specexport_runtime import contract
from specexport_runtime.manifest import ModelEntry

from ..graphs.mtp import build_mtp
from ..graphs.writer import share_weights
from ..models import mtp_deepseek
from ..models.config import read_config
from ..models.mtp import FAMILIES, check_mtp, mtp_model, offer
from ..models.sources import ModelSource, snapshot

GRAPH = "draft/model.onnx"
TREE_GRAPH = "tree.onnx"  # beside GRAPH
CHECK_ROWS = 8  # probe rows the build runs through the graph and the model


def folder_of(source: ModelSource) -> Path | None:
    """The local safetensors folder of a target source (a hub id: its snapshot), None for GGUF."""
    if source.kind == "gguf" or source.gguf_file:
        return None
    if source.kind == "hub":
        return snapshot(source)
    return Path(source.location)


def check(recipe, source: ModelSource, norm) -> Path:
    """Refuse, in one line and before any weight is read, a target without one MTP layer of a
    layout implemented for its family (Qwen3.5's mtp.*, or a DeepSeek-style layer: mtp_deepseek)."""
    folder = folder_of(source)
    config = None
    deepseek = norm.family in mtp_deepseek.FAMILIES
    if folder is not None and (norm.family in FAMILIES or deepseek):
        config = read_config(str(folder), trust_remote_code=recipe.target.trust_remote_code)
    if deepseek:
        mtp_deepseek.check(recipe.target.model, folder, norm.family, config, norm.windows)
    else:
        check_mtp(recipe.target.model, folder, norm.family, config)
    return folder


def note(source: ModelSource) -> str | None:
    """The build's offer when the target carries MTP layers that the recipe does not use."""
    try:
        folder = folder_of(source) if source.kind == "folder" else None
        return offer(folder) or mtp_deepseek.offer(folder)
    except (OSError, ValueError):
        return None


def load(reference, folder: Path) -> torch.nn.Module:
    text = reference.config.get_text_config()
    if text.model_type in mtp_deepseek.FAMILIES:  # checked by check(): one layer of a known layout
        layout = mtp_deepseek.check(str(folder), folder, text.model_type, text)
        return mtp_deepseek.mtp_model(reference, folder, layout)
    return mtp_model(reference, folder)


def export_mtp(model, reference, root: Path, recipe, source: ModelSource, vocab: int, probe) -> ModelEntry:
    """Write the MTP graph in the recipe's layout and its manifest entry; with a probe, compare
    its catch-up rows against the model's forward (validation: max |logit diff|, argmax)."""
    result = build_mtp(model, root / "draft", recipe.max_context, recipe.layout.name)
    spec = result.spec
    layout = getattr(model, "mtp_layout", "qwen3_5")  # mtp_deepseek.mtp_model names its layout
    tree_graph = export_tree(model, result, recipe) if recipe.tree_verify else None
    validation: dict = {"layers": 1}
    if probe is not None:
        validation.update(_compare(result.path, spec, model, reference, probe[: CHECK_ROWS + 1]))
        if tree_graph is not None:
            validation["tree_rows"] = _tree_check(result, root / tree_graph, reference, probe)
    return ModelEntry(
        graph=GRAPH,
        source=f"{source.describe()} ({layout} MTP layer)",
        architecture=f"{layout}_mtp",
        num_layers=1,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        vocab_size=vocab,
        embedding_rows=spec.embedding_rows,
        precision="fp32",
        kv_dtype=spec.kv_dtype,
        validation=validation,
        kv_layout=spec.kv_layout,
        kind=contract.MTP,
        feature_width=spec.feature_width,
        hidden_width=spec.hidden_width,
        tree_graph=tree_graph,
    )


def export_tree(model, solo, recipe) -> str:
    """The MTP head's tree graph as draft/tree.onnx beside its graph, reading the same weights
    file; returns its artifact-relative path (the recipe reader refuses tree_verify with an MTP
    head in the portable form)."""
    with tempfile.TemporaryDirectory(dir=solo.path.parent.parent) as scratch:
        build_mtp(model, Path(scratch), recipe.max_context, recipe.layout.name, tree=True)
        return share_weights(Path(scratch) / "model.onnx", solo.path, TREE_GRAPH, "tree_verify")


def _tree_check(solo, tree_path: Path, reference, probe) -> dict:
    """rowcheck.head_tree_rows on the probe: the target's hidden rows of its first half as the
    catch-up, then the probe's next tokens as the tree's nodes."""
    from specexport_runtime.eagle_tree import HeadTree
    from specexport_runtime.engine import OrtModel, SessionConfig

    from .rowcheck import HEAD_TREE_PARENTS, head_tree_rows

    k = max(1, len(probe) // 2)
    need = k + 1 + len(HEAD_TREE_PARENTS)
    tokens = (list(probe) * (need // len(probe) + 1))[:need]
    with torch.no_grad():
        h = reference(torch.tensor([tokens[:k]]), output_hidden_states=True).hidden_states[-1][0].numpy()  # [k, H]
    config = SessionConfig(provider="cpu")
    head = OrtModel(solo.path, solo.spec, len(tokens) + 8, config, max_rows=max(k, 8))
    return head_tree_rows(head, HeadTree(tree_path, head, config), h, tokens).to_dict()


def _compare(path: Path, spec, model, reference, probe) -> dict:
    """Catch-up rows of the probe (row t: the target's hidden row t and token t + 1) through the
    graph and through the skeleton's own modules (transformers' layer and norms)."""
    from specexport_runtime.engine import OrtModel, SessionConfig

    ids = torch.tensor([probe])
    with torch.no_grad():
        h = reference(ids, output_hidden_states=True).hidden_states[-1][0, :-1]  # [n, H] final-normed
        e = model.get_input_embeddings()(ids[:, 1:])
        x = model.mtp.fc(torch.cat([model.mtp.pre_fc_norm_embedding(e), model.mtp.pre_fc_norm_hidden(h[None])], dim=-1))
        out = model.model(inputs_embeds=x).last_hidden_state
        want = model.get_output_embeddings()(out)[0].numpy()
    head = OrtModel(path, spec, len(probe) + 1, SessionConfig(threads=1), max_rows=len(probe))
    got = head.forward(probe[1:], last_rows=len(probe) - 1, features=h.numpy())
    return {
        "max_abs_diff": float(np.abs(got - want).max()),
        "argmax_agreement": float((got.argmax(-1) == want.argmax(-1)).mean()),
    }
