"""Build stages of a Gemma 4 assistant (recipe `draft: {model: PATH}` whose config.json says
`gemma4_assistant`): its config checked against the target's before any weight is read, its
graph in the recipe's form, and its draft steps compared with transformers' forward on the probe
(validation: the max |logit diff| and the argmax agreement of the graph with the reference).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from specexport_runtime import contract
from specexport_runtime.manifest import ModelEntry

from ..errors import BuildError
from ..graphs.assistant import build_assistant
from ..models.assistant import AssistantFacts, check_pair, config_file, load_assistant, read_assistant_config
from ..models.config import NormalizedConfig, read_config
from ..models.sources import ModelSource, snapshot
from ..recipe.spec import Recipe
from .eagle import target_embedding

GRAPH = "draft/model.onnx"
CHECK_STEPS = 4  # validation: draft steps at this many positions of the probe


def check_assistant(recipe: Recipe, t_norm: NormalizedConfig) -> AssistantFacts:
    """The assistant's facts against the target's config.json, or AssistantMismatch in one line
    (before any weight is read)."""
    spec = recipe.draft.model
    if recipe.draft.precision != "fp32":
        raise BuildError(f"draft precision {recipe.draft.precision!r}: a Gemma 4 assistant is built fp32 only")
    target = read_config(recipe.target.model, revision=recipe.target.revision)
    config = read_assistant_config(config_file(spec.model, spec.revision).parent)
    return check_pair(config, target, t_norm, name=str(spec.model))


def load(recipe: Recipe) -> tuple[object, ModelSource]:
    """The assistant's weights: its folder, or a hub id's snapshot (safetensors only)."""
    spec = recipe.draft.model
    folder = Path(spec.model)
    if not folder.is_dir():
        folder = snapshot(ModelSource("hub", str(spec.model), None, spec.revision))
    return load_assistant(folder), ModelSource("folder", str(folder))


def export_assistant(
    assistant,
    facts: AssistantFacts,
    reference,
    t_norm: NormalizedConfig,
    root: Path,
    recipe: Recipe,
    source,
    vocab: int,
    probe: list[int] | None,
) -> ModelEntry:
    """Write draft/model.onnx; with the probe, compare it with transformers (validation)."""
    result = build_assistant(
        assistant,
        target_embedding(reference),
        facts,
        root / "draft",
        kv_heads=t_norm.kv_heads,
        head_dim=t_norm.head_dim,
        kv_layout=recipe.layout.name,
    )
    validation = {"shared_kv": dict(facts.shared_kv), "head": "centroids" if facts.centroids else "full"}
    if probe is not None:
        validation.update(compare(result.path, assistant, facts, reference, t_norm, probe))
    return ModelEntry(
        graph=GRAPH,
        source=source.describe(),
        architecture="gemma4_assistant",
        num_layers=result.spec.num_layers,
        num_kv_heads=t_norm.kv_heads,
        head_dim=t_norm.head_dim,
        vocab_size=vocab,
        embedding_rows=facts.vocab,
        precision="fp32",
        kv_dtype=result.spec.kv_dtype,
        validation=validation,
        kv_layout=result.spec.kv_layout,
        kind=contract.ASSISTANT,
        hidden_width=facts.backbone,
        shared_kv=result.spec.shared_kv,
    )


def compare(path: Path, assistant, facts: AssistantFacts, reference, t_norm: NormalizedConfig, probe) -> dict:
    """The graph's first draft step at CHECK_STEPS positions of the probe against transformers'
    forward on the same target hidden row and K/V: max |logit diff| and argmax agreement."""
    from specexport_runtime.engine import SessionConfig, make_session

    session = make_session(path, SessionConfig(provider="cpu"))  # the process's thread pool, shared or not
    in_place = contract.layout_of(result_layout(session)).in_place
    ids = torch.tensor([probe])
    with torch.no_grad():
        out = reference(ids, output_hidden_states=True, return_shared_kv_states=True)
    if not getattr(out, "shared_kv_states", None):
        raise BuildError("the target's transformers forward returned no shared_kv_states to check the assistant with")
    last = out.hidden_states[-1][0]  # [N, Hb] after the final norm
    embed = target_embedding(reference)
    worst, agree = 0.0, 0
    positions = np.linspace(2, len(probe) - 1, CHECK_STEPS).astype(int)
    for P in positions:
        shared = {k: (v[0][:, :, :P], v[1][:, :, :P]) for k, v in out.shared_kv_states.items()}
        x = torch.cat([embed[probe[P]], last[P - 1]])[None, None]
        with torch.no_grad():
            want = assistant(inputs_embeds=x, position_ids=torch.tensor([[P]]), shared_kv_states=shared).logits[0, 0]
        feeds = {
            contract.INPUT_IDS: np.array([[probe[P]]], np.int64),
            contract.ASSISTANT_HIDDEN: last[P - 1][None, None].numpy(),
        }
        for kind, n in facts.shared_kv.items():
            for i, name in ((0, contract.shared_key(n)), (1, contract.shared_value(n))):
                t = torch.nn.functional.pad(shared[kind][i][0], (0, t_norm.head_dim - shared[kind][i].shape[-1]))
                feeds[name] = (t[None] if in_place else t.transpose(0, 1)[None]).numpy()  # [H_kv, P, D]
        if in_place:
            feeds[contract.TOTAL_SEQUENCE_LENGTH] = np.array(P, np.int32)
        got = session.run(None, feeds)[0][0, 0]
        worst = max(worst, float(np.abs(got - want.numpy()).max()))
        agree += int(got.argmax() == int(want.argmax()))
    return {"max_abs_diff": worst, "argmax_agreement": agree / len(positions), "positions": positions.tolist()}


def result_layout(session) -> str:
    return session.get_modelmeta().custom_metadata_map[contract.META_KV_LAYOUT]
