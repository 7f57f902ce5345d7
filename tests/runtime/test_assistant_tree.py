"""Gemma 4 assistant draft trees end to end: the tiny Gemma 4 target and a random assistant
built with tree_verify in both graph forms (the target's tree graph; the assistant's own graph
serves the tree, its rows never seeing each other). Greedy output with `assistant` trees equals
target-only output token for token, with the assistant's own drafts and with an oracle that gets
paths accepted (drafter_tree_support.py); every node of a drafted tree equals transformers'
Gemma4AssistantForCausalLM chained along that node's root-to-leaf path (an independent
reference, within 1e-4), which fails when a node's row reads anything but its own path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from assistant_models import make_assistant
from drafter_tree_support import build_assistant_tree, greedy_tree_runs
from tiny import make_model

from specexport_runtime import assistant as assistant_module
from specexport_runtime.api import load
from specexport_runtime.assistant import AssistantProposer, AssistantTree
from specexport_runtime.eagle_tree import grow
from specexport_runtime.sampling import softmax

TOL = 1e-4  # float32 graph against float32 PyTorch
IDS = [17, 88, 203, 5, 61, 144, 9, 250, 33, 71, 120, 8, 199, 42]  # 14 > the assistant's window 8 + 1


@pytest.fixture(scope="module")
def models():
    return make_model("gemma4_text"), make_assistant()


@pytest.fixture(scope="module", params=["portable", "fused"])
def gen(request, tmp_path_factory, models):
    return load(
        build_assistant_tree(tmp_path_factory.mktemp(f"assistant-tree-{request.param}"), *models, request.param)
    )


@pytest.mark.parametrize("oracle", [False, True], ids=["assistant", "oracle"])
@pytest.mark.parametrize("nodes", [4, 24])
def test_greedy_assistant_tree_output_equals_target_only(gen, free_rows, monkeypatch, nodes, oracle):
    patch = (monkeypatch, assistant_module, AssistantProposer) if oracle else ()
    total = greedy_tree_runs(gen, "assistant", nodes, *patch)
    assert total["tree_rounds"] > 0 and total["sources"] <= {"assistant"}
    if oracle:
        assert 0 < total["accepted"] < total["drafted"]


class _Recorder(AssistantTree):
    """AssistantTree keeping every row's logits and hidden_out; mix: each call's rows are fed
    with their hidden rows rolled by one (row s reads row s - 1's draft_hidden), a tree whose
    nodes read another path."""

    def __init__(self, model, mix: bool = False):
        super().__init__(model)
        self.mix, self.logits, self.hidden = mix, [], []

    def forward(self, tokens, hidden, positions, bias):
        logits, out = super().forward(tokens, np.roll(hidden, 1, axis=0) if self.mix else hidden, positions, bias)
        self.logits += [row.copy() for row in logits]
        self.hidden += [row.copy() for row in out]
        return logits, out


class _Reference:
    """transformers' assistant chained along a path at P = len(IDS) - 1: step 1 from IDS[-1] and
    the target's hidden row of P - 1, step i + 1 from path[i - 1] and step i's last_hidden_state;
    every step reads the target's K/V of positions < P (each path prefix computed once)."""

    def __init__(self, models):
        self.target, self.assistant = models
        self.P = P = len(IDS) - 1
        with torch.no_grad():
            out = self.target(torch.tensor([IDS[:P]]), return_shared_kv_states=True, output_hidden_states=True)
        self.shared = {k: (v[0][:, :, :P], v[1][:, :, :P]) for k, v in out.shared_kv_states.items()}
        self.memo: dict[tuple[int, ...], tuple[np.ndarray, torch.Tensor]] = {}
        self.start = out.hidden_states[-1][0, P - 1]  # [Hb]

    @torch.no_grad()
    def step(self, path: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """Step len(path) + 1's (logits [V], last_hidden_state [Hb])."""
        if path not in self.memo:
            hidden = self.start
            if path:
                self.step(path[:-1])  # the parent's step, memoized
                hidden = self.memo[path[:-1]][1]
            token = path[-1] if path else IDS[-1]
            embeds = torch.cat([self.target.get_input_embeddings()(torch.tensor([[token]])), hidden[None, None]], -1)
            ref = self.assistant(
                inputs_embeds=embeds, position_ids=torch.tensor([[self.P]]), shared_kv_states=self.shared
            )
            self.memo[path] = (ref.logits[0, 0].numpy(), ref.last_hidden_state[0, 0])
        logits, hidden = self.memo[path]
        return logits, hidden.numpy()


def _tree_round(gen, mix: bool = False):
    """The target prefilled with IDS[:-1]; step 1 and then a tree round (eagle_tree.grow, 24 nodes,
    depth 3) on the assistant's graph: (candidates, recorder, step 1's logits [V])."""
    target, draft = gen.target, gen.draft
    target.reset()
    target.forward(IDS[:-1])
    hidden = target.features[-1:].copy()  # [1, Hb] the target's final-normed row of position P - 1
    first = draft.forward([IDS[-1]], hidden=hidden)[0].copy()
    rec = _Recorder(draft, mix)
    c, _ = grow(rec, first, draft.hidden_out[0].copy(), 0, softmax, np.arange(first.size), 24, 3, None)
    target.reset()
    return c, rec, first


def _errors(ref: _Reference, c, rec) -> tuple[float, float, int]:
    """Max |diff| of logits and hidden_out of every expanded node against the reference's chain
    of its path, and how many nodes were compared."""
    worst_l = worst_h = 0.0
    nodes = 0
    for i, row in enumerate(c.row):
        if row < 0:
            continue
        logits, hidden = ref.step(tuple(c.draft[j] for j in [*reversed(c.ancestors(i)), i]))
        worst_l = max(worst_l, float(np.abs(rec.logits[row] - logits).max()))
        worst_h = max(worst_h, float(np.abs(rec.hidden[row] - hidden).max()))
        nodes += 1
    return worst_l, worst_h, nodes


def test_tree_nodes_equal_transformers_assistant_along_each_path(gen, models):
    c, rec, first = _tree_round(gen)
    ref = _Reference(models)
    np.testing.assert_allclose(first, ref.step(())[0], atol=TOL, rtol=0)
    worst_l, worst_h, nodes = _errors(ref, c, rec)
    assert nodes == len(rec.logits) > 8 and {c.depth[i] for i, r in enumerate(c.row) if r >= 0} == {1, 2}
    assert worst_l < TOL and worst_h < TOL, (worst_l, worst_h)
    print(f"{nodes} nodes: max |logit diff| {worst_l:.2e}, max |hidden_out diff| {worst_h:.2e}")


def test_a_node_reading_another_path_departs_from_the_reference(gen, models):
    """Rows fed another node's draft_hidden (a tree that mixes paths) fail the comparison above
    by far more than TOL: the comparison sees what each node reads."""
    c, rec, _ = _tree_round(gen, mix=True)
    worst_l, _, _ = _errors(_Reference(models), c, rec)
    assert worst_l > 100 * TOL, worst_l
