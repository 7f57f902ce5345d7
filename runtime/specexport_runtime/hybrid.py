"""The hybrid proposer: free retrieval where it is likely to be accepted, the draft otherwise.

It composes other registered proposers through their public interface only: each round it asks
its retrievers in order for an offer (Proposer.offer: a free proposal good enough to use
unasked), and when none offers, its draft proposer (a draft model or an EAGLE-3 head) drafts
at the controller's gamma. The retrievers are the config's `hybrid_retrieval`, recorded in the
artifact's manifest: "suffix" = the suffix proposer (its drafts that score at least
SuffixConfig.hybrid_min_score), then prompt lookup; "lookup" = prompt lookup only (a match of
the longest n-gram size).

A retrieval proposal costs no model call and, on text that copies its input, is accepted for
long stretches, so it is as long as the retriever's own limit (the room left in the context
permitting) and is tried even when the gamma controller has turned the draft off (gamma 0);
the draft keeps the rounds where nothing repeats. The draft catches up on tokens accepted in
retrieval rounds in one call (timed apart, like its prompt) the next time it drafts. Every
proposal is verified as usual, so the mix stays exact.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from . import registry
from .proposers import DraftCall, Proposal, Proposer, ProposerContext, run_steps


class HybridProposer(Proposer):
    name = "hybrid"
    free_when_off = True  # the loop asks it even when the policy chose gamma 0
    # constrain() stays the default no-op: under a grammar its draft model drafts blind and the
    # loop cuts it; masked, the draft model crowds out the free rounds (docs/structured.md#costs)

    def __init__(self, draft: Proposer, retrievers: Sequence[Proposer]):
        self.draft, self.retrievers = draft, tuple(retrievers)
        self.parts = (draft, *self.retrievers)

    def start(self, prompt: Sequence[int]) -> None:
        for part in self.parts:
            part.start(prompt)

    def propose(self, committed, gamma, params, rng) -> Proposal:
        return run_steps(self.propose_steps(committed, gamma, params, rng))  # a solo draft makes its own calls

    def propose_steps(self, committed, gamma, params, rng) -> Iterator[DraftCall]:
        for retriever in self.retrievers:
            offer = retriever.offer(committed)
            if offer is not None:
                return offer
        if gamma == 0:
            return Proposal([], None)  # the draft is off: a plain step
        return (yield from self.draft.propose_steps(committed, gamma, params, rng))

    def commit(self, committed, n_new) -> None:
        for part in self.parts:
            part.commit(committed, n_new)

    def finish(self, output: Sequence[int]) -> None:
        for part in self.parts:
            part.finish(output)


def build_hybrid(ctx: ProposerContext) -> HybridProposer:
    draft = ctx.build(registry.draft_side(ctx.draft.spec.kind))
    retrievers = [ctx.build("suffix")] if ctx.config.hybrid_retrieval == "suffix" else []
    return HybridProposer(draft, [*retrievers, ctx.build("ngram")])
