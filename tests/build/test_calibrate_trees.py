"""specexport calibrate chooses the tree size per domain (calibrate_trees.py) on a tiny artifact with
a tree graph, and the runtime applies it to calls that name no tree_nodes.

An oracle proposer (registered for the test) knows the target's greedy continuation of each prompt.
On "code" prompts its chain's first token is wrong and its tree holds the right path as the root's
second child, so only trees get tokens accepted; on "chat" prompts its chain is right and its tree
adds wrong siblings, so trees add rows and no tokens. The costs are given (a line per row for both
graphs), so the choice is deterministic: trees for code, chains for chat. Greedy output with the
calibrated trees must equal target-only output (the reference: one token per call, no proposer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_support import _copy

from specexport.bench import calibrate_trees
from specexport.bench.calibrate import calibrate, write_calibration
from specexport.bench.harness_cases import encode_prompt
from specexport.bench.prompts import Prompt
from specexport_runtime import registry
from specexport_runtime.api import CALIBRATION_NAME, load
from specexport_runtime.drafts import Proposal
from specexport_runtime.policy import TREE_CALIBRATED, TREE_CHAINS, TREE_GIVEN
from specexport_runtime.proposers import Proposer

NEW = 24
TEXTS = {"code": ["def add(a, b):\n", "for i in range(10):\n"], "chat": ["The quick brown fox", "hello world hello"]}
PROMPTS = [
    Prompt(id=f"{d}-{i}", domain=d, messages=None, text=t, max_new_tokens=NEW)
    for d, texts in TEXTS.items()
    for i, t in enumerate(texts)
]
ROW = 0.05  # seconds per row past the first, both graphs; decode 1 s
COSTS = {
    "decode_s": 1.0,
    "verify_s": {s: 1.0 + ROW * (s - 1) for s in range(2, 65)},
    "tree_verify_s": {r: 1.0 + ROW * (r - 1) for r in (2, 9, 17, 33, 64)},
    "draft_step_s": {"oracle": 0.0},
}
REFS: dict[tuple[int, ...], tuple[str, list[int]]] = {}  # prompt ids -> (domain, greedy continuation)


class OracleProposer(Proposer):
    """Drafts from the target's own greedy continuation (REFS): code prompts a wrong chain and a
    tree whose second branch is right, chat prompts a right chain and a tree of it plus wrong
    siblings. Nothing for a prompt it does not know (the warm-up)."""

    name = "oracle"

    def __init__(self, nodes: int, vocab: int):
        self.nodes, self.vocab, self.prompt = nodes, vocab, ()

    def start(self, prompt) -> None:
        self.prompt = tuple(int(t) for t in prompt)

    def commit(self, committed, n_new) -> None:
        pass

    def propose(self, committed, gamma, params, rng) -> Proposal:
        domain, ref = REFS.get(self.prompt, ("", []))
        truth = ref[len(committed) - len(self.prompt) :][:gamma]
        if not truth:
            return Proposal([], None, free=True)
        wrong = [(t + 1) % self.vocab for t in truth]
        if domain == "code":
            if not self.nodes:
                return Proposal(wrong, None, free=True)
            tokens = [wrong[0], *truth]  # rows: 1 wrong, 2.. the right path under the root
            parents = (0, 0, *range(2, len(truth) + 1))
        else:
            if not self.nodes:
                return Proposal(truth, None, free=True)
            siblings = [(truth[0] + j) % self.vocab for j in range(1, self.nodes - len(truth) + 1)]  # never accepted
            tokens = [*truth, *siblings]
            parents = (*range(len(truth)), *([0] * len(siblings)))
        n = min(self.nodes, len(tokens))  # a topological prefix is a tree
        return Proposal(tokens[:n], None, free=True, parents=parents[:n])


def build_oracle(ctx) -> OracleProposer:
    return OracleProposer(0 if ctx.batched else ctx.config.tree_nodes, ctx.manifest.target.embedding_rows)


ORACLE = registry.ProposerSpec(
    "oracle", build_oracle, "the target's own greedy continuation", calibration="oracle", calibrate=registry.LOOP
)


@pytest.fixture(scope="module")
def oracle(tiny_artifacts):
    """The oracle registered as a tree drafter, and REFS filled from target-only generations."""
    gen = load(tiny_artifacts["noisy-fused-tree"])
    for p in PROMPTS:
        ids = list(encode_prompt(gen.codec, p))
        REFS[tuple(ids)] = (p.domain, gen.generate(ids, max_new_tokens=NEW + 8, speculative=False).token_ids)
    with registry.extended(ORACLE):
        yield
    REFS.clear()


@pytest.fixture
def as_tree_drafter(monkeypatch):
    monkeypatch.setattr(calibrate_trees, "TREE_DRAFTERS", (*calibrate_trees.TREE_DRAFTERS, "oracle"))


def _calibrate(art: Path, **kw) -> dict:
    doc = calibrate(
        art,
        domains=("code", "chat"),
        proposers=["oracle"],
        gammas=(1, 2, 4),
        prompts=PROMPTS,
        max_new_tokens=NEW,
        device_name="dev",
        costs=COSTS,
        **kw,
    )
    return doc["profiles"]["dev"]


def test_calibration_picks_trees_where_they_pay_and_chains_where_not(oracle, as_tree_drafter, tiny_artifacts, tmp_path):
    art = _copy(tiny_artifacts["noisy-fused-tree"], tmp_path)
    prof = _calibrate(art, tree_nodes=(8, 16))
    assert prof["settings"]["tree_nodes"] == [8, 16] and prof["settings"]["tree_proposers"] == ["oracle"]
    assert set(prof["costs"]["tree_verify_s"]) == {"2", "9", "17", "33", "64"}
    code, chat = prof["domains"]["code"]["oracle"], prof["domains"]["chat"]["oracle"]

    # code: chains accept nothing (gamma 0: a wrong first token never pays), trees accept the path
    by = code["expected_speedup_by_tree_nodes"]
    assert code["tree_nodes"] == 8 and by["8"] > 2 * by["0"] and by["0"] < 1
    assert code["tokens_per_call_by_tree_nodes"]["0"] == pytest.approx(1.0)
    assert code["tokens_per_call_by_tree_nodes"]["8"] > 3  # depth 4: up to 5 tokens a call
    assert code["gamma"] == code["tree_gamma"] == 4  # the depth the trees ran at, chains having said 0
    assert code["expected_speedup"] == pytest.approx(by["8"]) and code["tree_calls_by_tree_nodes"]["8"] > 0
    # 16 nodes hold the same accepted path with no more rows (the oracle's tree has 5): a tie, the smaller wins
    assert by["16"] == pytest.approx(by["8"])

    # chat: the same tokens per call, more rows: chains
    by = chat["expected_speedup_by_tree_nodes"]
    assert chat["tree_nodes"] == 0 and by["0"] > by["8"] > by["16"] and chat["gamma"] == 4
    tpc = chat["tokens_per_call_by_tree_nodes"]
    assert tpc["8"] == pytest.approx(tpc["0"]) and chat["tree_calls_by_tree_nodes"]["8"] > 0
    # the chain's figure is calibrate.py's formula at gamma 4: (4 + 1) tokens for verify(5) a full round
    assert by["0"] == pytest.approx(chat["expected_speedup"]) and by["0"] <= 5 / (1 + 4 * ROW) + 1e-9

    default = prof["domains"]["default"]["oracle"]
    assert "tree_nodes" in default and set(default["expected_speedup_by_tree_nodes"]) == {"0", "8", "16"}
    assert json.loads((art / CALIBRATION_NAME).read_text())["profiles"]["dev"] == json.loads(json.dumps(prof))

    # the runtime: a call naming no tree_nodes gets the calibrated size of its domain and proposer
    gen = load(art)
    for p in PROMPTS:
        ids = list(encode_prompt(gen.codec, p))
        ref = gen.generate(ids, max_new_tokens=NEW, speculative=False).token_ids
        run = gen.events(ids, proposer="oracle", domain=p.domain, max_new_tokens=NEW)
        out = run.collect()
        assert out.token_ids == ref, p.id
        assert run.tree_policy == TREE_CALIBRATED
        if p.domain == "code":
            assert run.config.tree_nodes == 8 and out.stats.tree_rounds > 0 and out.stats.accepted > 0
        else:
            assert run.config.tree_nodes == 0 and out.stats.tree_rounds == 0
        # an explicit tree_nodes wins, 0 included
        chains = gen.events(ids, proposer="oracle", domain=p.domain, max_new_tokens=NEW, tree_nodes=0)
        assert chains.collect().stats.tree_rounds == 0 and chains.tree_policy == TREE_GIVEN
        assert chains.config.tree_nodes == 0
    # a proposer with no calibrated tree size, and target-only decoding, run chains
    run = gen.events(ids, proposer="suffix", domain="code", max_new_tokens=4)
    assert run.collect().stats.tree_rounds == 0 and run.tree_policy == TREE_CHAINS
    assert gen.events(ids, speculative=False, domain="code", max_new_tokens=4).tree_policy == TREE_CHAINS


def test_calibrate_without_trees_keeps_chains(oracle, as_tree_drafter, tiny_artifacts, tmp_path):
    """tree_nodes=() measures no trees: the entries carry no tree size, and a call runs chains."""
    art = _copy(tiny_artifacts["noisy-fused-tree"], tmp_path)
    prof = _calibrate(art, tree_nodes=())
    assert prof["settings"]["tree_proposers"] == [] and "tree_verify_s" not in prof["costs"]
    assert all("tree_nodes" not in per["oracle"] for per in prof["domains"].values())
    gen = load(art)
    ids = list(encode_prompt(gen.codec, PROMPTS[0]))
    run = gen.events(ids, proposer="oracle", domain="code", max_new_tokens=8)
    assert run.collect().stats.tree_rounds == 0 and run.tree_policy == TREE_CHAINS


def test_an_artifact_without_a_tree_graph_never_gets_a_tree_size(oracle, as_tree_drafter, tiny_artifacts, tmp_path):
    art = _copy(tiny_artifacts["noisy-fused"], tmp_path)
    prof = _calibrate(art)
    assert prof["settings"]["tree_proposers"] == [] and "tree_verify_s" not in prof["costs"]
    assert all("tree_nodes" not in per["oracle"] for per in prof["domains"].values())
    # a calibration file that names a size anyway (another artifact's) is not applied: chains, no error
    doc = json.loads((art / CALIBRATION_NAME).read_text())
    for per in doc["profiles"]["dev"]["domains"].values():
        per["oracle"]["tree_nodes"] = 8
    write_calibration(art, doc)
    gen = load(art)
    ids = list(encode_prompt(gen.codec, PROMPTS[0]))
    run = gen.events(ids, proposer="oracle", domain="code", max_new_tokens=8)
    assert run.collect().stats.tree_rounds == 0 and run.tree_policy == TREE_CHAINS and run.config.tree_nodes == 0


def test_tree_nodes_none_is_the_default_and_checked():
    from specexport_runtime.config import GeneratorConfig
    from specexport_runtime.errors import InvalidArgument

    assert GeneratorConfig().tree_nodes is None
    with pytest.raises(InvalidArgument, match=r"tree_nodes must be an integer in 0\.\.63 .* or None"):
        GeneratorConfig(tree_nodes=64)
    with pytest.raises(ValueError, match="tree_nodes must be integers in 1..63"):
        calibrate("/nonexistent", tree_nodes=(0,))


def test_cli_calibrates_suffix_trees_with_measured_costs(tiny_artifacts, tmp_path):
    """`specexport calibrate --proposer suffix --tree-nodes 8` on a tree artifact: the tree graph's
    call costs are timed, every entry gets a tree size and the report prints it."""
    from bench_support import LINES
    from click.testing import CliRunner

    from specexport.cli.bench import calibrate as calibrate_cmd

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in LINES), encoding="utf-8")
    art = _copy(tiny_artifacts["noisy-fused-tree"], tmp_path)
    args = [str(art), "--prompts", str(prompts), "--domains", "code", "--proposer", "suffix", "--tree-nodes", "8"]
    result = CliRunner().invoke(calibrate_cmd, [*args, "--prompts-per-domain", "1", "--max-new-tokens", "6", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "tree/decode  R=2:" in result.output and "suffix gamma" in result.output
    prof = json.loads((art / CALIBRATION_NAME).read_text())
    prof = prof["profiles"][prof["default_profile"]]
    assert prof["settings"]["tree_nodes"] == [8] and min(prof["costs"]["tree_verify_s"].values()) > 0
    for per in prof["domains"].values():
        assert per["suffix"]["tree_nodes"] in (0, 8)
        assert f"tree_nodes {per['suffix']['tree_nodes']}" in result.output
    bad = CliRunner().invoke(calibrate_cmd, [*args[:-1], "eight"])
    assert bad.exit_code != 0 and "--tree-nodes" in bad.output
