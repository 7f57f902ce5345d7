"""A test-only proposer: the same draft tree every round (TREE: tokens, parents), whatever the
context; no model call. tests/runtime/test_tree_loop.py registers it (registry.extended) to
check the sampling law of tree verification on a tree it controls."""

from __future__ import annotations

from specexport_runtime.proposers import Proposal, Proposer, ProposerContext

TREE: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # tokens, parents (0: the root; j + 1: token j)


class FixedTreeProposer(Proposer):
    name = "fixedtree"
    proposes_when_off = True

    def start(self, prompt) -> None:
        pass

    def propose(self, committed, gamma, params, rng) -> Proposal:
        tokens, parents = TREE
        return Proposal(list(tokens), None, lookup=True, source="fixedtree", parents=tuple(parents))

    def commit(self, committed, n_new) -> None:
        pass


def build(ctx: ProposerContext) -> FixedTreeProposer:
    return FixedTreeProposer()
