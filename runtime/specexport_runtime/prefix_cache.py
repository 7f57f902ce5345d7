"""Prefix reuse across requests: a generation starts from the longest cached prefix of its prompt.

A SpecGenerator has one PrefixCache over a PrefixPool (prefix_pool.py). For each generation
(`run`), a Lease decides which models' rows it reuses and keeps:
    target   always (its rows [0, P) are the prefix's K/V)
    draft    a draft model the proposer runs (registry `needs` a decoder), when its rows are
             row-invariant (a bitwise entry) or decoding is greedy (then the draft's rows only
             change which tokens are proposed, never which are emitted)
    features an EAGLE-3 proposer's target features of the cached positions ([1, n, F] rows: the
             head reads them for every position), and with greedy decoding its head's own rows
             (head row t pairs features[t] with token t + 1, so a prefix of m tokens gives m - 1)
Any other proposer that runs a head gets no reuse.

restore (the loop's prefill, after the caches were reset and the proposer started):
    the target gets rows [0, m) with m = min(match, len(prompt) - 1), so the prefill still feeds
    at least the prompt's last token (its logits row picks the first token); the draft gets
    rows [0, min(its match, len(prompt))) and feeds the rest as its usual backlog.
A stored system prompt (system_prompt.py, built into the artifact) is a second source: when a
prompt starts with its ids and the pool holds fewer of a part's rows, the restore streams that
part's rows from the artifact into the model's cache (PrefixCache.offer, StoredPrompt.stream), and
the generation's rows reach the pool when it ends, like any other. Until the target agreed once on
this runtime, its restore stops one stored row short and confirm() compares the row the prefill's
call recomputes; the draft's rows wait for the first token (restore_late).
In a batch (batch.py) the scheduler attaches a lease to each joining sequence's loop on its slots;
its prefill restores likewise, and the scheduler keeps the rows when the sequence leaves its slot.
A slot also keeps them in place while idle (Lease.held), with a copy of row 0, which the idle
slot's throwaway row overwrites: a sequence of the same namespace that joins it (Lease.resident)
takes each part's rows [0, m) from the slot itself (row 0 written back, no other copy) wherever
the slot's match reaches at least as far as the pool's (m capped as above).
keep (the generation finished or was closed): rows [0, min(model.length, len(prompt + output)))
    of each part go to the pool (cache row t is committed token t's K/V, and the emitted output
    is a prefix of the committed tokens). Nothing is kept when any model was called by someone
    else since this generation's last round (its rows are no longer this generation's), and a
    generation that verified draft trees keeps only its prompt's rows (the tree graph's rows equal
    the chain graph's numerically, not bitwise).

Hybrid models (feature recurrent_state): a part's rows alone do not make its state, so the pool
also keeps checkpoints, the recurrent state after a prefix (prefix_pool.py), and a hit resumes at
the longest checkpoint within the match. Checkpoints are the states a cold prompt reaches in the
same calls (recurrent.StateHistory.mark: every MAX_CALL_ROWS rows of a prompt read from position
0 or from a checkpoint), since a scan's chunked form groups its sums by call: a hit then gives
the cold start's bits too. A generation keeps the rows up to its last checkpoint.

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

from .config import GeneratorConfig
from .constants import BITWISE
from .contract import DECODER, DFLASH_BLOCK
from .eagle import EagleProposer
from .hybrid import HybridProposer
from .model import Model
from .prefix_pool import PrefixPool
from .recurrent import MAX_CALL_ROWS, StateHistory
from .system_prompt import StoredPrompt

if TYPE_CHECKING:
    from .generator import SpeculativeLoop

TARGET, DRAFT, HEAD, FEATURES = "target", "draft", "head", "features"  # the pool's parts


def history(model: Model) -> StateHistory | None:
    """A hybrid model's recurrent.StateHistory (an OrtModel's or a batch slot's `states`), else None."""
    states = getattr(model, "states", None)
    return states if isinstance(states, StateHistory) else None


