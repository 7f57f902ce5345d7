"""Tree sizes for `specexport calibrate`: on an artifact with a tree graph, the tree_nodes with the
best expected speedup per domain and proposer that drafts trees, or 0 when chains win.

Trees cannot be read off chain rounds, so each candidate size n is run: greedy generations of the
domain's prompts with tree_nodes n, at the domain's gamma (the chain choice, or the measuring gamma
where that is 0; a tree's depth is its round's gamma). Each round's drafted k and accepted a (a
plain step as (0, 0)) and the rows R of every tree-verify call are observed, and priced with the
same costs as chains plus the tree graph's own call costs tree(R):

    tokens(n)  = sum over rounds of (a + 1)
    seconds(n) = sum over rounds of (decode if k = 0 else k·tree_step + verify(k + 1))
                 + sum over tree calls of (tree(R) - verify(R))
    expected speedup(n) = tokens(n) · decode / seconds(n)

(a tree call of R rows is a round of k = R - 1 drafts: its chain price verify(R) is swapped for
tree(R); a round whose tree kept no branch is verified as a chain by the batch-1 graph.)
tree_step is the draft seconds per drafted node of the tree runs (costs' tree_draft_step_s, else
the chain's draft_step_s); tree(R) is the least-squares line of costs' tree_verify_s
(costs.VerifyCost, the runtime's line). Chains (n = 0) are calibrate.py's rounds at the same gamma
(cut to it; the suffix proposer's drafts are not cut by gamma, so its rounds count whole). The
largest expected speedup wins (the smaller size on a tie) when it beats chains' by TREE_MARGIN
(2%), else chains; "default" pools the tokens and seconds of every
domain. A tree choice with a chain gamma of 0 also sets gamma to the depth the trees ran at.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specexport_runtime.costs import VerifyCost
from specexport_runtime.tree import DraftTree

from . import harness
from .run import run_one
from .stats import verify_cost

DEFAULT_TREE_NODES = (8, 16, 24)  # docs/trees.md measured 8-32; 24 keeps a tree call under 26 rows
# the proposers whose drafts can be trees (docs/trees.md "What drafts trees"); eagle and mtp need
# their head's tree graph, suffix and assistant only the target's
TREE_DRAFTERS = ("suffix", "eagle", "mtp", "assistant")
HEAD_TREES = ("eagle", "mtp")
UNCUT = ("suffix",)  # drafts whose length gamma does not cut (the suffix proposer's own limit)
TREE_TIMING_ROWS = (2, 5, 9, 17, 25)
# a tree size is chosen only when its expected speedup beats chains' by this fraction: the sizes'
# figures differ by less than the timing noise where trees add no accepted tokens
TREE_MARGIN = 0.02


@dataclass
class TreeRun:
    """What generations with one tree size observed: rounds (k, a), plain steps as (0, 0); the
    tree-verify calls by rows; draft seconds and drafted nodes (the in-loop draft cost)."""

    rounds: list[tuple[int, int]] = field(default_factory=list)
    tree_calls: dict[int, int] = field(default_factory=dict)  # rows R -> calls
    draft_seconds: float = 0.0
    drafted: int = 0

    def add(self, other: TreeRun) -> None:
        self.rounds += other.rounds
        for rows, calls in other.tree_calls.items():
            self.tree_calls[rows] = self.tree_calls.get(rows, 0) + calls
        self.draft_seconds += other.draft_seconds
        self.drafted += other.drafted


def tree_proposers(gen, proposers: Sequence[str]) -> list[str]:
    """The calibrated proposers that draft trees on this generator: none without the target's
    tree graph; eagle and mtp only with their head's tree graph."""
    if gen.tree is None:
        return []
    return [p for p in proposers if p in TREE_DRAFTERS and (p not in HEAD_TREES or gen.head_tree is not None)]


# --------------------------------------------------------------------------- pricing


def chain_totals(rounds: Sequence[tuple[int, int]], gamma: int, costs: dict, step: float) -> tuple[float, float, int]:
    """(tokens, seconds, target calls) of rounds observed at a larger gamma, drafted up to `gamma`
    tokens (calibrate.py's formula: a round of min(k, gamma) = 0 drafts is a plain step)."""
    decode = costs["decode_s"]
    tokens = seconds = 0.0
    for k, a in rounds:
        kk = min(k, gamma)
        tokens += min(a, gamma) + 1
        seconds += decode if kk == 0 else kk * step + verify_cost(costs, kk + 1)
    return tokens, seconds, len(rounds)


def tree_line(costs: dict) -> VerifyCost:
    """The tree graph's call cost line through costs' tree_verify_s (rows -> seconds)."""
    return VerifyCost(by_rows={int(r): float(s) for r, s in costs["tree_verify_s"].items()})


def tree_totals(run: TreeRun, costs: dict, proposer: str) -> tuple[float, float, int]:
    """(tokens, seconds, target calls) of one tree size's rounds (module docstring)."""
    step = (costs.get("tree_draft_step_s") or {}).get(proposer, costs["draft_step_s"][proposer])
    tokens, seconds, calls = chain_totals(run.rounds, max((k for k, _ in run.rounds), default=0), costs, step)
    line = tree_line(costs)
    for rows, count in run.tree_calls.items():
        seconds += count * (line.seconds(rows) - verify_cost(costs, rows))
    return tokens, seconds, calls


