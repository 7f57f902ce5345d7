"""A test-only proposer: drafts the last token again, gamma times. Right on runs of one token,
wrong (and cheap to reject) elsewhere; no model call, so it is free."""

from __future__ import annotations

from specexport_runtime.proposers import Proposal, Proposer, ProposerContext


class RepeatProposer(Proposer):
    name = "repeat"

    def start(self, prompt) -> None:
        pass

    def propose(self, committed, gamma, params, rng) -> Proposal:
        return Proposal([int(committed[-1])] * gamma, None, source="repeat")  # deterministic: q one-hot

    def commit(self, committed, n_new) -> None:
        pass


def build(ctx: ProposerContext) -> RepeatProposer:
    return RepeatProposer()
