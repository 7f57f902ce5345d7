"""Proposers behind one small interface: a draft model, n-gram prompt lookup, both, or none.

Cache rule shared by every model in the loop: with `committed` the accepted tokens so far,
a model's cache holds a prefix of committed[:-1]; before a call it feeds committed[cache:]
(normally just the last token, more when it must catch up), and after a round it truncates to
min(cache, len(committed) - 1), which drops exactly the rows of rejected draft tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .engine import OrtModel
from .errors import InvalidArgument
from .ngram import NgramProposer as NgramIndex
from .sampling import SamplingParams, pad_vocab, probabilities, sample


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    q: np.ndarray | None  # [k, V_target] draft distributions; None for greedy or deterministic proposers
    catchup_seconds: float = 0.0  # one-off cost of feeding the draft a backlog (its prefill), not per token
    lookup: bool = False  # a hybrid round served by prompt lookup: no evidence on the draft model's acceptance or cost
    source: str = ""  # what drafted it (stats per source): draft, eagle, lookup, suffix-request, suffix-store


class Proposer(Protocol):
    name: str
    # optional: True when propose() may return free tokens even at gamma 0 (the controller has
    # turned drafting off); the loop then still asks it each step (HybridProposer's lookup)
    proposes_when_off: bool

    def start(self, prompt: Sequence[int]) -> None: ...

    def propose(self, committed: Sequence[int], gamma: int, params: SamplingParams, rng: np.random.Generator) -> Proposal: ...

    def commit(self, committed: Sequence[int], n_new: int) -> None: ...


def sync(model: OrtModel, committed: Sequence[int]) -> None:
    """Drop cache rows that are not committed tokens (the rule in the module docstring)."""
    model.truncate(min(model.length, len(committed) - 1))


class DraftModelProposer:
    """Drafts up to gamma tokens with a draft model; stops early in a round when the draft's top
    probability falls below min_confidence (0 = never), since such tokens are rarely accepted."""

    name = "draft"

    def __init__(self, model: OrtModel, target_rows: int, min_confidence: float = 0.0):
        self.model, self.target_rows, self.min_confidence = model, target_rows, min_confidence

    def start(self, prompt: Sequence[int]) -> None:
        self.model.reset()

    def propose(self, committed, gamma, params, rng) -> Proposal:
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        pending = committed[self.model.length :]  # [last]; [d_k, last] after a full accept; more at the start
        catchup = 0.0
        if len(pending) > 2:  # a backlog (prompt, or tokens of plain steps) is a one-off: timed apart
            start = time.perf_counter()
            self.model.forward(pending[:-1])
            catchup, pending = time.perf_counter() - start, pending[-1:]
        logits = self.model.forward(pending)  # [1, V_draft]: the row that drafts d1
        for i in range(gamma):
            if params.greedy:
                token = int(logits[0].argmax())
                confidence = self._confidence(logits[0]) if self.min_confidence > 0 else 1.0
            else:
                q = probabilities(logits, params)  # [1, V_draft]
                token = sample(q[0], rng)
                qs.append(q[0])
                confidence = float(q[0].max()) if self.min_confidence > 0 else 1.0
            tokens.append(token)
            if i == gamma - 1 or confidence < self.min_confidence:
                break
            logits = self.model.forward([token])
        q = pad_vocab(np.stack(qs), self.target_rows) if qs else None
        return Proposal(tokens, q, catchup, source="draft")

    @staticmethod
    def _confidence(row: np.ndarray) -> float:
        """Top probability of a logits row (softmax max) without materialising the softmax."""
        return float(1.0 / np.exp(row - row.max()).sum())

    def commit(self, committed, n_new) -> None:
        sync(self.model, committed)


class NgramLookupProposer:
    name = "ngram"

    def __init__(self, ngram_sizes: Sequence[int] = (3, 2, 1), max_gamma: int = 8):
        self.index = NgramIndex(tuple(ngram_sizes), max_gamma)

    def start(self, prompt: Sequence[int]) -> None:
        self.index.reset(list(prompt))

    def propose(self, committed, gamma, params, rng) -> Proposal:
        return Proposal(self.index.propose(gamma), None, source="lookup")  # deterministic: q is one-hot

    def commit(self, committed, n_new) -> None:
        self.index.extend(committed[len(committed) - n_new :])


class HybridProposer:
    """Retrieval when it is likely to be accepted, the draft model otherwise. Retrieval is, in
    order: a suffix draft (when a SuffixProposer is given) whose score (its expected accepted
    tokens) reaches suffix.config.hybrid_min_score; prompt lookup when the history's last
    `min_match` or more tokens occurred before. A lookup proposal costs no model call and, on text that copies its
    input, is accepted for long stretches, so it always proposes up to the lookup's own maximum
    (the room left in the context permitting) and is tried even when the gamma controller has
    turned the draft model off (gamma 0); the draft model keeps the rounds where nothing repeats,
    at the controller's gamma. The draft catches up on tokens accepted in lookup rounds in one
    call (timed apart, like its prompt) the next time it drafts. Every proposal is verified as
    usual, so the mix stays exact."""

    name = "hybrid"
    proposes_when_off = True  # the loop asks it even when the controller chose gamma 0

    def __init__(self, draft: DraftModelProposer, lookup: NgramLookupProposer, min_match: int | None = None,
                 suffix=None):
        sizes = lookup.index.ngram_sizes
        self.draft, self.lookup, self.suffix = draft, lookup, suffix  # suffix: suffix.SuffixProposer or None
        self.min_match = max(sizes) if min_match is None else min_match  # default: the longest n-gram size
        if not 1 <= self.min_match <= max(sizes):
            raise InvalidArgument(f"min_match must be in [1, {max(sizes)}] (the n-gram sizes {sizes}), got {self.min_match}")

    def start(self, prompt: Sequence[int]) -> None:
        self.draft.start(prompt)
        self.lookup.start(prompt)
        if self.suffix is not None:
            self.suffix.start(prompt)

    def propose(self, committed, gamma, params, rng) -> Proposal:
        if self.suffix is not None:
            tokens, score, where = self.suffix.retrieve(committed)
            if tokens and score >= self.suffix.config.hybrid_min_score:
                self.suffix.use_last()
                return Proposal(tokens, None, lookup=True, source=f"suffix-{where}")
        room = self.draft.model.max_context - len(committed)  # rows left after feeding `last`
        n, tokens = self.lookup.index.match(max(0, min(self.lookup.index.max_gamma, room)))
        if n >= self.min_match:
            return Proposal(tokens, None, lookup=True, source="lookup")
        if gamma == 0:
            return Proposal([], None)  # the draft model is off: a plain step
        return self.draft.propose(committed, gamma, params, rng)

    def commit(self, committed, n_new) -> None:
        self.draft.commit(committed, n_new)
        self.lookup.commit(committed, n_new)
        if self.suffix is not None:
            self.suffix.commit(committed, n_new)

    def finish(self, output: Sequence[int]) -> None:
        if self.suffix is not None:
            self.suffix.finish(output)


class NoProposer:
    name = "none"

    def start(self, prompt: Sequence[int]) -> None:
        pass

    def propose(self, committed, gamma, params, rng) -> Proposal:
        return Proposal([], None)

    def commit(self, committed, n_new) -> None:
        pass
