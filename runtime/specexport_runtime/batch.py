"""Continuous batching: several generations share the target's calls (a slots graph, feature cache_slots).

Each sequence runs its own speculative loop (generator.SpeculativeLoop, batched) on one cache
slot: its own proposer, grammar, seed stream and stats. Its loop yields a TargetCall where a solo
loop would call the target; one scheduler round gathers the pending call of every running
sequence into one SlotModel.forward, then sends each its logits rows and lets it emit, verify
and draft up to its next call. So a sequence's tokens are those of its solo run whatever shares
its calls (for greedy decoding; bit for bit where the batch graph's rows are, docs/batching.md).

Round boundaries are where the batch changes: waiting requests join free slots, finished and
cancelled ones leave at once. A joining prompt is fed in chunks of at most `prefill_chunk`
rows per round (all joining prompts together), so the decoding slots' round grows by at most
that many rows while a long prompt is read (the prefill stall bound).

A sequence that leaves keeps its committed rows in its slot while the slot is idle (`resident`:
slot -> namespace, tokens, rows per part, and a copy of each part's row 0). The idle slot's
cursor is 0, so its throwaway row (slots.py) costs no attention over them, and it overwrites row 0
only. A joining sequence takes the free slot holding the longest prefix of its prompt in its
namespace, and its prefill restores those rows in place: row 0 written back, the rest left where
they are (prefix_cache.Lease.resident; no copy through the prefix pool). Otherwise it takes a free
slot holding nothing, or the one idle longest.

A draft model runs batched too when the artifact has its batch graph: every sequence drafting
with it in a round hands its draft calls out (Proposer.propose_steps), and the scheduler runs
them one batched draft call per draft step before the round's target call. Without a draft
batch graph (or with an EAGLE-3 head) a sequence asking for a draft-model proposer drafts with
prompt lookup ("ngram") instead; `BatchSequence.proposer` records what it ran. The draft length
of each round is the batch's (the draft-length policy's batch strategy, batch_gamma.BatchGamma):
the target's call cost over rows and running sequences and the draft step's cost, against each
sequence's acceptance, checked against what whole rounds realize; free drafts have a limit of
their own (BatchGamma.free_limit), so they go on where the model drafts stop. Each sequence's
loop gets both through its policy.RoundDraft (assign).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from . import registry
from .batch_gamma import BatchGamma
from .config import GeneratorConfig
from .costs import ema
from .errors import InvalidArgument
from .generator import GenerationResult, GenerationStats, TargetCall, run_generation
from .pacing import FREE
from .prefix_cache import TARGET, rows_reader
from .proposers import DraftCall
from .recurrent import solo_piece
from .registry import ProposerSpec
from .slots import SlotCall, SlotModel

BATCH_FALLBACK = "ngram"  # what a sequence asking for a draft-model proposer drafts with in a batch
DEFAULT_PREFILL_CHUNK = 64
PRIOR_ROUNDS = 4  # a sequence's (alpha, p) start from its proposer's record, worth this many rounds


@dataclass(frozen=True)
class BatchEvent:
    """What the scheduler did at a round boundary (its own record, for tests and metrics)."""

    round: int
    kind: str  # join | leave | cancel
    sequence: int
    slot: int


@dataclass
class BatchSequence:
    """One request in the batch: its generation as it runs, and its result when done."""

    id: int
    prompt_ids: list[int]
    config: GeneratorConfig
    proposer: str  # what it drafts with (BATCH_FALLBACK for a draft-model proposer without a draft batch graph)
    spec: ProposerSpec | None = None  # that proposer's registry entry, resolved once at submit
    drafts_with_model: bool = False  # its proposer calls the draft's batch graph
    draft_unread: int = 0  # tokens its draft model has not read yet (prompt, plain rounds), at the round's end
    tokens_left: int = 0  # the most tokens it may still emit (max_new_tokens less its tokens), at the round's end
    slot: int | None = None
    tokens: list[int] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    finish_reason: str | None = None  # generator.FINISH_REASONS, or cancelled
    stats: GenerationStats | None = None
    queued_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    _events: Iterator | None = field(default=None, repr=False)
    _loop: object = field(default=None, repr=False)
    _pending: TargetCall | DraftCall | None = field(default=None, repr=False)
    _fed: int = 0  # rows of the pending call already fed (a prompt read in chunks)
    _alpha: float = 0.5  # acceptance of its drafts (EMA)
    _proposed: float = 1.0  # drafted tokens / the round's gamma (EMA): how often its proposer finds a draft
    _rounds: int = 0  # rounds asked to draft (gamma > 0)
    _drafted_rounds: int = 0  # rounds in which it drafted

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def result(self) -> GenerationResult:
        if not self.done:
            raise InvalidArgument(f"sequence {self.id} has not finished")
        logprobs = getattr(self._loop, "logprobs", None)
        return GenerationResult(
            self.tokens,
            self.text,
            self.finish_reason,
            self.stats,
            None if logprobs is None else logprobs[: len(self.tokens)],
        )


class BatchScheduler:
    """Runs up to `slots.slots` generations at once on a SlotModel (module docstring).

    submit() queues a request; step() runs one round (joins, one target call, emits, leaves);
    run() steps until nothing is left. `events` is the scheduler's own record of joins,
    leaves and cancellations by round."""

    def __init__(
        self,
        gen,
        slots: SlotModel,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        max_running: int | None = None,
        gamma: BatchGamma | None = None,
        draft: SlotModel | None = None,
    ):
        """prefill_chunk: most prompt rows all joining sequences together add to a round while
        others decode; max_running: most sequences at once (default: every slot); gamma: the
        draft-length policy with what it has learned (default: a fresh one); draft: the draft
        model's batch graph (same slots), or None (draft-model proposers fall back to lookup)."""
        if prefill_chunk < slots.max_rows:
            raise InvalidArgument(f"prefill_chunk must be >= max_rows {slots.max_rows}, got {prefill_chunk}")
        self.max_running = slots.slots if max_running is None else max_running
        if not 1 <= self.max_running <= slots.slots:
            raise InvalidArgument(f"max_running must be in 1..{slots.slots}, got {max_running!r}")
        self.gen, self.model, self.prefill_chunk = gen, slots, prefill_chunk
        if draft is not None and draft.slots < slots.slots:
            raise InvalidArgument(
                f"the draft batch graph has {draft.slots} slots, fewer than the target's {slots.slots}"
            )
        self.draft = draft
        self.gamma = gamma or BatchGamma(min(gen.config.max_gamma, slots.max_rows - 1))
        self.waiting: deque[BatchSequence] = deque()
        self.running: dict[int, BatchSequence] = {}  # slot -> sequence
        # slot -> (namespace, tokens, {part: rows [0, r) of tokens in its caches}, {part: row 0 [B, 1, H_kv, D]})
        self.resident: dict[int, tuple[str, list[int], dict[str, int], dict[str, np.ndarray]]] = {}
        self.events: list[BatchEvent] = []
        self.round = 0
        self.batch_sizes: dict[int, int] = {}  # running sequences -> rounds
        self.stall_rows = 0  # most prompt rows one round carried while other sequences decoded
        self.round_log: list[tuple[int, int, float]] = []  # per round: (running, prefill rows, call seconds)
        self._ids = itertools.count()
        self._emitted = 0  # tokens emitted by every sequence so far (BatchGamma.observe)
        self._drafted_last = False  # the last round's target call carried draft rows
        self._gamma = 0  # the batch's gamma for the next round's drafts

    # --- requests -------------------------------------------------------------------
    def submit(self, prompt, config: GeneratorConfig | None = None, **overrides) -> BatchSequence:
        """Queue a prompt (text, bytes or token ids); checked now, run by later rounds."""
        ids = self.gen._prompt_ids(prompt)
        config, spec = self.gen.configured(config, **overrides)
        model = spec.uses_draft and self.draft is not None  # a batch graph is always a decoder's
        if spec.uses_draft and not model:
            spec = registry.get(BATCH_FALLBACK)
        config = replace(config, proposer=spec.name) if spec.speculative else config
        seq = BatchSequence(next(self._ids), ids, config, spec.name, spec, drafts_with_model=model)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: BatchSequence) -> None:
        """Stop `seq` at the next round boundary (at once if it is still waiting)."""
        if seq.done:
            return
        if seq.slot is None:
            self.waiting.remove(seq)
            seq.finish_reason = "cancelled"
            return
        self._leave(seq, "cancel")

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # --- rounds ---------------------------------------------------------------------
    def run(self) -> None:
        while not self.idle:
            self.step()

    def step(self) -> list[BatchSequence]:
        """One round; returns the sequences that emitted tokens or finished in it."""
        round_start, emitted, joined = time.perf_counter(), self._emitted, len(self.events)
        self._admit()
        self._draft_phase()
        if not self.running:
            return []
        calls, prefill_rows = [], 0
        max_rows = self.model.max_rows
        decoding = any(len(s._pending.ids) - s._fed <= max_rows for s in self.running.values())
        budget = self.prefill_chunk if decoding else math.inf  # the stall bound protects decoding slots only
        for slot, seq in self.running.items():
            call = seq._pending
            left = len(call.ids) - seq._fed
            if left <= max_rows:  # a decode or verify call (or a prompt's last rows): always whole
                calls.append(SlotCall(slot, call.ids[seq._fed :], call.last_rows))
                continue
            if self.model.states is not None:  # a recurrent target reads a prompt in the calls a solo run makes
                n = solo_piece(len(call.ids), seq._fed, call.last_rows)
                if n > budget and budget < self.prefill_chunk:
                    continue  # another prompt took part of this round's budget: it waits whole
            else:
                n = int(min(left, budget))  # a prompt read in chunks: this round's share of the budget
            if n <= 0:
                continue  # no prefill budget left this round: it waits (its slot gets a throwaway row)
            budget -= n
            prefill_rows += n
            calls.append(SlotCall(slot, call.ids[seq._fed : seq._fed + n], call.last_rows if n == left else 1))
        if decoding:  # prompt rows that held up decoding sequences this round
            self.stall_rows = max(self.stall_rows, prefill_rows)
        running = len(self.running)
        prompting = any(s.first_token_at is None for s in self.running.values())  # a prompt is being read
        self.batch_sizes[running] = self.batch_sizes.get(running, 0) + 1
        start = time.perf_counter()
        outputs = self.model.forward(calls)
        seconds = time.perf_counter() - start
        rows = sum(len(c.ids) for c in calls)
        if all(len(c.ids) <= max_rows for c in calls):  # the line prices decode and verify rows, not prompt chunks
            self.gamma.record(running, rows, seconds)
        self.round_log.append((running, prefill_rows, seconds))
        if self.draft is not None:
            for slot, seq in self.running.items():
                if seq.drafts_with_model:  # its committed tokens, this round's not counted
                    seq.draft_unread = len(seq.prompt_ids) + len(seq.tokens) - self.draft.view(slot).length
                    seq.tokens_left = seq.config.max_new_tokens - len(seq.tokens)
        round_gamma, gamma = self._gamma, self.gamma.choose(list(self.running.values()))  # this round's, the next's
        self._gamma, free = gamma, self.gamma.free_limit(len(self.running))
        touched = []
        for call, logits in zip(calls, outputs):
            seq = self.running[call.slot]
            seq._fed += len(call.ids)
            if seq._fed < len(seq._pending.ids):
                continue  # a prompt chunk: its logits are not asked for
            self._answer(seq, logits, seq._loop.policy.assign(gamma, free))
            touched.append(seq)
        drafted = bool(round_gamma) and rows > running  # the batch drafted (free retrieval rows come at gamma 0 too)
        steady, self._drafted_last = drafted == self._drafted_last, drafted
        if steady and not prompting and len(self.events) == joined and len(calls) == running == len(self.running):
            # the same sequences all round, decoding or verifying only, as in the round before
            seconds = time.perf_counter() - round_start
            self.gamma.observe(running, drafted, self._emitted - emitted, seconds, round_gamma)
        self.round += 1
        return touched

    def _draft_phase(self) -> None:
        """One batched draft call per draft step of every sequence drafting with the model, until
        each has its target call pending."""
        while True:
            drafting = [(slot, s) for slot, s in self.running.items() if isinstance(s._pending, DraftCall)]
            if not drafting:
                return
            calls = [SlotCall(slot, s._pending.ids, s._pending.last_rows) for slot, s in drafting]
            start = time.perf_counter()
            outputs = self.draft.forward(calls)
            self.gamma.record_draft(len(calls), sum(len(c.ids) for c in calls), time.perf_counter() - start)
            for (_, seq), logits in zip(drafting, outputs):
                try:
                    item = seq._events.send(logits)
                except StopIteration:
                    item = None
                self._advance(seq, item)

    def _slot_for(self, seq: BatchSequence, free: list[int]) -> int:
        """The free slot whose resident rows share the longest prefix with seq's prompt in its
        namespace; else one holding nothing; else the one idle longest (its rows are dropped)."""
        namespace = seq.config.cache_salt or ""
        best, shared = None, 0
        for b in free if seq.config.cache_prompt else ():
            held = self.resident.get(b)
            if held is not None and held[0] == namespace:
                n = _shared(held[1], seq.prompt_ids)
                if n > shared:
                    best, shared = b, n
        if best is not None:
            return best
        empty = [b for b in free if b not in self.resident]
        return empty[0] if empty else next(b for b in self.resident if b in free)  # dict order: left first

    def _admit(self) -> None:
        free = [b for b in range(self.model.slots) if b not in self.running]
        while free and self.waiting and len(self.running) < self.max_running:
            seq = self.waiting.popleft()
            slot = self._slot_for(seq, free)
            free.remove(slot)
            resident = self.resident.pop(slot, None)
            view = self.model.view(slot)
            view.reset()  # a cursor move: the rows stay, for the restore to take in place
            draft = self.draft.view(slot) if self.draft is not None else None
            if draft is not None:
                draft.reset()
            loop = self.gen.make_loop(seq.config, seq.spec, target=view, batched=True, draft=draft)
            lease = self.gen.prefix_cache.attach(loop, seq.config, draft)  # its prefill starts from a cached prefix
            if lease is not None and resident is not None and resident[0] == lease.namespace:
                lease.resident = resident[1:]
            seq.slot, seq._loop, seq.stats = slot, loop, loop.stats
            seq._alpha, seq._proposed = self.gamma.prior(seq.proposer)
            seq._events = run_generation(
                loop, self.gen.codec, seq.prompt_ids, seq.config, self.gen.eos, self.gen.manifest.max_context
            )
            self.running[slot] = seq
            self.events.append(BatchEvent(self.round, "join", seq.id, slot))
            self._advance(seq, next(seq._events))

    def _answer(self, seq: BatchSequence, logits: np.ndarray, used: int | None) -> None:
        """Send the call's logits (a round drafted with gamma `used`); collect what the sequence
        emits up to its next call."""
        before = (seq.stats.drafted, seq.stats.accepted, seq.stats.lookup_rounds)
        try:
            item = seq._events.send(logits)
        except StopIteration:
            item = None
        self._learn(seq, before, used)
        self._advance(seq, item)

    def _advance(self, seq: BatchSequence, item) -> None:
        while item is not None and not isinstance(item, (TargetCall, DraftCall)):
            new, piece, reason = item
            if new and seq.first_token_at is None:
                seq.first_token_at = time.perf_counter()
            seq.tokens += new
            self._emitted += len(new)
            if piece:
                seq.pieces.append(piece)
            if reason:
                seq.finish_reason = reason
                seq._loop.proposer.finish(seq.tokens)
                self._leave(seq, "leave")
                return
            try:
                item = next(seq._events)
            except StopIteration:
                item = None
        if item is None:  # ended without a reason (cannot happen: run_generation always gives one)
            seq.finish_reason = seq.finish_reason or "length"
            self._leave(seq, "leave")
            return
        seq._pending, seq._fed = item, 0

    def _learn(self, seq: BatchSequence, before: tuple[int, int, int], gamma: int | None) -> None:
        d, a = seq.stats.drafted - before[0], seq.stats.accepted - before[1]
        if seq.stats.lookup_rounds > before[2]:  # a free draft: its own record (BatchGamma.free_limit)
            if d:  # a grammar may cut a free draft to nothing: no evidence then
                self.gamma.learn(FREE, a / d, None, seq.id)
            return
        if gamma:  # how often its proposer drafts when the batch asks for gamma tokens
            seq._rounds += 1
            seq._proposed = ema(seq._proposed, min(1.0, d / gamma), seq._rounds + PRIOR_ROUNDS, 0.2)
        if d:
            seq._drafted_rounds += 1
            seq._alpha = ema(seq._alpha, a / d, seq._drafted_rounds + PRIOR_ROUNDS, 0.2)
        if gamma or d:  # the round's own figures: a sequence's EMAs lean on the record they started from
            self.gamma.learn(seq.proposer, a / d if d else None, min(1.0, d / gamma) if gamma else None, seq.id)

    def _leave(self, seq: BatchSequence, kind: str) -> None:
        if seq.slot is None:
            return
        if seq._events is not None:
            seq._events.close()
        if kind == "cancel":
            seq.finish_reason = "cancelled"
        lease = getattr(seq._loop, "prefix", None)
        if lease is not None:  # its slots' committed rows go to the prefix pool, and stay in the slots
            tokens = seq.prompt_ids + seq.tokens
            lease.keep(tokens)
            held = {part: rows for part, rows in lease.held(tokens).items() if rows > 0}
            if TARGET in held and lease.eagle is None:
                first = {part: rows_reader(lease.parts[part])[0](0, 1) for part in held}
                self.resident[seq.slot] = (lease.namespace, tokens, held, first)
        self.model.view(seq.slot).reset()  # an empty slot's throwaway attention row reads no past
        if self.draft is not None:
            self.draft.view(seq.slot).reset()
        self.running.pop(seq.slot, None)
        self.events.append(BatchEvent(self.round, kind, seq.id, seq.slot))
        seq.slot = None


def _shared(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
