"""Tree speculation in the loop (contract 1.7; the portable form 1.9): suffix drafts as trees, one
tree-verify call per round, the accepted path kept in place, on a fused and on a portable
artifact. Greedy output must equal target-only output (the independent reference: one token per
call through the chain graph), and sampled output must follow the target's law (chi-square
against the exact pair law, TV against target-only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from exactness_support import check_pairs_follow_target, first_pair, sample_pairs

from specexport_runtime import contract
from specexport_runtime.api import load
from specexport_runtime.errors import ArtifactError, InvalidArgument
from specexport_runtime.manifest import read_manifest
from specexport_runtime.structured import Grammar
from specexport_runtime.suffix import SuffixConfig
from specexport_runtime.suffix_index import SEP, TREE_BRANCHES, draft_tree

PROMPTS = [
    "hello world hello world hello",
    "abc abc abc abc abc abc abc abc abc",
    "x = 1\ny = 2\nx = 1\ny =",
    "for i in range(10):\n    print(i)\nfor i in range(10):",
    "the quick brown",
    "one two three one two four one two five one two",
]


# tiny artifacts with a tree graph: fused (GroupQueryAttention, contract 1.7), portable (standard ops, 1.9)
TREE_KINDS = ["noisy-fused-tree", "noisy-tree"]
CHAIN_KIND = {"noisy-fused-tree": "noisy-fused", "noisy-tree": "noisy"}  # the same without a tree graph


@pytest.fixture(scope="module", params=TREE_KINDS)
def tree_kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def tree_gen(tree_kind, tiny_artifacts):
    return load(tiny_artifacts[tree_kind])


@pytest.mark.parametrize("nodes", [2, 8, 24, 63])
@pytest.mark.parametrize("proposer", ["suffix", "hybrid"])
def test_greedy_tree_output_equals_target_only(tree_gen, free_rows, proposer, nodes):
    trees = 0
    for prompt in PROMPTS:
        ref = tree_gen.generate(prompt, max_new_tokens=48, speculative=False).token_ids
        out = tree_gen.generate(prompt, max_new_tokens=48, proposer=proposer, tree_nodes=nodes)
        assert out.token_ids == ref, (prompt, nodes)
        trees += out.stats.tree_rounds
    assert trees > 0 or nodes < 8  # the repetitive prompts drafted trees (small ones are often chains)


@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_every_round_a_tree_whose_path_moves(tree_gen, prompt):
    """The oracle proposer drafts target-only output on the second branch of a tree each round
    (tree rows 2, 5, 6 accepted): every round is a tree round whose kept rows move in the cache,
    and the output still equals target-only output (one token per call through the chain graph)."""
    import fixed_tree_support as support

    ref = tree_gen.generate(prompt, max_new_tokens=40, speculative=False).token_ids
    with support.oracle_tree(ref):
        out = tree_gen.generate(prompt, max_new_tokens=40, proposer="oracletree", tree_nodes=6)
    assert out.token_ids == ref
    assert out.stats.tree_rounds >= 8 and out.stats.accepted >= 3 * out.stats.tree_rounds - 3


def test_sampled_trees_follow_the_target_law(tree_gen):
    """Temperature 1, a fixed tree each round: the root's children are the target's three most
    likely tokens after the prompt and its most likely first token, and the first child has two
    children of its own. The first two tokens of 2000 runs (the second from a tree round)
    against the exact pair law and against target-only runs."""
    import fixed_tree_support as support

    ids = tree_gen.codec.encode("The quick brown fox")
    target = tree_gen.target
    target.reset()
    first = int(target.forward(ids)[0].argmax())
    after = np.argsort(-target.forward([first])[0])[:3].tolist()
    below = np.argsort(-target.forward([after[0]])[0])[:2].tolist()
    target.reset()
    N = 2000
    (eos,) = tree_gen.eos
    with support.fixed_tree([*after, *below], [0, 0, 0, 1, 1]):
        runs = [
            tree_gen.generate(
                ids, max_new_tokens=2, seed=s, temperature=1.0, proposer="fixedtree", tree_nodes=5, seeded_noise=False
            )
            for s in range(N)
        ]
    assert sum(r.stats.tree_rounds for r in runs) > N // 2  # the second token came from a tree round
    spec = [first_pair(r, eos) for r in runs]
    base = sample_pairs(tree_gen, ids, range(N, 2 * N), False, temperature=1.0, top_k=0)
    check_pairs_follow_target(tree_gen.target, ids, spec, base, eos, "fixed trees")


def test_tree_nodes_are_checked(tree_gen, tree_kind, tiny_artifacts):
    with pytest.raises(InvalidArgument, match="tree_nodes"):
        tree_gen.generate("hi", tree_nodes=64)
    with pytest.raises(InvalidArgument, match="tree_nodes"):
        tree_gen.generate("hi", tree_nodes=-1)
    with pytest.raises(InvalidArgument, match="grammar"):
        tree_gen.generate("hi", tree_nodes=4, grammar=Grammar.regex("[a-z]+"))
    chain_only = load(tiny_artifacts[CHAIN_KIND[tree_kind]])
    with pytest.raises(InvalidArgument, match="tree graph") as info:
        chain_only.generate("hi", tree_nodes=4)
    assert "\n" not in str(info.value)


def test_manifest_records_the_tree_graph(tree_gen, tree_kind):
    entry = tree_gen.manifest.target
    portable = entry.kv_layout == contract.TIME_MAJOR
    assert portable == (tree_kind == "noisy-tree")
    assert entry.tree_graph == "target/tree.onnx"
    assert tree_gen.manifest.contract_version == ("1.9" if portable else "1.7")
    rows = entry.validation["tree_rows"]
    assert rows["max_abs_diff"] < 1e-3 and rows["argmax_agreement"] == 1.0 and rows["rows"] == 13
    assert rows["exactness"] == ("bitwise" if rows["max_abs_diff"] == 0 else "numerical")
    if not portable:  # GroupQueryAttention with a bias sums in another order
        assert rows["exactness"] == "numerical"


def test_a_portable_tree_artifact_needs_contract_1_9(tiny_artifacts, tmp_path, monkeypatch):
    """A 1.8 runtime refuses the portable tree artifact in one line (and still reads the fused
    one, 1.7); a manifest declaring 1.8 with a time_major tree graph is refused too."""
    import json
    import shutil

    root = Path(shutil.copytree(tiny_artifacts["noisy-tree"], tmp_path / "a"))
    assert read_manifest(root).contract_version == contract.PORTABLE_TREE_VERSION == "1.9"
    with monkeypatch.context() as patch:
        patch.setattr(contract, "CONTRACT_VERSION", "1.8")
        with pytest.raises(ArtifactError, match="'1.9' is not supported") as info:
            read_manifest(root)
        assert "\n" not in str(info.value)
        assert read_manifest(tiny_artifacts["noisy-fused-tree"]).contract_version == "1.7"
    data = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps({**data, "contract_version": "1.8"}))
    with pytest.raises(ArtifactError, match="needs contract 1.9") as info:
        read_manifest(root)
    assert "\n" not in str(info.value)


# --- suffix_index.draft_tree (pure) ------------------------------------------------------


def _seq(*tokens: int) -> np.ndarray:
    return np.array(tokens, np.int32)


def test_draft_tree_is_best_first_by_path_probability():
    """After token 1: 2 follows four times; then 3 (twice), 4 and 5 once each; after 1 2 3: 6
    twice. Path probabilities: 2 -> 1, 3 -> 0.5, 6 -> 0.5, 4 -> 0.25, 5 -> 0.25. The first path
    (2 3 6, what a chain drafts) comes first and whole; branches best first within the budget."""
    seq = _seq(1, 2, 3, 6, SEP, 1, 2, 3, 6, SEP, 1, 2, 4, SEP, 1, 2, 5, SEP, 1)
    ends = np.array([0, 5, 10, 14])  # the occurrences of 1 before the last one
    tokens, parents, score = draft_tree(seq, ends, len(seq), nodes=5, depth=8, min_prob=0.1)
    assert tokens == [2, 3, 6, 4, 5] and parents == [0, 1, 2, 1, 1]
    assert score == pytest.approx(1 + 0.5 + 0.5 + 0.25 + 0.25)
    tokens, parents, _ = draft_tree(seq, ends, len(seq), nodes=5, depth=8, min_prob=0.3)
    assert (tokens, parents) == ([2, 3, 6], [0, 1, 2])  # 4 and 5 fall below min_prob
    tokens, parents, _ = draft_tree(seq, ends, len(seq), nodes=4, depth=8, min_prob=0.0)
    assert (tokens, parents) == ([2, 3, 6, 4], [0, 1, 2, 1])  # the node budget
    tokens, parents, _ = draft_tree(seq, ends, len(seq), nodes=2, depth=8, min_prob=0.0)
    assert (tokens, parents) == ([2, 3, 6], [0, 1, 2])  # the first path (the chain) is never cut
    tokens, parents, _ = draft_tree(seq, ends, len(seq), nodes=9, depth=1, min_prob=0.0)
    assert (tokens, parents) == ([2], [0])  # no path deeper than `depth`


def test_draft_tree_keeps_the_most_frequent_branches():
    followers = list(range(10, 10 + TREE_BRANCHES + 2))  # more distinct continuations than branches
    seq = []
    for i, t in enumerate(followers):
        seq += [1, t, SEP] * (len(followers) - i)  # token 10 most often, then 11, ...
    seq = _seq(*seq)
    ends = np.flatnonzero(seq == 1)
    tokens, parents, _ = draft_tree(seq, ends, len(seq), nodes=20, depth=1, min_prob=0.0)
    assert tokens == followers[:TREE_BRANCHES] and parents == [0] * TREE_BRANCHES


def test_tree_drafts_from_the_proposer_are_topological(tree_gen, free_rows):
    """A suffix tree holds the chain the same proposer drafts in chain mode as its first path
    (first children), then branches up to the node budget, in topological order."""
    from specexport_runtime.tree import first_path

    ids = tree_gen.codec.encode(PROMPTS[-1])
    chain = tree_gen.build_proposer("suffix", tree_gen.configure(proposer="suffix"))
    chain.start(ids)
    chain_tokens, _, _ = chain.retrieve(ids)
    prop = tree_gen.build_proposer("suffix", tree_gen.configure(proposer="suffix", tree_nodes=24))
    prop.start(ids)
    tokens, score, source = prop.retrieve(ids)
    proposal = prop.use_last()
    assert tokens and proposal.parents is not None and len(proposal.parents) == len(tokens) <= 24
    assert all(0 <= p <= i for i, p in enumerate(proposal.parents))
    assert [tokens[i] for i in first_path(proposal.parents)] == chain_tokens
    assert SuffixConfig().min_prob <= score


def test_a_tree_proposal_without_a_tree_graph_is_verified_as_its_first_path(tiny_artifacts):
    """On an artifact without a tree graph (or in a batch) a tree proposal is cut to the path of
    first children, a chain; the output still equals target-only."""
    import fixed_tree_support as support

    from specexport_runtime.tree import first_path

    assert first_path([0, 0, 1, 1, 3, 0]) == [0, 2, 4]
    gen = load(tiny_artifacts["noisy-fused"])
    ids = gen.codec.encode(PROMPTS[0])
    ref = gen.generate(ids, max_new_tokens=24, speculative=False).token_ids
    gen.target.reset()
    chain = [ref[1]] if len(ref) > 1 else [0]
    with support.fixed_tree([*chain, 3, 4], [0, 0, 1]):
        out = gen.generate(ids, max_new_tokens=24, proposer="fixedtree", gamma=4)
    assert out.token_ids == ref and out.stats.tree_rounds == 0 and out.stats.drafted > 0


def test_draft_tree_is_priced_by_the_row_cost():
    """The same occurrences as above (q: 1, 0.5, 0.5, 0.25, 0.25). Rows nearly free (b/a 0.01)
    keep all five; at b/a = 0.2 the fourth node (q 0.25) would lower the expected rate:
    0.25 (1 + 0.2 x 4) = 0.45 <= 0.2 (1 + 2) = 0.6; a chain of one branch comes back as a chain."""
    from specexport_runtime.suffix_index import Occurrences, draft

    seq = _seq(1, 2, 3, 6, SEP, 1, 2, 3, 6, SEP, 1, 2, 4, SEP, 1, 2, 5, SEP, 1)
    ends = np.array([0, 5, 10, 14])
    cheap = draft_tree(seq, ends, len(seq), nodes=5, depth=8, min_prob=0.1, line=(1.0, 0.01))
    assert cheap[0] == [2, 3, 6, 4, 5]
    dear = draft_tree(seq, ends, len(seq), nodes=5, depth=8, min_prob=0.1, line=(1.0, 0.2))
    assert (dear[0], dear[1]) == ([2, 3, 6], [0, 1, 2])
    # b/a 0.05: at face value the branches pay (0.25 x 1.2 > 0.05 x 3); where the source's scores
    # have been borne out a fifth (factor 0.2) they do not (0.05 x 1.2 <= 0.05 x 1.4)
    assert draft_tree(seq, ends, len(seq), nodes=5, depth=8, min_prob=0.1, line=(1.0, 0.05))[0] == [2, 3, 6, 4, 5]
    calibrated = draft_tree(seq, ends, len(seq), nodes=5, depth=8, min_prob=0.1, line=(1.0, 0.05), factor=0.2)
    assert calibrated[0] == [2, 3, 6]
    got = draft(Occurrences(8, seq, ends, len(seq)), SuffixConfig(), 8, tree_nodes=5, line=(1.0, 0.2))  # m 8: depth 8
    assert got.tokens == [2, 3, 6] and got.parents is None  # no branch left: verified as a chain


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_cli_generates_with_trees(tiny_artifacts, free_rows, capsys, kind):
    """`generate --tree-nodes` through the CLI's own main (in process, so the free-rows line holds):
    the same tokens as target-only, some rounds verified as trees; a budget past 63 is one line."""
    import json

    from specexport_runtime.cli import main

    args = ["generate", str(tiny_artifacts[kind]), "--prompt", PROMPTS[1], "--json"]
    runs = {}
    for extra in ([], ["--proposer", "suffix", "--tree-nodes", "16"]):
        assert main(args + extra) == 0
        runs[bool(extra)] = json.loads(capsys.readouterr().out)
    assert runs[True]["token_ids"] == runs[False]["token_ids"]
    assert runs[True]["stats"]["tree_rounds"] > 0
    assert main(args + ["--tree-nodes", "99"]) == 2
    err = capsys.readouterr().err
    assert "tree_nodes" in err and len(err.strip().splitlines()) == 1


def test_as_chain_keeps_the_first_path_and_its_draft_rows(tiny_artifacts):
    """Where only chains are verified, a tree proposal becomes the path of first children, and a
    sampled tree's draft rows q follow that path (row i of q belongs to token i)."""
    from specexport_runtime.proposers import Proposal

    gen = load(tiny_artifacts["noisy-fused"])
    loop = gen.make_loop(gen.configure(proposer="suffix"))
    V = gen.manifest.target.embedding_rows
    q = np.eye(4, V)  # [4, V]: token i drawn from row i
    tree = Proposal([5, 6, 7, 8], q, free=True, parents=(0, 0, 1, 3))  # first path: tokens 0, 2, 3
    chain = loop.as_chain(tree)
    assert chain.tokens == [5, 7, 8] and chain.parents is None
    np.testing.assert_array_equal(chain.q, q[[0, 2, 3]])
    assert loop.as_chain(Proposal([5], None)).tokens == [5]  # a chain stays as it is


def test_the_server_reports_the_tree_size_and_where_it_came_from(tiny_artifacts):
    """The `speculative` object names the trees' size and its origin: given by the server's
    config, or chains for an artifact without a tree graph."""
    pytest.importorskip("starlette")
    from test_server_support import CHAT, LiveServer, post

    body = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 8, "temperature": 0}
    body["proposer"] = "suffix"
    for kind, config, want in (("noisy-tree", {"tree_nodes": 8}, (8, "given")), ("noisy", {}, (0, "chains"))):
        server = LiveServer(load(tiny_artifacts[kind], threads=1, config=config))
        try:
            status, _, res = post(server.port, CHAT, {**body, "model": server.state.model})
            assert status == 200, res
            spec = res["speculative"]
            assert (spec["tree_nodes"], spec["tree_policy"]) == want
        finally:
            server.close()
