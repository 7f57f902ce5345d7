"""The MTP head's tree graph (graph: fused; feature eagle3_head_tree on kind mtp) against the MTP
equations written in the test (tests/mtp_checkpoints.py's MtpReference: transformers' own Qwen3.5
layer and norm): a round of EAGLE-2 tree drafting (eagle_tree.grow) on the tree graph, every
expanded node's logits and hidden_out against the reference's chain along that node's
root-to-leaf path; the same round with a bias that lets rows see their siblings and cousins
departs from it (so the comparison notices a node attending outside its ancestors); and the
one-line refusals of a portable MTP tree graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mtp_checkpoints import MtpReference, _rms1, add_mtp
from tiny import make_model, make_tokenizer, save_hf_folder

from specexport.graphs.mtp import build_mtp
from specexport.models.config import UnsupportedConfig
from specexport.models.mtp import mtp_model
from specexport.models.streaming import open_streamed
from specexport_runtime import contract
from specexport_runtime.eagle_tree import HeadTree, grow
from specexport_runtime.engine import OrtModel, SessionConfig
from specexport_runtime.sampling import softmax

CONTEXT = 64
TOL = 1e-4  # float32 graph against float32 PyTorch
IDS = [5, 17, 99, 3, 250, 41, 7, 12]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(head OrtModel, its HeadTree, reference, the target's hidden rows of IDS [n, H])."""
    work = tmp_path_factory.mktemp("mtp-tree")
    target = make_model("qwen3_5_text")
    folder = save_hf_folder(target, work / "hf", make_tokenizer())
    tensors = add_mtp(folder, target.config)
    model = mtp_model(open_streamed(folder, target.config), folder)
    chain = build_mtp(model, work / "chain", CONTEXT, contract.HEAD_MAJOR_INPLACE)
    tree = build_mtp(model, work / "tree", CONTEXT, contract.HEAD_MAJOR_INPLACE, tree=True)
    assert tree.spec.tree and tree.spec.kind == contract.MTP and not chain.spec.tree
    config = SessionConfig(threads=1)
    head = OrtModel(chain.path, chain.spec, CONTEXT, config, max_rows=16)
    embed, out = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()
    ref = MtpReference(target.config, tensors, embed, out)
    with torch.no_grad():
        h = target(torch.tensor([IDS]), output_hidden_states=True).hidden_states[-1][0]  # [n, H] final-normed
    return head, HeadTree(tree.path, head, config), ref, h


class _Recorder:
    """A HeadTree as eagle_tree.grow sees it, keeping every row's logits and hidden_out; open:
    every bias entry 0 (each row sees all of the round's rows: siblings and cousins too)."""

    def __init__(self, tree: HeadTree, open_bias: bool = False):
        self.tree, self.head, self.lowest, self.open = tree, tree.head, tree.lowest, open_bias
        self.logits: list[np.ndarray] = []
        self.hidden: list[np.ndarray] = []

    def forward(self, tokens, hidden, positions, bias):
        logits, out = self.tree.forward(tokens, hidden, positions, np.zeros_like(bias) if self.open else bias)
        self.logits += [row.copy() for row in logits]
        self.hidden += [row.copy() for row in out]
        return logits, out


def _round(built, open_bias: bool = False):
    """One tree round after a catch-up of IDS: (candidates, recorder, catch-up row count)."""
    head, tree, _, h = built
    head.reset()
    n = len(IDS)
    first = head.forward(IDS[1:], last_rows=1, features=h[: n - 1].numpy())[0].copy()  # [V]
    rec = _Recorder(tree, open_bias)
    c, _ = grow(rec, first, head.hidden_out[0].copy(), head.length, softmax, np.arange(first.size), 24, 4, None)
    return c, rec, n - 1


