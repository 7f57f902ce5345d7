"""EAGLE-3 draft trees (eagle_tree.py, contract 1.8): the head's tree graph against chain calls
of the same paths, the target's features following the accepted path after a tree round, greedy
output equal to target-only output (the independent reference: one token per call through the
chain graph), the sampled law, the CLI, and the pure tree-building functions.

The tiny head is random: its drafts are almost never the target's argmax. The greedy tests
therefore also run an "oracle" variant in which the greedy draft probabilities of the round's
depth-d rows get the target's own next token (known from the target-only reference) boosted to
the top, so that paths are accepted and the accepted rows are not the first rows of the tree."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from exactness_support import check_pairs_follow_target, first_pair, sample_pairs

from specexport_runtime import eagle
from specexport_runtime.api import load
from specexport_runtime.eagle import EagleProposer
from specexport_runtime.eagle_tree import (
    Candidates,
    calibrated,
    calibration_factor,
    frontier,
    keep_best,
    priced_count,
    top_children,
)
from specexport_runtime.tree import DraftTree

PROMPTS = ["hello world hello world hello", "abc abc abc abc abc", "x = 1\ny = 2\nx =", "the quick brown"]
TOL = 1e-4  # float32 tree rows against chain rows: the same weights, attention over a masked span


@pytest.fixture(scope="module")
def gen(tiny_artifacts):
    return load(tiny_artifacts["eagle3-tree"])


# --- build side ---------------------------------------------------------------------------


def test_manifest_records_the_head_tree_graph(gen):
    draft, target = gen.manifest.draft, gen.manifest.target
    assert draft.tree_graph == "draft/tree.onnx" and gen.manifest.contract_version == "1.8"
    rows = draft.validation["tree_rows"]  # the build's check of the head's tree rows
    assert rows["paths"] == 7 and rows["max_abs_diff"] < TOL and rows["argmax_agreement"] == 1.0
    assert target.validation["tree_rows"]["max_abs_diff"] < TOL
    assert gen.head_tree is not None


def test_head_tree_rows_equal_chain_calls_of_each_path(gen):
    """rowcheck.head_tree_rows on another catch-up: each node's tree-call logits against the
    chain calls of its path (draft_hidden the parent's hidden_out), max |diff| < TOL."""
    from specexport.build.rowcheck import HEAD_TREE_PARENTS, head_tree_rows

    ids = gen.codec.encode("def add(a, b):\n    return a + b\n")
    target = gen.target
    target.reset()
    target.forward(ids)
    k = len(ids) - 1
    features = target.features[:k].copy()
    tokens = ids + ids[: 1 + len(HEAD_TREE_PARENTS)]
    report = head_tree_rows(gen.draft, gen.head_tree, features, tokens)
    target.reset()
    assert report.rows == len(HEAD_TREE_PARENTS)
    assert report.max_abs_diff < TOL and report.argmax_agreement == 1.0


def test_the_head_tree_graph_is_contract_1_8(gen, tmp_path):
    """version_for gives a head's tree graph 1.8; a manifest that declares 1.7 with one, or a
    decoder draft with a tree graph, is refused in one line."""
    import json
    import shutil

    from specexport_runtime import contract
    from specexport_runtime.errors import ArtifactError
    from specexport_runtime.manifest import read_manifest

    assert contract.HEAD_TREE_VERSION == "1.8" and contract.parse_version(contract.CONTRACT_VERSION) >= (1, 8)
    assert contract.version_for(contract.HEAD_MAJOR_INPLACE, head=True, tree=True) == "1.8"
    assert contract.version_for(contract.HEAD_MAJOR_INPLACE, 2, tree=True) == contract.TREE_VERSION == "1.7"
    root = Path(shutil.copytree(gen.root, tmp_path / "a"))
    data = json.loads((root / "manifest.json").read_text())
    for change, match in (({"contract_version": "1.7"}, "needs contract 1.8"), ({"draft": {"kind": "decoder"}}, "")):
        bad = {**data, **change}
        if "draft" in change:
            bad["draft"] = {k: v for k, v in data["draft"].items() if k not in ("kind", "hidden_width", "vocab_map")}
        (root / "manifest.json").write_text(json.dumps(bad))
        with pytest.raises(ArtifactError, match=match or "tree graph belongs") as info:
            read_manifest(root)
        assert "\n" not in str(info.value)


def test_a_portable_head_with_tree_verify_is_refused_in_one_line(tmp_path):
    from tiny import make_model, save_hf_folder, write_recipe

    from specexport.recipe.load import RecipeError, load_recipe

    target = save_hf_folder(make_model("llama"), tmp_path / "t")
    path = write_recipe(tmp_path / "r.yaml", target, {"eagle3": {"model": str(tmp_path / "nohead")}}, tree_verify=True)
    with pytest.raises(RecipeError, match="tree_verify") as info:
        load_recipe(path)  # before any weights load (the head folder does not even exist)
    assert "\n" not in str(info.value)


# --- the target's features after a tree round ----------------------------------------------


def test_features_follow_the_accepted_path(gen):
    """After a tree call and keep_path on a path that is not the tree's first rows, the target's
    features (and the eagle proposer's copy of them) equal those of a chain decoding of the same
    tokens, within TOL; so does the KV cache."""
    ids = gen.codec.encode("The quick brown fox jumps")
    target, verifier = gen.target, gen.tree
    a, b, c, d = ids[1:5]
    tree = DraftTree([ids[-1], a, b, c, d, a], [-1, 0, 0, 1, 2, 4])  # path kept: rows 2, 4, 5 (b, d, a)
    proposer = EagleProposer(gen.draft, target, gen.vocab_map(), gen.manifest.target.embedding_rows)
    proposer.start(ids)
    target.reset()
    target.forward(ids[:-1])
    proposer.commit(ids, 1)  # features of positions 0 .. len - 2
    start = target.length
    verifier.forward(tree)
    target.keep_path(start, [2, 4, 5])
    committed = ids + [b, d, a, 7]  # the path and a bonus token
    proposer.commit(committed, 4)
    got, got_kv = target.features.copy(), [x.copy() for x in target.kv_rows(0, target.length)]
    assert got.shape[0] == 4 and proposer.known == len(committed) - 1
    target.reset()
    target.forward(ids[:-1])
    target.forward([ids[-1], b, d, a], last_rows=4)  # the chain decoding of the same tokens
    want = target.features
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
    np.testing.assert_allclose(proposer.features[start : start + 4], want, atol=TOL, rtol=0)
    for x, y in zip(got_kv, target.kv_rows(0, target.length)):
        np.testing.assert_allclose(x, y, atol=TOL, rtol=0)
    target.reset()


# --- greedy and sampled exactness in the loop ------------------------------------------------


def _oracle(monkeypatch, gen, refs: dict):
    """Greedy draft probabilities in which the round's depth-d rows rank the target's token at
    depth d + 1 first (the target-only reference `refs[prompt ids]`), except every third depth,
    so that some paths are accepted and some rejected mid-way."""
    d2t = gen.vocab_map()
    row_of = {int(t): i for i, t in enumerate(d2t)}
    state = {"calls": 0, "next": []}
    real_softmax, real_propose = eagle.softmax, EagleProposer.propose

    def propose(self, committed, gamma, params, rng):
        for prompt, ref in refs.items():
            n = len(prompt)
            if tuple(committed[:n]) == prompt:
                state["next"] = ref[len(committed) - n :]
        state["calls"] = 0
        return real_propose(self, committed, gamma, params, rng)

    def softmax(logits):
        p = real_softmax(logits)
        d, state["calls"] = state["calls"], state["calls"] + 1
        if d < len(state["next"]) and d % 3 != 2 and int(state["next"][d]) in row_of:
            p[:, row_of[int(state["next"][d])]] = 2.0 * p.max()
            p /= p.sum(-1, keepdims=True)
        return p

    monkeypatch.setattr(EagleProposer, "propose", propose)
    monkeypatch.setattr(eagle, "softmax", softmax)


@pytest.mark.parametrize("oracle", [False, True], ids=["head", "oracle"])
@pytest.mark.parametrize("nodes", [2, 8, 24, 63])
def test_greedy_eagle_tree_output_equals_target_only(gen, free_rows, monkeypatch, nodes, oracle):
    refs = {}
    for prompt in PROMPTS:
        ids = gen.codec.encode(prompt)
        refs[tuple(ids)] = gen.generate(ids, max_new_tokens=40, speculative=False).token_ids
    if oracle:
        _oracle(monkeypatch, gen, refs)
    trees = accepted = 0
    for ids, ref in refs.items():
        out = gen.generate(list(ids), max_new_tokens=40, proposer="eagle", tree_nodes=nodes, gamma=4)
        assert out.token_ids == ref, (gen.codec.decode(list(ids)), nodes)
        trees += out.stats.tree_rounds
        accepted += out.stats.accepted
    assert trees > 0
    if oracle:
        assert accepted > 0


def test_hybrid_passes_the_heads_trees_through(gen, free_rows):
    """hybrid (suffix retrieval, then the head): rounds drafted by the head are trees (more tokens
    than gamma deep), and the output is target-only's."""
    drafted = rounds = 0
    for prompt in PROMPTS:
        ids = gen.codec.encode(prompt)
        ref = gen.generate(ids, max_new_tokens=40, speculative=False).token_ids
        out = gen.generate(ids, max_new_tokens=40, proposer="hybrid", tree_nodes=24, gamma=4)
        assert out.token_ids == ref, prompt
        r, k, _ = out.stats.by_source.get("eagle", [0, 0, 0])
        rounds, drafted = rounds + r, drafted + k
    assert rounds > 0 and drafted > 4 * rounds


def test_dear_rows_shrink_eagle_trees_to_one_token(gen, monkeypatch):
    """A verify-cost line where rows are all the cost (a 0, b 1): no node pays for its row, so
    each round drafts the head's top token alone, verified as a chain; output still target-only's."""
    from specexport_runtime.costs import VerifyCost

    monkeypatch.setattr(VerifyCost, "line", lambda self: (0.0, 1.0))
    ids = gen.codec.encode(PROMPTS[0])
    ref = gen.generate(ids, max_new_tokens=24, speculative=False).token_ids
    out = gen.generate(ids, max_new_tokens=24, proposer="eagle", tree_nodes=24, gamma=4)
    assert out.token_ids == ref
    assert out.stats.tree_rounds == 0 and out.stats.rounds > 0 and out.stats.drafted == out.stats.rounds


@pytest.mark.slow  # ~30 s of sampling; test_tree_loop's sampled-tree law tests run by default
def test_sampled_eagle_trees_follow_the_target_law(gen, free_rows):
    """Temperature 1, trees of up to 8 nodes from the head's top-k (deterministic siblings): the
    first two tokens of 2000 runs (the second from a tree round) against the exact pair law and
    against target-only runs."""
    ids = gen.codec.encode("The quick brown fox")
    N = 2000
    (eos,) = gen.eos
    runs = [
        gen.generate(
            ids,
            max_new_tokens=2,
            seed=s,
            temperature=1.0,
            top_k=0,
            gamma=3,
            proposer="eagle",
            tree_nodes=8,
            seeded_noise=False,
        )
        for s in range(N)
    ]
    assert sum(r.stats.tree_rounds for r in runs) > N // 2
    spec = [first_pair(r, eos) for r in runs]
    base = sample_pairs(gen, ids, range(N, 2 * N), False, temperature=1.0, top_k=0)
    check_pairs_follow_target(gen.target, ids, spec, base, eos, "eagle trees")


def test_cli_generates_eagle_trees(tiny_artifacts, free_rows, capsys):
    import json

    from specexport_runtime.cli import main

    args = ["generate", str(tiny_artifacts["eagle3-tree"]), "--prompt", PROMPTS[1], "--json", "--gamma", "4"]
    runs = {}
    for extra in (["--no-speculation"], ["--proposer", "eagle", "--tree-nodes", "16"]):
        assert main(args + extra) == 0
        runs[extra[0]] = json.loads(capsys.readouterr().out)
    assert runs["--proposer"]["token_ids"] == runs["--no-speculation"]["token_ids"]
    assert runs["--proposer"]["stats"]["tree_rounds"] > 0


# --- the pure parts -------------------------------------------------------------------------


def test_top_children_are_the_argmax_order_without_zeros():
    ids, p = top_children(np.array([0.1, 0.4, 0.0, 0.4, 0.1]), 4)
    assert ids.tolist() == [1, 3, 0, 4] and p.tolist() == [0.4, 0.4, 0.1, 0.1]
    assert top_children(np.array([0.0, 1.0, 0.0]), 3)[0].tolist() == [1]
    rng = np.random.default_rng(0)
    for _ in range(300):  # against a full stable argsort, with many ties and zeros
        p, k = rng.integers(0, 5, int(rng.integers(1, 40))).astype(np.float64), int(rng.integers(1, 12))
        want = np.argsort(-p, kind="stable")[:k]
        assert top_children(p, k)[0].tolist() == want[p[want] > 0].tolist()


def test_priced_count_follows_the_verify_cost_line():
    qs = [0.9, 0.5, 0.2, 0.05]
    assert priced_count(qs, None, 3) == 3 and priced_count(qs, (1.0, 0.0), 9) == 4  # free rows: the budget
    # a = 1, b = 0.1: q joins while q (1 + 0.1 (n + 1)) > 0.1 (1 + score)
    # 0.9 * 1.1 > 0.1; 0.5 * 1.2 > 0.19; 0.2 * 1.3 = 0.26 > 0.24; 0.05 * 1.4 = 0.07 <= 0.26
    assert priced_count(qs, (1.0, 0.1), 9) == 3
    assert priced_count(qs, (0.0, 1.0), 9) == 0  # rows are all the cost: nothing pays


def test_keep_best_is_ancestor_closed_and_topological():
    # candidates: 0, 1 children of the root; 2, 3 of 0; 4 of 2; 5 of 1 (a child ties its parent)
    q = np.array([0.6, 0.3, 0.3, 0.2, 0.25, 0.3])
    parents = np.array([-1, -1, 0, 0, 2, 1])
    depth = np.array([1, 1, 2, 2, 3, 2])
    for n in range(1, 7):
        kept = keep_best(q, parents, depth, n)
        assert len(kept) == n
        assert all(parents[i] < 0 or parents[i] in kept[: kept.index(i)] for i in kept)
        assert [depth[i] for i in kept] == sorted(depth[i] for i in kept)
    assert keep_best(q, parents, depth, 3) == [0, 1, 2]  # ties: the shallower first
    assert keep_best(q, parents, depth, 4) == [0, 1, 2, 5]


def test_frontier_skips_nodes_whose_children_cannot_make_the_budget():
    c = Candidates([], [], [], [], [])
    c.add(np.array([5, 6, 7]), np.array([0.5, 0.3, 0.2]), -1, 1.0, 1)
    assert frontier(c, 1, 8, 8) == [0, 1, 2]
    assert frontier(c, 1, 2, 8) == [0, 1]  # the width
    assert frontier(c, 1, 8, 1) == [0]  # nodes 2: a child of node 1 would rank 3rd at best
    assert frontier(c, 2, 8, 8) == []
    # a line where only the first two candidates pay: node 2 and its children never would
    line = (1.0, 0.5)  # 0.5 (1 + 0.5) > 0.5; then 0.3 (1 + 1) <= 0.5 (1 + 0.5): one node
    assert priced_count([0.5, 0.3, 0.2], line, 9) == 1
    assert frontier(c, 1, 8, min(8, priced_count([0.5, 0.3, 0.2], line, 9))) == [0]


def test_calibration_scales_the_path_probabilities_by_the_measured_acceptance():
    assert calibration_factor(0.0, 0.0) == 1.0  # no evidence: the head's own q
    assert calibration_factor(36.0, 6.0) == pytest.approx(10 / 40)  # the prior of 4 tokens each side
    assert calibration_factor(1000.0, 0.0) == 0.1 and calibration_factor(0.0, 1000.0) == 2.0  # clipped
    q = np.array([0.9, 0.4, 0.1])
    assert calibrated(q, 0.5).tolist() == [0.45, 0.2, 0.05]
    assert calibrated(q, 2.0).tolist() == [1.0, 0.8, 0.2]  # at most 1
    # an overconfident head prices fewer nodes in: a = 1, b = 0.1
    assert priced_count(calibrated(q, 0.2), (1.0, 0.1), 9) < priced_count(q, (1.0, 0.1), 9)


def test_the_eagle_proposer_records_its_tree_rounds_for_the_calibration(gen, free_rows):
    """One tree round by hand: the proposer's predicted tokens grow by the sum of the kept
    nodes' q, its accepted ones by the verified path's length."""
    from specexport_runtime.tree import verify_tree_greedy

    config = gen.configure(proposer="eagle", tree_nodes=8, gamma=3)
    proposer = gen.build_proposer("eagle", config)
    ids = gen.codec.encode("The quick brown fox")
    target = gen.target
    proposer.start(ids)
    target.reset()
    target.forward(ids[:-1])
    proposer.commit(ids, 1)
    p = proposer.propose(ids, 3, config.sampling, np.random.default_rng(0))
    pending = proposer.trees._pending
    assert p.parents is not None and 0 < pending <= len(p.tokens)
    tree = DraftTree([ids[-1], *p.tokens], [-1, *p.parents])
    start = target.length
    rows, token = verify_tree_greedy(tree, gen.tree.forward(tree).argmax(-1))
    target.keep_path(start, rows)
    proposer.commit(ids + [int(t) for t in tree.tokens[rows]] + [token], len(rows) + 1)
    assert (proposer.trees.predicted, proposer.trees.accepted, proposer.trees._pending) == (pending, len(rows), None)
    target.reset()
