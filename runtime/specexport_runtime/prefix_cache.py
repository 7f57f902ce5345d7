"""Prefix reuse across requests: a generation starts from the longest cached prefix of its prompt.

A SpecGenerator has one PrefixCache over a PrefixPool (prefix_pool.py). For each generation
(`run`), a Lease decides which models' rows it reuses and keeps:
    target   always (its rows [0, P) are the prefix's K/V)
    draft    a draft model the proposer runs (registry `needs` a decoder), when its rows are
             row-invariant (a bitwise entry) or decoding is greedy (then the draft's rows only
             change which tokens are proposed, never which are emitted)
and none at all when the proposer runs an EAGLE-3 head (it also needs the target's features of
every cached position, which the pool does not hold).

restore (the loop's prefill, after the caches were reset and the proposer started):
    the target gets rows [0, m) with m = min(match, len(prompt) - 1), so the prefill still feeds
    at least the prompt's last token (its logits row picks the first token); the draft gets
    rows [0, min(its match, len(prompt))) and feeds the rest as its usual backlog.
keep (the generation finished or was closed): rows [0, min(model.length, len(prompt + output)))
    of each part go to the pool (cache row t is committed token t's K/V, and the emitted output
    is a prefix of the committed tokens). Nothing is kept when any model was called by someone
    else since this generation's last round (its rows are no longer this generation's), and a
    generation that verified draft trees keeps only its prompt's rows (the tree graph's rows equal
    the chain graph's numerically, not bitwise).

Exactness: for a `bitwise` target a row does not depend on how the tokens were grouped into
calls (measured by benchmarks/experiments/prefix_rows.py: prefill split at any point, or fed
token by token), so a hit gives the same rows, logits and tokens as a cold start, greedy and
seeded sampling alike. For a `numerical` target the rows agree numerically (as speculation and
target-only do).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from . import registry
from .config import GeneratorConfig
from .contract import DECODER
from .model import Model
from .prefix_pool import PrefixPool

if TYPE_CHECKING:
    from .generator import SpeculativeLoop

TARGET, DRAFT = "target", "draft"


def rows_reader(model: Model):
    """f(start, stop) -> a copy of the model's cache rows [start, stop) as [B, n, H_kv, D] (B = 2 x
    layers), and f(start, rows) that writes them back; None for a model whose cache is not in host
    memory (TensorRT, a CUDA provider)."""
    if getattr(model, "device", "cpu") != "cpu":
        return None
    if hasattr(model, "kv_rows"):  # OrtModel
        views = model.kv_rows
    elif hasattr(model, "slot") and hasattr(model.model, "kv_rows"):  # slots.SlotView
        views = lambda a, b: model.model.kv_rows(model.slot, a, b)  # noqa: E731
    else:
        return None

    def read(start: int, stop: int) -> np.ndarray:
        return np.stack(views(start, stop))  # [B, n, H_kv, D]

    def write(start: int, rows: np.ndarray) -> None:
        for dst, src in zip(views(start, start + rows.shape[1]), rows):  # dst: [n, H_kv, D]
            dst[...] = src

    return read, write


class Lease:
    """One generation's use of the pool: which parts it restores and keeps (module docstring)."""

    def __init__(self, cache: PrefixCache, loop: SpeculativeLoop, namespace: str, parts: dict[str, Model]):
        self.cache, self.loop, self.namespace, self.parts = cache, loop, namespace, parts
        self.prompt_len = 0
        self.mark: tuple | None = None  # the models' call counts and cursors after the last round seen

    def fingerprint(self) -> tuple:
        return tuple((m.stats.calls, m.length) for m in self.parts.values())

    def restore(self, prompt: Sequence[int]) -> int:
        """Rows [0, m) of each part from the pool into its cache (cursor after them); returns the
        target's m, the prompt tokens the prefill skips."""
        pool = self.cache.pool
        self.prompt_len = len(prompt)
        match = pool.match(self.namespace, prompt, tuple(self.parts))
        skip = 0
        for part, model in self.parts.items():
            limit = len(prompt) - 1 if part == TARGET else len(prompt)
            stop = min(match.rows[part], limit)
            if stop > 0:
                _, write = rows_reader(model)
                pool.read(match, part, stop, write)
                model.length = stop  # rows [0, stop) now hold prompt[:stop]'s K/V
            if part == TARGET:
                skip = stop
        pool.stats.lookups += 1
        pool.stats.hits += skip > 0
        pool.stats.prompt_tokens += len(prompt)
        pool.stats.cached_tokens += skip
        self.loop.stats.cached_tokens = skip
        return skip

    def keep(self, tokens: Sequence[int]) -> None:
        """The generation ended (or was closed) with the committed prefix `tokens` (prompt + output)."""
        if self.mark is None or self.mark != self.fingerprint():
            return  # never ran a round, or another caller used the models since its last one
        limit = len(tokens) if self.loop.stats.tree_rounds == 0 else self.prompt_len
        sources = {}
        for part, model in self.parts.items():
            read, _ = rows_reader(model)
            sources[part] = (min(model.length, limit), read)
        self.cache.pool.insert(self.namespace, tokens, sources)


