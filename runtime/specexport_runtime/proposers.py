"""The proposer interface (Proposer, Proposal, ProposerContext) and the simple proposers: a draft
model, n-gram prompt lookup, none. The others live in modules of their own (eagle, suffix,
hybrid); registry.py declares them all.

Cache rule shared by every model in the loop: with `committed` the accepted tokens so far,
a model's cache holds a prefix of committed[:-1]; before a call it feeds committed[cache:]
(normally just the last token, more when it must catch up), and after a round it truncates to
min(cache, len(committed) - 1), which drops exactly the rows of rejected draft tokens.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from . import registry
from .constants import DEFAULT_MAX_GAMMA, DEFAULT_NGRAM_SIZES
from .drafts import DraftCall, Proposal  # noqa: F401 (the proposer interface's names, re-exported)
from .errors import InvalidArgument
from .model import Model
from .ngram import NgramProposer as NgramIndex
from .sampling import SamplingParams, pad_vocab, probabilities
from .seeded import draw
from .structured import apply_mask

if TYPE_CHECKING:
    from .config import GeneratorConfig
    from .costs import VerifyCost
    from .datastore import Datastore
    from .eagle_tree import HeadTree
    from .manifest import Manifest
    from .registry import ProposerSpec
    from .services import ProposerServices


Allowed = Callable[[Sequence[int]], np.ndarray]  # draft -> bool [V]: what a grammar allows after it


def run_steps(steps: Iterator[DraftCall]):
    """The value of a propose_steps generator that makes its calls itself (never yields)."""
    try:
        call = next(steps)
    except StopIteration as done:
        return done.value
    raise RuntimeError(f"a solo proposer yielded {call!r}; only a batched one hands its calls out")


class Proposer(ABC):
    """A proposer, as the loop drives it: start(prompt) once, then per round propose(committed,
    gamma) and commit(committed, n_new) with the round's emitted tokens, then finish(output) when
    the request ended normally. `name` is its registry name (registry.py)."""

    name: str = ""
    # True when propose() may return a free draft (Proposal.free) even at gamma 0 (the policy
    # has turned drafting off); the loop then still asks it each step (hybrid's retrieval, suffix)
    free_when_off: bool = False

    @abstractmethod
    def start(self, prompt: Sequence[int]) -> None: ...

    @abstractmethod
    def propose(
        self, committed: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        """Up to gamma draft tokens after `committed` (prompt + accepted tokens)."""

    @abstractmethod
    def commit(self, committed: Sequence[int], n_new: int) -> None:
        """The round emitted committed[-n_new:] (accepted drafts, then the target's token)."""

    def finish(self, output: Sequence[int]) -> None:  # noqa: B027 (an optional hook: nothing by default)
        """The request ended normally with `output` (accepted tokens only); an abandoned one never
        gets here. Proposers that learn across requests override it."""

    def propose_steps(
        self, committed: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator
    ) -> Iterator[DraftCall]:
        """propose() for a batch driver (batch.py): a generator that yields each draft-model call
        as a DraftCall, gets its logits rows back, and returns the Proposal. Proposers without
        a model of their own in a batch make no calls: the default is propose()."""
        return self.propose(committed, gamma, params, rng)
        yield  # a generator function

    def offer(self, committed: Sequence[int]) -> Proposal | None:
        """A free proposal (no model call) good enough to use unasked, or None: what a composing
        proposer (hybrid) tries before its draft model. Retrieval proposers override it."""
        return None

    def constrain(self, allowed: Allowed | None) -> None:  # noqa: B027 (an optional hook: nothing by default)
        """The request's grammar, before start(): allowed(draft) is bool [V], the tokens the
        grammar allows after the committed tokens and `draft`; None: no grammar. A proposer
        that draws from a model (the draft model) masks its own drafting with it; the others
        are cut by the loop."""


@dataclass(frozen=True)
class ProposerContext:
    """What a registered factory builds a proposer from, and nothing else: the models it drafts
    on, the artifact's manifest, the call's GeneratorConfig, the proposer's registry entry
    (resolved once per generation) and the generator's services.ProposerServices."""

    target: Model
    draft: Model | None
    manifest: Manifest
    config: GeneratorConfig
    spec: ProposerSpec
    services: ProposerServices = field(repr=False)
    batched: bool = False  # the loop runs in a batch: model proposers hand their calls out (propose_steps)

    def build(self, name: str) -> Proposer:
        """Another registered proposer, for the same call (composition)."""
        return build_proposer(self, registry.check_available(name, self.manifest.draft_kind))

    def learned(self, name: str) -> Any:
        """The state `name` keeps across the generator's requests (registry.ProposerSpec.learns)."""
        return self.services.learned(name)

    def vocab_map(self) -> np.ndarray:
        """An EAGLE-3 head's draft row -> target id map, int64 [V_draft]."""
        return self.services.vocab_map()

    def verify_cost(self) -> VerifyCost:
        """The target's costs.VerifyCost (the draft-length policy's, timed by the loop)."""
        return self.services.verify_cost

    def datastore(self) -> Datastore | None:
        """The artifact's corpus datastore, or None (none, not declared in the registry entry, or
        config.use_datastore is False)."""
        return self.services.datastore() if self.spec.corpus and self.config.use_datastore else None

    @property
    def head_tree(self) -> HeadTree | None:
        """An EAGLE-3 head's tree graph on the head's cache (feature eagle3_head_tree), or None."""
        return self.services.head_tree


def build_proposer(ctx: ProposerContext, spec: ProposerSpec) -> Proposer:
    """A fresh proposer from its registry entry's factory, for the call `ctx` describes."""
    proposer = registry.resolve(spec.factory)(replace(ctx, spec=spec))
    if not isinstance(proposer, Proposer) or proposer.name != spec.name:
        raise TypeError(
            f"the factory of proposer {spec.name!r} returned {proposer!r}, not a Proposer named {spec.name!r}"
        )
    return proposer


def sync(model: Model, committed: Sequence[int]) -> None:
    """Drop cache rows that are not committed tokens (the rule in the module docstring)."""
    model.truncate(min(model.length, len(committed) - 1))


class DraftModelProposer(Proposer):
    """Drafts up to gamma tokens with a draft model; stops early in a round when the draft's top
    probability falls below min_confidence (0 = never), since such tokens are rarely accepted."""

    name = "draft"

    def __init__(self, model: Model, target_rows: int, min_confidence: float = 0.0, batched: bool = False):
        """batched: in a batch its model is one slot of the draft's batch graph, and
        propose_steps hands each draft call to the batch driver."""
        self.model, self.target_rows, self.min_confidence = model, target_rows, min_confidence
        self.batched = batched
        self.allowed: Allowed | None = None

    def constrain(self, allowed: Allowed | None) -> None:
        self.allowed = allowed

    def start(self, prompt: Sequence[int]) -> None:
        self.model.reset()

    def propose(self, committed, gamma, params, rng) -> Proposal:
        return run_steps(self._drafting(committed, gamma, params, rng, False))

    def propose_steps(self, committed, gamma, params, rng) -> Iterator[DraftCall]:
        return self._drafting(committed, gamma, params, rng, self.batched)

    def _call(self, ids: Sequence[int], batched: bool) -> Iterator[DraftCall]:
        """The draft's logits row of `ids` fed at its cursor: the call itself, or handed out."""
        if batched:
            return (yield DraftCall(list(ids)))
        return self.model.forward(ids)

    def _drafting(self, committed, gamma, params, rng, batched: bool) -> Iterator[DraftCall]:
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        pending = committed[self.model.length :]  # [last]; [d_k, last] after a full accept; more at the start
        catchup = 0.0
        if len(pending) > 2:  # a backlog (prompt, or tokens of plain steps) is a one-off: timed apart
            start = time.perf_counter()
            yield from self._call(pending[:-1], batched)
            catchup, pending = time.perf_counter() - start, pending[-1:]
        logits = yield from self._call(pending, batched)  # [1, V_draft]: the row that drafts d1
        for i in range(gamma):
            if self.allowed is not None:  # under a grammar: draft only what it allows (q is the masked law)
                logits = apply_mask(logits, self.allowed(tokens)[None])
                if not np.isfinite(logits).any():
                    break
            if params.greedy:
                token = int(logits[0].argmax())
                confidence = self._confidence(logits[0]) if self.min_confidence > 0 else 1.0
            else:
                q = probabilities(logits, params)  # [1, V_draft]
                token = draw(q[0], rng, len(committed) + i)  # d_{i+1} sits at position len(committed) + i
                qs.append(q[0])
                confidence = float(q[0].max()) if self.min_confidence > 0 else 1.0
            tokens.append(token)
            if i == gamma - 1 or confidence < self.min_confidence:
                break
            logits = yield from self._call([token], batched)
        q = pad_vocab(np.stack(qs), self.target_rows) if qs else None
        return Proposal(tokens, q, catchup, source="draft")

    @staticmethod
    def _confidence(row: np.ndarray) -> float:
        """Top probability of a logits row (softmax max) without materialising the softmax."""
        return float(1.0 / np.exp(row - row.max()).sum())

    def commit(self, committed, n_new) -> None:
        sync(self.model, committed)


class NgramLookupProposer(Proposer):
    """Prompt lookup. offer(): a match of at least `min_match` tokens (default: the longest
    n-gram size), proposing up to max_gamma tokens whatever the round's gamma, within the rows
    left before max_context (None: unbounded)."""

    name = "ngram"

    def __init__(
        self,
        ngram_sizes: Sequence[int] = DEFAULT_NGRAM_SIZES,
        max_gamma: int = DEFAULT_MAX_GAMMA,
        min_match: int | None = None,
        max_context: int | None = None,
    ):
        self.index = NgramIndex(tuple(ngram_sizes), max_gamma)
        sizes = self.index.ngram_sizes
        self.min_match = max(sizes) if min_match is None else min_match
        if not 1 <= self.min_match <= max(sizes):
            raise InvalidArgument(
                f"min_match must be in [1, {max(sizes)}] (the n-gram sizes {sizes}), got {self.min_match}"
            )
        self.max_context = max_context

    def start(self, prompt: Sequence[int]) -> None:
        self.index.reset(list(prompt))

    def propose(self, committed, gamma, params, rng) -> Proposal:
        return Proposal(self.index.propose(gamma), None, source="lookup")  # deterministic: q None, verified by index

    def offer(self, committed) -> Proposal | None:
        limit = self.index.max_gamma
        if self.max_context is not None:
            limit = max(0, min(limit, self.max_context - len(committed)))  # rows left after feeding `last`
        n, tokens = self.index.match(limit)
        return Proposal(tokens, None, free=True, source="lookup") if n >= self.min_match else None

    def commit(self, committed, n_new) -> None:
        self.index.extend(committed[len(committed) - n_new :])


class NoProposer(Proposer):
    name = "none"

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, committed, gamma, params, rng) -> Proposal:
        return Proposal([], None)

    def commit(self, committed, n_new) -> None:
        pass


# --- factories (registry.py) --------------------------------------------------------------
def build_draft(ctx: ProposerContext) -> DraftModelProposer:
    return DraftModelProposer(ctx.draft, ctx.manifest.target.embedding_rows, ctx.config.min_draft_prob, ctx.batched)


def build_ngram(ctx: ProposerContext) -> NgramLookupProposer:
    return NgramLookupProposer(ctx.config.ngram_sizes, ctx.config.max_gamma, max_context=ctx.manifest.max_context)


def build_none(ctx: ProposerContext) -> NoProposer:
    return NoProposer()
