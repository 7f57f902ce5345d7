"""A test-only proposer: the same draft tree every round (TREE: tokens, parents), whatever the
context; no model call. tests/runtime/test_tree_loop.py registers it (registry.extended) to
check the sampling law of tree verification on a tree it controls."""

from __future__ import annotations

from specexport_runtime.proposers import Proposal, Proposer, ProposerContext

TREE: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())  # tokens, parents (0: the root; j + 1: token j)


class FixedTreeProposer(Proposer):
    name = "fixedtree"
    free_when_off = True

    def start(self, prompt) -> None:
        pass

    def propose(self, committed, gamma, params, rng) -> Proposal:
        tokens, parents = TREE
        return Proposal(list(tokens), None, free=True, source="fixedtree", parents=tuple(parents))

    def commit(self, committed, n_new) -> None:
        pass


def build(ctx: ProposerContext) -> FixedTreeProposer:
    return FixedTreeProposer()


# oracletree: the target's own continuation (REFERENCE: the tokens target-only decoding appends
# to the prompt), drafted on the second branch of a tree with wrong siblings
REFERENCE: tuple[int, ...] = ()


class OracleTreeProposer(Proposer):
    """Each round the tree [w1, t0, w2, w3, t1, t2] with parents [root, root, root, t0, t0, t1]
    (t: the next reference tokens, w: wrong siblings), so the accepted path is tree rows 2, 5, 6
    and keep_path moves rows every round."""

    name = "oracletree"
    free_when_off = True

    def start(self, prompt) -> None:
        self.prompt_len = len(prompt)

    def propose(self, committed, gamma, params, rng) -> Proposal:
        done = len(committed) - self.prompt_len  # reference tokens already committed
        t = REFERENCE[done : done + 3]
        if len(t) < 3:
            return Proposal([], None)
        # wrong ones differ from the truth beside them and from each other, and stay below the vocabulary
        tokens = [(t[0] + 1) % 256, t[0], (t[0] + 2) % 256, (t[1] + 1) % 256, t[1], t[2]]
        return Proposal(tokens, None, free=True, source="oracletree", parents=(0, 0, 0, 2, 2, 5))

    def commit(self, committed, n_new) -> None:
        pass


def build_oracle(ctx: ProposerContext) -> OracleTreeProposer:
    return OracleTreeProposer()