def row_views(model: Model):
    """f(start, stop) -> views of the model's cache rows [start, stop) of every K/V buffer, B = 2 x
    layers arrays [n, H_kv, D]; None for a model whose cache is not in host memory (TensorRT, a
    CUDA provider)."""
    if getattr(model, "device", "cpu") != "cpu":
        return None
    if hasattr(model, "kv_rows"):  # OrtModel
        return model.kv_rows
    if hasattr(model, "slot") and hasattr(model.model, "kv_rows"):  # slots.SlotView
        return lambda a, b: model.model.kv_rows(model.slot, a, b)
    return None


def rows_reader(model: Model):
    """f(start, stop) -> a copy of the model's cache rows [start, stop) as [B, n, H_kv, D] (B = 2 x
    layers), and f(start, rows) that writes them back; None where row_views is. A hybrid's state
    comes with checkpoints (history())."""
    views = row_views(model)
    if views is None:
        return None

    def read(start: int, stop: int) -> np.ndarray:
        return np.stack(views(start, stop))  # [B, n, H_kv, D]

    def write(start: int, rows: np.ndarray) -> None:
        for dst, src in zip(views(start, start + rows.shape[1]), rows):  # dst: [n, H_kv, D]
            dst[...] = src

    return read, write


def eagle_of(proposer) -> EagleProposer | None:
    """The EAGLE-3 proposer a proposer drafts with (itself, or hybrid's draft side), or None."""
    if isinstance(proposer, EagleProposer):
        return proposer
    inner = getattr(proposer, "draft", None) if isinstance(proposer, HybridProposer) else None
    return inner if isinstance(inner, EagleProposer) else None


