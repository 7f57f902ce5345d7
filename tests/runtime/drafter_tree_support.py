"""Shared by the vendor drafters' tree tests (test_mtp_tree.py, test_assistant_tree.py): tiny
artifacts built with tree_verify, and an oracle that makes some tree paths accepted.

The tiny drafters are random (the MTP layer echoes, the assistant guesses), so their trees are
rarely accepted below the first row. The oracle wraps a proposer's greedy draft probabilities: in
a round, the k-th probability call (k = 0: the root's children, k = d: the children of the depth-d
frontier) ranks the target's own token at depth k + 1 (known from the target-only reference)
first, except every third depth, so that some paths are accepted, some rejected mid-way, and
accepted rows are not the first rows of the tree."""

from __future__ import annotations

from pathlib import Path

PROMPTS = [[7, 150, 33, 299, 12, 260, 5], [40, 41, 42, 43, 44] * 4, [17, 88, 203, 5, 61, 144, 9, 250, 33, 71]]
MAX_NEW = 40
# a Qwen3.5 text config with full-attention layers only: a hybrid target (the published layout,
# Gated DeltaNet layers) refuses tree_verify before any weight loads (docs/trees.md)
QWEN3_5_FULL = dict(layer_types=["full_attention"] * 4)


def build_mtp_tree(work: Path) -> Path:
    """A tiny full-attention Qwen3.5 target with an echoing MTP layer, graph: fused, tree_verify."""
    from mtp_checkpoints import add_mtp
    from tiny import make_model, save_hf_folder, write_recipe

    from specexport.build.artifact import build_artifact
    from specexport.recipe.load import load_recipe

    target = make_model("qwen3_5_text", **QWEN3_5_FULL)
    folder = save_hf_folder(target, work / "target-hf")
    add_mtp(folder, target.config, echo=True)
    recipe = write_recipe(work / "recipe.yaml", folder, {"mtp": {}}, graph="fused", tree_verify=True)
    return build_artifact(load_recipe(recipe), work / "artifact").output


def build_assistant_tree(work: Path, target, assistant, graph: str) -> Path:
    """The tiny Gemma 4 target with its assistant in `graph` form, tree_verify."""
    from assistant_models import save_assistant
    from tiny import save_hf_folder, write_recipe

    from specexport.build.artifact import build_artifact
    from specexport.recipe.load import load_recipe

    folder = save_hf_folder(target, work / "target-hf")
    draft = {"model": str(save_assistant(assistant, work / "assistant-hf"))}
    recipe = write_recipe(work / "recipe.yaml", folder, draft, graph=graph, tree_verify=True)
    return build_artifact(load_recipe(recipe), work / "artifact").output


def install_oracle(monkeypatch, module, proposer_class, refs: dict) -> None:
    """Wrap `module.softmax` (what proposer_class's greedy tree rounds look up per call) and
    proposer_class.propose as the module docstring says. refs: prompt ids (tuple) -> the
    target-only output token ids of that prompt."""
    state = {"calls": 0, "next": []}
    real_softmax, real_propose = module.softmax, proposer_class.propose

    def propose(self, committed, gamma, params, rng):
        for prompt, ref in refs.items():
            if tuple(committed[: len(prompt)]) == prompt:
                state["next"] = ref[len(committed) - len(prompt) :]
        state["calls"] = 0
        return real_propose(self, committed, gamma, params, rng)

    def softmax(logits):
        p = real_softmax(logits)
        d, state["calls"] = state["calls"], state["calls"] + 1
        if d < len(state["next"]) and d % 3 != 2:
            p[:, int(state["next"][d])] = 2.0 * p.max()
            p /= p.sum(-1, keepdims=True)
        return p

    monkeypatch.setattr(proposer_class, "propose", propose)
    monkeypatch.setattr(module, "softmax", softmax)


def greedy_tree_runs(gen, proposer: str, nodes: int, monkeypatch=None, module=None, proposer_class=None) -> dict:
    """Greedy generation of every prompt with trees of up to `nodes` tokens (gamma 4, the tree's
    depth), with the oracle when monkeypatch is given; asserts each output equals target-only
    output token for token and returns the summed stats."""
    refs = {tuple(ids): gen.generate(ids, max_new_tokens=MAX_NEW, speculative=False).token_ids for ids in PROMPTS}
    if monkeypatch is not None:
        install_oracle(monkeypatch, module, proposer_class, refs)
    total = {"tree_rounds": 0, "accepted": 0, "drafted": 0, "rounds": 0, "sources": set()}
    for ids, ref in refs.items():
        out = gen.generate(list(ids), max_new_tokens=MAX_NEW, proposer=proposer, tree_nodes=nodes, gamma=4)
        assert out.token_ids == ref, (ids, nodes)
        total["tree_rounds"] += out.stats.tree_rounds
        total["accepted"] += out.stats.accepted
        total["drafted"] += out.stats.drafted
        total["rounds"] += out.stats.rounds
        total["sources"] |= set(out.stats.by_source)
    return total
