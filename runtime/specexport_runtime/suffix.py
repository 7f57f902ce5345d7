"""Suffix speculation (SuffixDecoding, chain mode): draft what followed the longest earlier match
of the recent tokens, in the current request, in past responses and in the artifact's corpus,
choosing at each step the continuation seen most often. This module is the policy: which source
a round drafts from (the best score, times how far that source's scores were borne out), how
long a draft may be (the configured limit min(max_spec, floor(factor * m + offset)) for a match
of m tokens, scaled to what pays on the target by LimitTuner), and what is learned across a
generator's requests (SuffixHistory). suffix_index.py matches and drafts over the sequences.

Drafts are deterministic (q one-hot): the verifier's rejection sampling keeps the target's
distribution exactly, and greedy output equals target-only output.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .costs import VerifyCost
from .drafts import SuffixConfig  # noqa: F401 (re-exported: suffix.SuffixConfig)
from .proposers import Proposal, Proposer, ProposerContext
from .suffix_index import MAX_CANDIDATES, SEP, RequestSuffix, SuffixStore, draft, draft_chain, longest_match
from .suffix_limit import LimitTuner


@dataclass
class SourceCalibration:
    """How far each source's score (its expected accepted tokens) is borne out: accepted / scored
    tokens per source, starting from a prior of PRIOR tokens at ratio 1 and halving both sums past
    HORIZON scored tokens, so the factor follows the recent rounds. Shared by the generator's
    requests on purpose (like the gamma controller's learned acceptance): a corpus whose matches
    the target keeps rejecting is trusted less from then on."""

    PRIOR = 8.0
    HORIZON = 2000.0
    scored: dict[str, float] = field(default_factory=dict)
    accepted: dict[str, float] = field(default_factory=dict)

    def factor(self, source: str) -> float:
        return (self.accepted.get(source, 0.0) + self.PRIOR) / (self.scored.get(source, 0.0) + self.PRIOR)

    def record(self, source: str, score: float, accepted: int) -> None:
        scored = self.scored.get(source, 0.0) + score
        got = self.accepted.get(source, 0.0) + accepted
        if scored > self.HORIZON:
            scored, got = scored / 2, got / 2
        self.scored[source], self.accepted[source] = scored, got


@dataclass(frozen=True)
class Retrieved:
    """A source's draft for this round: what verifying it will teach the calibration and tuner."""

    source: str  # 'request', 'store' or 'datastore'
    raw_score: float  # the source's own score (before its calibration factor)
    tokens: tuple[int, ...]
    scale: float  # the tuner's draft-limit scale it was drafted at
    match: int  # tokens of context matched
    parents: tuple[int, ...] | None = None  # a draft tree's (suffix_index.draft_tree); None: a chain


class SuffixProposer(Proposer):
    """Suffix speculation over the request so far, the store of past responses and the artifact's
    corpus: each round every source is matched and the proposal with the highest calibrated score
    is used. Proposals cost no model call, so they are made up to the proposer's own limit even
    when the gamma controller has speculation off (like prompt lookup in `hybrid`). That limit is
    the config's, scaled each round by the tuner's choice among config.limit_scales (LimitTuner,
    priced by the target's VerifyCost); the tuner, like the score calibration, is the
    generator's and learns across requests."""

    name = "suffix"
    free_when_off = True

    def __init__(
        self,
        store: SuffixStore | None,
        config: SuffixConfig,
        max_context: int,
        datastore=None,
        calibration: SourceCalibration | None = None,
        tuner: LimitTuner | None = None,
        cost: VerifyCost | None = None,
        tree_nodes: int = 0,
    ):
        """datastore: a datastore.Datastore (the artifact's corpus) or None; cost: the target's
        verify cost (the generator's; default an untimed one, so the tuner keeps the smallest scale);
        tree_nodes > 0: draft trees of up to that many tokens (suffix_index.draft_tree), each path
        at most the draft limit deep, for an artifact with a tree graph (feature tree_verify)."""
        self.store, self.config, self.max_context, self.datastore = store, config, max_context, datastore
        self.tree_nodes = tree_nodes
        self.calibration = calibration if calibration is not None else SourceCalibration()
        self.tuner = tuner if tuner is not None else LimitTuner()
        self.cost = cost if cost is not None else VerifyCost()
        self._scaled = {x: config.scaled(x) for x in config.limit_scales}
        self.request = RequestSuffix()
        self.prompt_length = 0
        self._last: Retrieved | None = None  # the last retrieve's draft
        self._pending: Retrieved | None = None  # the same, once its draft is verified

    def start(self, prompt: Sequence[int]) -> None:
        self.request.reset(prompt)
        self.prompt_length = len(prompt)

    def retrieve(self, committed: Sequence[int]) -> tuple[list[int], float, str]:
        """(tokens, score, source) of the best source, 'request', 'store' or 'datastore' (ties: in
        that order); the score is the source's own times its calibration factor."""
        room = max(0, self.max_context - len(committed))  # rows left after feeding `last`
        tail = committed[-self.config.max_depth :]
        line = self.cost.line()  # the target's verify cost: the tuner's scale, and a tree's price
        scale = self.tuner.choose(self.config.limit_scales, line)
        config = self._scaled[scale]
        best, best_score = Retrieved("request", 0.0, (), scale, 0), 0.0
        for name, source in (("request", self.request), ("store", self.store), ("datastore", self.datastore)):
            if source is None:
                continue
            factor = self.calibration.factor(name)
            tokens, raw, m, parents = draft(
                source.occurrences(tail, config), config, room, self.tree_nodes, line, factor
            )
            score = raw * factor
            if tokens and score > best_score:
                best, best_score = Retrieved(name, raw, tuple(tokens), scale, m, parents), score
        self._last = best
        return list(best.tokens), best_score, best.source

    def use_last(self) -> Proposal:
        """The last retrieved draft is verified this round: its acceptance will update the
        calibration and the tuner. Deterministic: q one-hot; no evidence on a draft model's
        acceptance or cost (a free draft)."""
        self._pending = self._last
        last = self._last
        return Proposal(list(last.tokens), None, free=True, source=f"suffix-{last.source}", parents=last.parents)

    def offer(self, committed) -> Proposal | None:
        """The best source's draft when its score reaches config.hybrid_min_score, else None."""
        tokens, score, _ = self.retrieve(committed)
        return self.use_last() if tokens and score >= self.config.hybrid_min_score else None

    def propose(self, committed, gamma, params, rng) -> Proposal:
        self.retrieve(committed)
        return self.use_last()

    def commit(self, committed, n_new) -> None:
        done = self._pending
        if done is not None and done.tokens:  # a verified suffix draft: n_new - 1 of it accepted
            accepted = min(n_new - 1, len(done.tokens))
            self.calibration.record(done.source, done.raw_score, accepted)
            self.tuner.record(done.scale, len(done.tokens), accepted, done.match, self._scaled)
        self._pending = None
        self.request.extend(committed[len(committed) - n_new :])

    def finish(self, output: Sequence[int]) -> None:
        """A request ended normally: its accepted output joins the store (never rejected drafts)."""
        if self.store is not None:
            self.store.add(output)


@dataclass
class SuffixHistory:
    """What the suffix proposer learns across a generator's requests (registry: `learns`): the
    store of past answers, the per-source score calibration and the draft-limit tuner."""

    store: SuffixStore
    calibration: SourceCalibration = field(default_factory=SourceCalibration)
    tuner: LimitTuner = field(default_factory=LimitTuner)

    @classmethod
    def create(cls, config) -> SuffixHistory:
        """An empty history sized by a GeneratorConfig's suffix.global_tokens."""
        return cls(SuffixStore(config.suffix.global_tokens))

    def forget(self) -> None:
        """Empty the store of past answers (calibration and tuner describe the target: kept)."""
        self.store = SuffixStore(self.store.max_tokens)


def build_suffix(ctx: ProposerContext) -> SuffixProposer:
    history = ctx.learned("suffix")
    return SuffixProposer(
        history.store,
        ctx.config.suffix,
        ctx.manifest.max_context,
        ctx.datastore(),
        history.calibration,
        history.tuner,
        ctx.verify_cost(),
        0 if ctx.batched else ctx.config.tree_nodes or 0,  # a batch verifies chains only (None: chains)
    )


__all__ = [
    "MAX_CANDIDATES",
    "SEP",
    "LimitTuner",
    "RequestSuffix",
    "Retrieved",
    "SourceCalibration",
    "SuffixConfig",
    "SuffixHistory",
    "SuffixProposer",
    "SuffixStore",
    "build_suffix",
    "draft_chain",
    "longest_match",
]