class Lease:
    """One generation's use of the pool: which parts it restores and keeps (module docstring)."""

    def __init__(
        self,
        cache: PrefixCache,
        loop: SpeculativeLoop,
        namespace: str,
        parts: dict[str, Model],
        eagle: EagleProposer | None = None,
    ):
        """parts: the models whose K/V rows it reuses (target, draft or head); eagle: an EAGLE-3
        proposer whose target features it reuses too (part FEATURES: [1, n, F] rows).
        A solo loop's models are the generator's, which any caller may run: keep() then checks
        that none ran since the generation's last round (`mark`). A batched loop's are its slots,
        which only its scheduler runs, and the scheduler keeps a sequence's rows as it leaves."""
        self.cache, self.loop, self.namespace, self.parts, self.eagle = cache, loop, namespace, parts, eagle
        self.names = (*parts, FEATURES) if eagle is not None else tuple(parts)
        self.histories = {part: h for part, model in parts.items() if (h := history(model)) is not None}
        for h in self.histories.values():
            h.record()
        self.started = False  # restore() ran: the caches hold this generation's rows
        self.guarded = not loop.batched
        self.mark: tuple | None = None  # the models' call counts and cursors after the last round seen
        # (tokens, {part: r}, {part: row 0 [B, 1, H_kv, D]}): the parts' caches hold rows [1, r) of
        # tokens already, and row 0 is the copy (an idle batch slot's; batch.py)
        self.resident: tuple[Sequence[int], dict[str, int], dict[str, np.ndarray]] | None = None
        self.adopted = 0  # target rows restore() took from the slot in place
        self.prompt: list[int] = []
        # (row, its stored rows [B, 1, H_kv, D]): stored target rows restore() took unchecked on this
        # runtime; the prefill's call recomputes that row and confirm() compares
        self.check: tuple[int, np.ndarray | None] | None = None

    def fingerprint(self) -> tuple:
        return tuple((m.stats.calls, m.length) for m in self.parts.values())

    def restore(self, prompt: Sequence[int]) -> int:
        """Rows [0, m) of each part the first token needs (all but the draft's: restore_late) from
        the pool, the stored system prompt, or left in place by an idle slot (`resident`), into
        its cache (cursor after them); returns the target's m, the prompt tokens the prefill skips.
        Stored target rows not yet checked on this machine stop one row short: the prefill's call
        recomputes that row, and confirm() compares it before its logits are used."""
        self.prompt, self.started = list(prompt), True
        skip = self._restore([part for part in self.names if part != DRAFT])
        pool = self.cache.pool
        pool.stats.lookups += 1
        pool.stats.hits += skip > 0
        pool.stats.prompt_tokens += len(prompt)
        pool.stats.cached_tokens += skip
        self.loop.stats.cached_tokens = skip
        return skip

    def restore_late(self) -> None:
        """The draft model's rows, after the first token went out (it is not needed before the
        first round's draft): its longest prefix, as restore() finds it."""
        if DRAFT in self.parts and self.started:
            self._restore([DRAFT])

    def confirm(self) -> bool:
        """After the prefill's call: whether the row it recomputed equals the stored one (True
        when restore() took no unchecked stored rows). False: the stored prompt is refused on this
        runtime (its describe() says why) and the prefill must start again from row 0."""
        if self.check is None:
            return True
        row, want = self.check
        self.check = None
        got = rows_reader(self.parts[TARGET])[0](row, row + 1)  # [B, 1, H_kv, D]
        if self.cache.stored.agree(got, want):
            return True
        skip, pool = self.loop.stats.cached_tokens, self.cache.pool
        pool.stats.hits -= skip > 0
        pool.stats.cached_tokens -= skip
        self.loop.stats.cached_tokens = 0
        if self.eagle is not None:
            self.eagle.known = self.eagle.real = 0
        return False

    def _restore(self, names: Sequence[str]) -> int:
        """restore()'s work for the parts `names`; returns the target's rows (0 without it)."""
        pool, stored, prompt = self.cache.pool, self.cache.stored, self.prompt
        n = len(prompt)
        match = pool.match(self.namespace, prompt, tuple(names))
        offer = self.cache.offer(prompt, names, self.histories)  # rows the stored prompt holds
        have = {part: max(match.rows.get(part, 0), offer.get(part, 0)) for part in names}
        in_place = self._in_place(prompt)
        stops: dict[str, int] = {}
        if TARGET in names:
            # the target keeps the prompt's last token to feed; an EAGLE head needs the features of
            # every restored target row, and its row t pairs features[t] with token t + 1
            skip = min(have[TARGET], n - 1, have.get(FEATURES, n))
            if skip > max(match.rows[TARGET], in_place.get(TARGET, 0)) and not stored.checked:
                skip -= 1  # unchecked stored rows: the prefill's call recomputes the last
                self.check = (skip, None)
            stops[TARGET] = skip
            if FEATURES in names:
                stops[FEATURES] = skip
        if HEAD in names:
            stops[HEAD] = min(have[HEAD], max(0, stops[TARGET] - 1))
        if DRAFT in names:
            stops[DRAFT] = min(have[DRAFT], n)
        points = {}  # a hybrid part resumes at its last checkpoint within its rows (module docstring)
        for part in self.histories:
            if part in names:
                points[part] = {k: st for k, st in match.checkpoints.get(part, ()) if k <= stops[part]}
                stops[part] = max(points[part], default=0)
        restored = 0
        for part in names:
            model, stop = self.parts.get(part), stops[part]
            if part == FEATURES:
                dests = [self.eagle.features[:stop]]  # [stop, F]: the file's [1, r, F]
                if stop > match.rows.get(part, 0):
                    stored.stream(part, stop, dests)
                elif stop > 0:
                    pool.read(match, part, stop, self._write_features)
                self.eagle.known = stop  # features of positions [0, stop)
                continue
            if in_place.get(part, 0) > 0 and in_place[part] >= stop:  # the slot holds as many or more
                stop = in_place[part]  # rows [1, stop) there already
                rows_reader(model)[1](0, self.resident[2][part])  # row 0, which the idle slot overwrote
                if part == TARGET:
                    self.adopted, self.check = stop, None
            elif stop > match.rows.get(part, 0):
                keep = stop if part == TARGET and self.check is not None else None  # the row the call recomputes
                kept = stored.stream(part, stop, row_views(model)(0, stop), keep)
                if keep is not None:
                    self.check = (keep, kept)
            elif stop > 0:
                pool.read(match, part, stop, rows_reader(model)[1])
            model.length = stop  # rows [0, stop) now hold prompt[:stop]'s K/V
            restored = stop if part == TARGET else restored
            if part in self.histories:
                self.histories[part].seed(stop, points[part])
        if HEAD in names:
            self.eagle.real = stops[HEAD]  # head rows computed from features
        return restored

    def _in_place(self, prompt: Sequence[int]) -> dict[str, int]:
        """{part: rows [0, m) of prompt its cache holds already} from `resident`, capped as the
        pool's match is (the target feeds the prompt's last token); {} without a resident or with
        an EAGLE head (its features come from the pool)."""
        if self.resident is None or self.eagle is not None or self.histories:
            return {}
        tokens, rows, _ = self.resident
        n = len(prompt)
        common = int(_common_prefix(np.asarray(tokens[:n], np.int64), np.asarray(prompt[: len(tokens)], np.int64)))
        caps = {TARGET: n - 1, DRAFT: n}
        return {part: min(common, rows[part], caps[part]) for part in self.parts if part in rows and part in caps}

    def held(self, tokens: Sequence[int]) -> dict[str, int]:
        """{part: r}: the rows [0, r) of `tokens` (prompt + output, committed) each part's cache
        holds when the generation ends (what keep() stores); {} when it never started."""
        if not self.started:
            return {}
        limit = len(tokens) if self.loop.stats.tree_rounds == 0 else len(self.prompt)
        return {part: min(model.length, limit) for part, model in self.parts.items()}

    def keep(self, tokens: Sequence[int]) -> None:
        """The generation ended (or was closed) with the committed prefix `tokens` (prompt + output)."""
        if not self.started or (self.guarded and self.mark != self.fingerprint()):
            return  # never started, or another caller used the models since its last round
        limit = len(tokens) if self.loop.stats.tree_rounds == 0 else len(self.prompt)
        held = self.held(tokens)
        sources, checkpoints = {}, {}
        for part, model in self.parts.items():
            read, _ = rows_reader(model)
            if part in self.histories:  # a hybrid part's rows are kept up to its last checkpoint
                checkpoints[part] = {n: st for n, st in self.histories[part].checkpoints.items() if n <= held[part]}
                held[part] = max(checkpoints[part], default=0)
            sources[part] = (held[part], read)
        if self.eagle is not None:
            known = min(self.eagle.known, limit)
            sources[FEATURES] = (known, lambda a, b: self.eagle.features[None, a:b].copy())  # [1, n, F]
            if HEAD in sources:  # rows computed from features, whose token t + 1 is committed
                sources[HEAD] = (min(sources[HEAD][0], self.eagle.real, known, limit - 1), sources[HEAD][1])
        self.cache.pool.insert(self.namespace, tokens, sources, checkpoints)

    def _write_features(self, start: int, rows: np.ndarray) -> None:
        """rows [1, n, F] of the target's features into the EAGLE proposer's positions [start, start + n)."""
        self.eagle.features[start : start + rows.shape[1]] = rows[0]


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int64 vectors."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