def choose_trees(
    choices: dict[str, dict],
    chain_rounds: dict[str, dict[str, list[tuple[int, int]]]],
    runs: dict[str, dict[str, dict[int, TreeRun]]],
    gammas: dict[tuple[str, str], int],
    costs: dict,
    measure_gamma: int,
) -> None:
    """Add tree_nodes (and the figures behind it) to each (domain, proposer) entry of `choices`
    (calibrate._choices) that `runs` measured, the trees having run at gammas[domain, proposer];
    "default" pools the domains' totals."""
    pooled: dict[str, dict[int, list]] = {}  # proposer -> n -> [tokens, seconds, calls, tree calls]
    for d, per_prop in runs.items():
        for prop, by_n in per_prop.items():
            rounds = chain_rounds[d][prop]
            cut = max((k for k, _ in rounds), default=0) if prop in UNCUT else gammas[d, prop]
            totals = {0: (*chain_totals(rounds, cut, costs, costs["draft_step_s"][prop]), 0)}
            for n, run in by_n.items():
                totals[n] = (*tree_totals(run, costs, prop), sum(run.tree_calls.values()))
            _record(choices[d][prop], totals, gammas[d, prop], costs["decode_s"])
            for n, row in totals.items():
                acc = pooled.setdefault(prop, {}).setdefault(n, [0.0, 0.0, 0, 0])
                for i, v in enumerate(row):
                    acc[i] += v
    for prop, totals in pooled.items():
        entry = choices["default"][prop]
        _record(entry, {n: tuple(v) for n, v in totals.items()}, entry["gamma"] or measure_gamma, costs["decode_s"])


def _record(entry: dict, totals: dict[int, tuple], gamma: int, decode: float) -> None:
    """Set the entry's tree choice from (tokens, seconds, calls, tree calls) per size (0: chains)."""
    by_n = {n: t * decode / s if s > 0 else 1.0 for n, (t, s, _, _) in sorted(totals.items())}
    best = max((n for n in by_n if n), key=lambda n: (by_n[n], -n), default=0)
    if not by_n.get(best, 0.0) >= (1.0 + TREE_MARGIN) * by_n[0]:
        best = 0  # within the margin of chains: chains
    entry["tree_nodes"] = best
    entry["tree_gamma"] = gamma  # the gamma (tree depth) the sizes were measured at
    entry["expected_speedup_by_tree_nodes"] = {str(n): x for n, x in by_n.items()}
    entry["tokens_per_call_by_tree_nodes"] = {str(n): t / c if c else None for n, (t, _, c, _) in totals.items()}
    entry["tree_calls_by_tree_nodes"] = {str(n): tc for n, (_, _, _, tc) in totals.items()}
    if best:
        entry["expected_speedup"] = by_n[best]
        entry["gamma"] = entry["gamma"] or gamma


# --------------------------------------------------------------------------- observing and timing


def observe_trees(
    gen,
    cases: dict,
    proposers: list[str],
    greedy,
    gammas: dict[tuple[str, str], int],
    sizes: Sequence[int],
    max_new_tokens: int,
    progress: Callable[[int, int, str], None] | None = None,
) -> dict[str, dict[str, dict[int, TreeRun]]]:
    """Generate every case with every tree proposer and size. -> domain -> proposer -> n -> TreeRun."""
    out: dict[str, dict[str, dict[int, TreeRun]]] = {}
    total, done = sum(len(v) for v in cases.values()) * len(proposers) * len(sizes), 0
    for d, dcases in cases.items():
        for prop in proposers:
            for n in sizes:
                run = out.setdefault(d, {}).setdefault(prop, {}).setdefault(n, TreeRun())
                for case in dcases:
                    limit = min(case.max_new_tokens, max_new_tokens)
                    config = greedy.replace(proposer=prop, gamma=gammas[d, prop], tree_nodes=n, max_new_tokens=limit)
                    before = _tree_calls(gen)
                    rec = run_one(gen, case, config)
                    after = _tree_calls(gen)
                    run.add(
                        TreeRun(
                            rec.round_sizes + [(0, 0)] * rec.plain_steps,
                            {r: c - before.get(r, 0) for r, c in after.items() if c > before.get(r, 0)},
                            rec.draft_seconds,
                            rec.drafted,
                        )
                    )
                    done += 1
                    if progress is not None:
                        progress(done, total, f"{d} {prop} tree {n} {case.id}")
    return out


def _tree_calls(gen) -> dict[int, int]:
    return {int(r): int(v[0]) for r, v in gen.tree.stats.by_len.items()}


def bushy_tree(rows: int, ids: Sequence[int]) -> DraftTree:
    """A tree of `rows` rows of the prompt's tokens, each node with two children (breadth first)."""
    parents = [-1] + [(i - 1) // 2 for i in range(1, rows)]
    return DraftTree(np.resize(np.asarray(ids, np.int64), rows), parents)


def measure_tree_costs(gen, ids: Sequence[int], max_nodes: int, repeats: int) -> dict[int, float]:
    """Median seconds of tree-verify calls of TREE_TIMING_ROWS (and max_nodes + 1) rows after the
    prompt `ids` (the cursor rolled back after every call, the argmax over the rows included), the
    sizes interleaved as calibrate.measure_costs does for chains."""
    target, tree = gen.target, gen.tree
    room = min(target.max_rows, gen.manifest.max_context - len(ids) - 1)
    sizes = sorted({r for r in (*TREE_TIMING_ROWS, max_nodes + 1) if 2 <= r <= room})
    target.reset()
    target.forward([int(t) for t in ids])
    base = target.length

    def call(rows: int) -> Callable[[], None]:
        shape = bushy_tree(rows, ids)

        def run() -> None:
            target.truncate(base)
            tree.forward(shape).argmax(-1)

        return run

    seconds = harness.interleaved_seconds({r: call(r) for r in sizes}, repeats)
    target.reset()
    return {int(r): float(s) for r, s in seconds.items()}