class PrefixCache:
    """The generator's pool and what decides, per generation, what it reuses (module docstring).
    max_bytes None: the size of the target's and draft's own caches at max_context."""

    def __init__(self, target: Model, draft: Model | None, max_bytes: int | None, draft_bitwise: bool = False):
        """draft_bitwise: the draft's manifest entry measured its rows bitwise (exactness)."""
        self.target, self.draft, self.draft_bitwise = target, draft, draft_bitwise
        if max_bytes is None:
            max_bytes = target.kv_nbytes() + (draft.kv_nbytes() if draft is not None else 0)
        self.pool = PrefixPool(int(max_bytes))

    @property
    def enabled(self) -> bool:
        return self.pool.max_bytes > 0 and rows_reader(self.target) is not None

    def parts(self, loop: SpeculativeLoop, config: GeneratorConfig) -> dict[str, Model] | None:
        """The models a generation reuses rows of; None: no reuse."""
        parts: dict[str, Model] = {TARGET: loop.target}
        name = loop.proposer.name
        if config.speculating and registry.get(name).uses_draft and self.draft is not None:
            if self.draft.spec.kind != DECODER or self.draft.spec.is_head:
                return None  # an EAGLE-3 head needs the target's features of the cached positions
            if (config.sampling.greedy or self.draft_bitwise) and rows_reader(self.draft) is not None:
                parts[DRAFT] = self.draft
        return parts

    def lease(self, loop: SpeculativeLoop, config: GeneratorConfig) -> Lease | None:
        if not config.cache_prompt or not self.enabled or loop.batched:
            return None
        parts = self.parts(loop, config)
        return None if parts is None else Lease(self, loop, config.cache_salt or "", parts)

    def run(self, loop: SpeculativeLoop, config: GeneratorConfig, prompt: list[int], events: Iterator) -> Iterator:
        """`events` (a generation's (ids, text, reason) per round) with the pool around it: the loop
        restores its prefix at prefill, and the committed tokens are kept when it ends or closes."""
        lease = self.lease(loop, config)
        if lease is None:
            return events
        loop.prefix = lease
        return self._keeping(lease, prompt, events)

    @staticmethod
    def _keeping(lease: Lease, prompt: list[int], events: Iterator) -> Iterator:
        output: list[int] = []
        try:
            for event in events:
                output += event[0]
                lease.mark = lease.fingerprint()
                yield event
        except GeneratorExit:  # closed after a round: its caches still hold committed rows
            events.close()
            lease.keep(prompt + output)
            raise
        lease.keep(prompt + output)

    def describe(self) -> dict:
        return self.pool.describe()