class _Chains:
    """MtpReference's equations for the chains of one round, each path's rows computed once:
    x rows of the catch-up (token t + 1 with the target's hidden row t), then per path token
    x = fc([rms(embed(token)) (1 + w_e), rms(previous row's out) (1 + w_h)]); a row's out is
    norm(layer(x_0 .. x_row)) at positions 0 .. row (causal), its logits lm_head(out)."""

    def __init__(self, ref: MtpReference, h: torch.Tensor, k: int):
        self.ref = ref
        self.memo: dict[tuple[int, ...], tuple[list[torch.Tensor], torch.Tensor]] = {}
        xs, out = [], None
        for t in range(k):
            xs.append(self._x(IDS[t + 1], h[t]))
            out = self._out(xs)
        self.memo[()] = (xs, out)

    def _x(self, token: int, hidden: torch.Tensor) -> torch.Tensor:
        r = self.ref
        e = _rms1(r.embed[int(token)], r.t["mtp.pre_fc_norm_embedding.weight"], r.eps)
        hn = _rms1(hidden.float(), r.t["mtp.pre_fc_norm_hidden.weight"], r.eps)
        return torch.cat([e, hn]) @ r.t["mtp.fc.weight"].t()

    @torch.no_grad()
    def _out(self, xs: list[torch.Tensor]) -> torch.Tensor:
        y = self.ref.model(inputs_embeds=torch.stack(xs)[None], position_ids=torch.arange(len(xs))[None])
        return y.last_hidden_state[0, -1]

    def row(self, path: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(logits [V], out [H]) of the last row of the chain through `path`'s tokens."""
        if path not in self.memo:  # the empty path (the catch-up) is always there
            self.row(path[:-1])
            xs, out = self.memo[path[:-1]]
            xs = [*xs, self._x(path[-1], out)]
            self.memo[path] = (xs, self._out(xs))
        out = self.memo[path][1]
        return (out @ self.ref.head.t()).numpy(), out.numpy()


def _path_errors(built, c, rec, k) -> tuple[float, float, int]:
    """Max |diff| of logits and hidden_out of every expanded node against the reference's chain
    of its path (catch-up rows from the target's hidden rows, then the path's tokens, each row
    reading the previous row's output), and how many nodes were compared."""
    _, _, ref, h = built
    chains = _Chains(ref, h, k)
    worst_l = worst_h = 0.0
    nodes = 0
    for i, row in enumerate(c.row):
        if row < 0:
            continue
        path = tuple(c.draft[j] for j in [*reversed(c.ancestors(i)), i])
        logits, out = chains.row(path)
        worst_l = max(worst_l, float(np.abs(rec.logits[row] - logits).max()))
        worst_h = max(worst_h, float(np.abs(rec.hidden[row] - out).max()))
        nodes += 1
    return worst_l, worst_h, nodes


def test_tree_nodes_equal_the_mtp_equations_along_each_path(built):
    c, rec, k = _round(built)
    depths = {c.depth[i] for i, row in enumerate(c.row) if row >= 0}
    assert depths == {1, 2, 3} and sum(r >= 0 for r in c.row) > 8  # rows share calls with siblings and cousins
    worst_l, worst_h, nodes = _path_errors(built, c, rec, k)
    assert nodes == len(rec.logits)
    assert worst_l < TOL and worst_h < TOL, (worst_l, worst_h)
    print(f"{nodes} nodes: max |logit diff| {worst_l:.2e}, max |hidden_out diff| {worst_h:.2e}")


def test_a_node_attending_outside_its_ancestors_departs_from_the_equations(built):
    """The same round with every bias entry 0: depth-2 and depth-3 rows also see their siblings'
    and cousins' keys, and the comparison above fails by far more than TOL."""
    c, rec, k = _round(built, open_bias=True)
    worst_l, _, _ = _path_errors(built, c, rec, k)
    assert worst_l > 100 * TOL, worst_l


def test_a_portable_mtp_tree_graph_is_refused_in_one_line(built, tmp_path):
    with pytest.raises(UnsupportedConfig, match="graph: fused") as info:
        build_mtp(None, tmp_path, CONTEXT, contract.TIME_MAJOR, tree=True)  # before the model is read
    assert "\n" not in str(info.value)


def test_a_portable_recipe_with_an_mtp_tree_is_refused_before_weights_load(tmp_path):
    from tiny import write_recipe

    from specexport.recipe.load import RecipeError, load_recipe

    target = save_hf_folder(make_model("llama"), tmp_path / "t")
    path = write_recipe(tmp_path / "r.yaml", target, {"mtp": {}}, tree_verify=True)  # graph: portable
    with pytest.raises(RecipeError, match="tree_verify = true with an MTP head needs graph: fused") as info:
        load_recipe(path)
    assert "\n" not in str(info.value)