class PrefixCache:
    """The generator's pool and what decides, per generation, what it reuses (module docstring).
    max_bytes None: the size of the target's and draft's own caches at max_context (and of the
    target's features there, for an EAGLE-3 head)."""

    def __init__(self, target: Model, draft: Model | None, max_bytes: int | None, draft_class: str | None = None):
        """draft_class: the exactness the draft's manifest entry measured (constants.EXACTNESS, or
        None): a bitwise draft's rows are reused for sampling too."""
        self.target, self.draft, self.draft_bitwise = target, draft, draft_class == BITWISE
        if max_bytes is None:
            max_bytes = target.kv_nbytes() + (draft.kv_nbytes() if draft is not None else 0)
            for model in (target, draft):  # a hybrid's checkpoints: one per MAX_CALL_ROWS rows of a full context
                if model is not None and model.spec.states:
                    max_bytes += model.spec.state_bytes(model.max_context // MAX_CALL_ROWS)
            if draft is not None and draft.spec.is_head:  # and the features an EAGLE-3 head reads: [T, F] fp32
                max_bytes += target.max_context * target.spec.feature_width * 4
        self.pool = PrefixPool(int(max_bytes))
        self.stored: StoredPrompt | None = None  # the artifact's system prompt (system_prompt.py)

    def offer(self, prompt: Sequence[int], parts: Sequence[str], histories) -> dict[str, int]:
        """{part: rows [0, r) of `prompt` the stored system prompt holds} for the `parts` it stores
        (not a hybrid part's, in `histories`: it stores no checkpoints); {} when `prompt` does not
        start with its ids. Rows of other parts than the target's only once the target's were
        checked on this runtime, or along with them (restore() checks them in the same prefill)."""
        stored = self.stored
        if stored is None or not stored.covers(prompt) or (not stored.checked and TARGET not in parts):
            return {}
        n = stored.entry.tokens
        common = n if int(prompt[n - 1]) == int(stored.ids[n - 1]) else n - 1  # covers() matched ids[:n - 1]
        rows = stored.entry.shapes
        return {p: min(rows[p][1], common) for p in parts if p in stored.entry.rows and p not in histories}

    @property
    def enabled(self) -> bool:
        return self.pool.max_bytes > 0 and rows_reader(self.target) is not None

    def parts(self, loop: SpeculativeLoop, config: GeneratorConfig, draft: Model | None) -> dict[str, Model] | None:
        """The models a generation reuses rows of (draft: the draft model its proposer runs); None:
        no reuse."""
        parts: dict[str, Model] = {TARGET: loop.target}
        if loop.spec is not None and loop.spec.uses_draft and draft is not None:
            exact = config.sampling.greedy or self.draft_bitwise  # draft rows only steer proposals when greedy
            if draft.spec.kind == DFLASH_BLOCK:
                return None  # a DFlash drafter reads every prompt position's features, which the pool does not keep
            if draft.spec.is_head:  # its features part comes with the lease (eagle_of)
                if eagle_of(loop.proposer) is None:
                    return None  # a head this module does not know how to restore
                if exact and rows_reader(draft) is not None:
                    parts[HEAD] = draft
            elif draft.spec.kind == DECODER and exact and rows_reader(draft) is not None:
                parts[DRAFT] = draft
        return parts

    def lease(self, loop: SpeculativeLoop, config: GeneratorConfig, draft: Model | None) -> Lease | None:
        """A generation's lease (draft: the draft model its proposer runs, if any), or None: no
        reuse for this call."""
        if not config.cache_prompt or not self.enabled or rows_reader(loop.target) is None:
            return None
        parts = self.parts(loop, config, draft)
        if parts is None:
            return None
        eagle = eagle_of(loop.proposer) if draft is not None and draft.spec.is_head else None
        return Lease(self, loop, config.cache_salt or "", parts, eagle)

    def attach(self, loop: SpeculativeLoop, config: GeneratorConfig, draft: Model | None) -> Lease | None:
        """A batched loop's lease on its slots (draft: its draft model's slot, or None), set as its
        prefix (its prefill restores); the scheduler calls keep() with the sequence's tokens when
        it leaves its slot."""
        loop.prefix = self.lease(loop, config, draft)
        return loop.prefix

    def run(self, loop: SpeculativeLoop, config: GeneratorConfig, prompt: list[int], events: Iterator) -> Iterator:
        """`events` (a generation's (ids, text, reason) per round) with the pool around it: the loop
        restores its prefix at prefill, and the committed tokens are kept when it ends or closes."""
        lease = self.lease(loop, config, self.draft)
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
        out = self.pool.describe()
        if self.stored is not None:
            out["system_prompt"] = self.stored.describe()
        return out
