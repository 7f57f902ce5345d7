"""The speculative loop: one target call per round verifies every drafted token.

Invariant between rounds: `committed` holds prompt + accepted tokens; the target cache holds
committed[:-1] (the last token is fed by the next call). A round:
    draft k tokens -> target([last, d1..dk]) returns k+1 logit rows -> accept n of k
    -> emit d1..dn + one token from the target (correction at the first rejection, or the
       bonus token when all k were accepted) -> truncate the caches to len(committed) - 1.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from .config import GeneratorConfig
from .errors import PromptError
from .model import Model
from .penalties import repetition_rows
from .policy import RoundDraft
from .proposers import DraftCall, Proposal, Proposer
from .registry import ProposerSpec
from .sampling import (
    probabilities,
    residual,
    sample,
    token_logprobs,
    verify_deterministic,
    verify_greedy,
    verify_sampled,
)
from .seeded import SeededNoise, tree_picks, verify_seeded
from .stats import GenerationResult, GenerationStats  # noqa: F401 (re-exported: generator.GenerationStats)
from .structured import Guide
from .tokenizer import IncrementalDecoder, TextCodec
from .tree import DraftTree, first_path, verify_tree_greedy, verify_tree_sampled

if TYPE_CHECKING:
    from .tree_model import TreeVerifier

FINISH_REASONS = ("eos", "stop", "length")


@dataclass(frozen=True)
class TargetCall:
    """A batched loop's target call (SpeculativeLoop.call): `ids` fed at its cursor, and the
    logits rows [last_rows, V] of the last of them expected back."""

    ids: list[int]
    last_rows: int = 1


class Generation:
    """One generation as it runs: iterating yields (new token ids, new text, finish reason or
    None) once per speculative round. `stats` fills in round by round (this generation's own,
    shared with nobody); `config` is the call's (its tree_nodes decided), `gamma_policy` how its
    gamma was chosen and `tree_policy` where its tree size came from (config.py "Tree size").
    close() abandons it after the round in progress: a proposer that learns across requests
    then learns nothing from it."""

    def __init__(
        self,
        rounds: Iterator[tuple[list[int], str, str | None]],
        stats: GenerationStats,
        config: GeneratorConfig,
        gamma_policy: str,
        logprobs: list[dict] | None = None,
        tree_policy: str = "chains",
    ):
        self._rounds, self.stats, self.config, self.gamma_policy = rounds, stats, config, gamma_policy
        self.tree_policy = tree_policy  # where config.tree_nodes came from: 'given' | 'calibrated' | 'chains'

        self.logprobs = logprobs  # grows round by round: one entry per emitted token (config.logprobs)

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> tuple[list[int], str, str | None]:
        return next(self._rounds)

    def close(self) -> None:
        self._rounds.close()

    def pieces(self) -> Iterator[str]:
        """The non-empty text pieces of the rounds left (never a split multi-byte character)."""
        try:
            for _, piece, _ in self:
                if piece:
                    yield piece
        finally:
            self.close()

    def collect(self) -> GenerationResult:
        """Run the rounds left and return the whole result."""
        tokens: list[int] = []
        text: list[str] = []
        reason = "length"
        for new, piece, why in self:
            tokens += new
            text.append(piece)
            reason = why or reason
        logprobs = None if self.logprobs is None else self.logprobs[: len(tokens)]
        return GenerationResult(tokens, "".join(text), reason, self.stats, logprobs)


@dataclass(frozen=True)
class LoopSetup:
    """What one generation's SpeculativeLoop is built from.

    spec: the proposer's registry entry, resolved once for the generation (None: a proposer
    that is not registered, e.g. a test's; its drafts are then not free). policy: the round's
    gamma (policy.RoundDraft; default: config.gamma, else plain steps). guide: a grammar
    (structured.py). batched: target calls are yielded as TargetCall for a batch driver
    (batch.py), which assigns each round's gamma through the policy. tree: the target's tree
    graph on its cache, which verifies a proposal that is a tree (Proposal.parents) in one call."""

    target: Model
    proposer: Proposer
    config: GeneratorConfig
    rng: np.random.Generator | SeededNoise
    spec: ProposerSpec | None = None
    policy: RoundDraft | None = None
    stats: GenerationStats = field(default_factory=GenerationStats)
    guide: Guide | None = None
    batched: bool = False
    tree: TreeVerifier | None = None


class SpeculativeLoop:
    """Runs rounds for one generation (built from a LoopSetup); yields each round's new tokens.
    Each round's gamma is the policy's (policy.RoundDraft); every target call after the prefill
    is timed into its cost model. With a grammar (`guide`, structured.py) every target row is
    masked as the grammar stands, drafts start with the tokens it forces and end before the
    first it forbids, and the emitted tokens are committed to it. `logprobs`: the (masked)
    log-probabilities of every emitted token, when config.logprobs asks for them."""

    def __init__(self, setup: LoopSetup):
        if not isinstance(setup, LoopSetup):
            raise TypeError(f"SpeculativeLoop is built from a LoopSetup, got {type(setup).__name__}")
        config = setup.config
        self.target, self.proposer, self.guide, self.spec = setup.target, setup.proposer, setup.guide, setup.spec
        self.policy = setup.policy if setup.policy is not None else RoundDraft.of(config)
        self.config, self.params, self.rng, self.stats = config, config.sampling, setup.rng, setup.stats
        self.batched, self.tree = setup.batched, setup.tree
        self.free = setup.spec is not None and setup.spec.free  # every draft is a function of the committed tokens
        self.seeded = isinstance(setup.rng, SeededNoise)  # seeded.py: every draw a pick at its position
        # free drafts (hybrid's retrieval, suffix, a grammar's forced tokens) are asked for even at gamma 0
        self.ask_when_off = self.policy.speculating and (self.proposer.free_when_off or self.guide is not None)
        self.logprobs: list[dict] | None = [] if config.logprobs is not None else None
        self.prefix = None  # a prefix_cache.Lease: the prefill starts from the prompt's cached rows

    def rows(self, logits: np.ndarray, context: Sequence[int], draft: Sequence[int] = ()) -> np.ndarray:
        """The target's logits rows [R, V] of a call on [last, draft] after `context` (the tokens
        before the first row's draw) as decoding sees them: penalized (penalties.py), masked."""
        if self.config.repetition_penalty != 1.0:
            logits = repetition_rows(logits, context, draft, self.config.repetition_penalty)
        return self.guide.masked(logits, draft) if self.guide is not None else logits

    def pick(self, row: np.ndarray, position: int, cut_q: np.ndarray | None = None) -> int:
        """The token at sequence `position` from a logits row [V]; cut_q: a drawn draft token's
        distribution that a grammar cut, so the token is its correction (sampling.verify_sampled;
        a seeded pick does not depend on drafts)."""
        if self.params.greedy:
            return int(row.argmax())
        p = probabilities(row[None], self.params)[0]
        if self.seeded:
            return self.rng.pick(p, position)
        return sample(p if cut_q is None else residual(p, cut_q), self.rng)

    def emit(self, tokens: list[int], rows: np.ndarray) -> list[int]:
        """tokens: emitted by this call; rows [len(tokens), V]: the logits each was chosen from."""
        if self.guide is not None:
            self.guide.commit(tokens)
        if self.logprobs is not None:
            self.logprobs.extend(token_logprobs(rows, tokens, self.config.logprobs))
        return tokens

    def call(self, ids: Sequence[int], last_rows: int = 1) -> Iterator[TargetCall]:
        """The target's logits rows [last_rows, V] of `ids` fed at its cursor: the call itself
        (solo), or yielded as a TargetCall whose logits the batch driver sends back (batched)."""
        if self.batched:
            return (yield TargetCall(list(ids), last_rows))
        return self.target.forward(ids, last_rows=last_rows)

    def prefill(self, prompt: Sequence[int]) -> Iterator[TargetCall]:
        """-> [first token]."""
        self.target.reset()
        self.proposer.constrain(self.guide.allowed if self.guide is not None else None)
        self.proposer.start(prompt)
        start = time.perf_counter()
        skip = self.prefix.restore(prompt) if self.prefix is not None else 0  # rows [0, skip) restored
        logits = yield from self.call(prompt[skip:])
        if self.prefix is not None and not self.prefix.confirm():  # stored rows this runtime does not reproduce
            self.target.reset()
            self.proposer.start(prompt)
            logits = yield from self.call(prompt)
        logits = self.rows(logits, prompt)
        token = self.pick(logits[0], len(prompt))
        self.stats.prefill_seconds = time.perf_counter() - start
        return self.emit([token], logits)

    def plain_step(self, committed: list[int], cut_q: np.ndarray | None = None) -> Iterator[TargetCall]:
        """-> [next token]."""
        start = time.perf_counter()
        logits = self.rows((yield from self.call(committed[self.target.length :])), committed)
        token = self.pick(logits[0], len(committed), cut_q)
        seconds = time.perf_counter() - start
        self.stats.plain_steps += 1
        self.stats.target_seconds += seconds
        self.policy.timed(1, seconds)  # a batched call's cost is the batch's (batch.py)
        return self.emit([token], logits)

    def draft(self, committed: list[int], gamma: int, room: int) -> Iterator[DraftCall]:
        """-> the round's draft (a Proposal): the proposer's (up to gamma tokens), and with a
        grammar its forced run first; at most what one verify call holds and `room` allows.
        Batched, the proposer's draft-model calls are yielded as DraftCall for the batch driver."""
        limit = min(room, self.target.max_rows - 1)
        forced = self.guide.forced(limit) if self.guide is not None else []
        # in a batch every row costs: a free draft stops at the policy's free cap (a fixed gamma
        # caps it too), and is not asked for at 0
        free = self.policy.free_cap()
        when_off = self.proposer.free_when_off and (not self.batched or free > 0)
        # a proposer that draws from a distribution is not asked when the grammar forces tokens
        ask = (gamma > 0 or when_off) and (not forced or self.params.greedy or self.free)
        proposal = None
        if ask and self.batched:
            proposal = self.as_chain(
                (yield from self.proposer.propose_steps(committed, min(gamma, limit), self.params, self.rng))
            )
            cap = max(gamma, free) if proposal is not None and proposal.free else gamma
            if proposal is not None and len(proposal.tokens) > cap:
                q = proposal.q[:cap] if proposal.q is not None else None
                proposal = replace(proposal, tokens=proposal.tokens[:cap], q=q)
        elif ask:
            proposal = self.as_chain(self.proposer.propose(committed, min(gamma, limit), self.params, self.rng))
        if self.guide is not None:
            return self.guide.shape(proposal, forced, limit)
        proposal = proposal or Proposal([], None)
        parents = None if proposal.parents is None else proposal.parents[:limit]  # a topological prefix is a tree
        return replace(proposal, tokens=proposal.tokens[:limit], parents=parents)

    def as_chain(self, proposal: Proposal | None) -> Proposal | None:
        """A tree proposal as its first path (the first child of each node, with its draft rows q)
        where only chains are verified: no tree graph, in a batch, or under a grammar; anything
        else unchanged."""
        if (
            proposal is None
            or proposal.parents is None
            or (self.tree is not None and not self.batched and self.guide is None)
        ):
            return proposal
        picks = first_path(proposal.parents)
        q = None if proposal.q is None else proposal.q[picks]  # [len(picks), V]: the path's own draft rows
        return replace(proposal, tokens=[proposal.tokens[i] for i in picks], q=q, parents=None)

    def speculative_step(self, committed: list[int], gamma: int, room: int) -> Iterator[TargetCall]:
        """-> the round's new tokens."""
        t0 = time.perf_counter()
        proposal = yield from self.draft(committed, gamma, room)
        draft, k = proposal.tokens, len(proposal.tokens)
        t1 = time.perf_counter()
        self.stats.draft_seconds += t1 - t0
        if k == 0:
            self.stats.grammar_cut += proposal.cut
            return (yield from self.plain_step(committed, proposal.cut_q))
        if proposal.parents is not None and self.tree is not None and self.target.length == len(committed) - 1:
            return self.tree_step(committed, proposal, t0, t1)
        # one target call on [last, d1..dk] -> k+1 rows
        logits = self.rows((yield from self.call(committed[self.target.length :] + draft, k + 1)), committed, draft)
        n, token = self.verify(logits, proposal, len(committed))
        self.target.truncate(len(committed) + n)  # keep [.., last, d1..dn]; drop rejected rows
        self.account(proposal, n, t0, t1, time.perf_counter())
        return self.emit(draft[:n] + [token], logits[: n + 1])

    def tree_step(self, committed: list[int], proposal: Proposal, t0: float, t1: float) -> list[int]:
        """One tree-verify call on [last] + the proposal's tree (feature tree_verify): the accepted
        path's K/V kept in place (keep_path), the rejected rows dropped by the cursor."""
        tree = DraftTree([committed[-1], *proposal.tokens], [-1, *proposal.parents])
        start = self.target.length  # the root's cache row
        logits = self.tree.forward(tree)  # [R, V]
        if self.params.greedy:
            rows, token = verify_tree_greedy(tree, logits.argmax(-1))
        elif self.seeded:  # row r draws position len(committed) + depth(r)
            picks = tree_picks(probabilities(logits, self.params), tree.depths(), self.rng, len(committed))
            rows, token = verify_tree_greedy(tree, picks)
        else:  # suffix trees are deterministic drafts: recursive rejection over siblings
            rows, token = verify_tree_sampled(tree, probabilities(logits, self.params), self.rng)
        self.target.keep_path(start, rows)
        self.stats.tree_rounds += 1
        self.account(proposal, len(rows), t0, t1, time.perf_counter())
        return self.emit([int(t) for t in tree.tokens[rows]] + [int(token)], logits[[0, *rows]])

    def verify(self, logits: np.ndarray, proposal: Proposal, start: int) -> tuple[int, int]:
        """(accepted, next token) of a draft against the target's rows [k+1, V]; row j draws the
        token at sequence position start + j."""
        draft = proposal.tokens
        if self.params.greedy:
            return verify_greedy(logits.argmax(-1), draft)
        p = probabilities(logits, self.params)  # [k+1, V]
        if self.seeded:
            return verify_seeded(p, draft, self.rng, start)
        if proposal.q is None:  # a deterministic draft: compared by index
            return verify_deterministic(p, draft, self.rng, proposal.cut_q)
        return verify_sampled(p, proposal.q[: len(draft)], draft, self.rng, proposal.cut_q)

    def account(self, proposal: Proposal, n: int, t0: float, t1: float, t2: float) -> None:
        """Stats, the verify cost and the policy's evidence of one verified round."""
        k, f = len(proposal.tokens), proposal.forced
        self.stats.target_seconds += t2 - t1
        self.stats.record_round(k, n, f)
        self.stats.lookup_rounds += proposal.free
        self.stats.grammar_cut += proposal.cut
        per = self.stats.by_source.setdefault(proposal.source or self.proposer.name, [0, 0, 0])
        per[0], per[1], per[2] = per[0] + 1, per[1] + k, per[2] + n
        self.policy.timed(k + 1, t2 - t1)
        if self.policy.learns and not proposal.free and k > f:  # a free draft says nothing of a draft model
            if proposal.parents is not None:  # a tree drafts `depth` positions deep (gamma is its depth)
                k = int(DraftTree(np.zeros(k + 1, np.int64), [-1, *proposal.parents]).depths().max())
            self.policy.drafted(k - f, max(0, n - f), t1 - t0 - proposal.catchup_seconds)

    def rounds(self, prompt: Sequence[int], max_context: int) -> Iterator[list[int] | TargetCall | DraftCall]:
        """Each round's new tokens; batched, each target and draft-model call before them as a
        TargetCall or DraftCall."""
        committed = list(prompt) + (yield from self.prefill(prompt))
        self.proposer.commit(committed, 1)
        yield committed[-1:]
        if self.prefix is not None:
            self.prefix.restore_late()  # the draft's cached rows, after the first token went out
        while len(committed) < max_context:  # the last token still needs a cache row
            room = max_context - len(committed)  # rows left after feeding `last`
            gamma = self.policy.gamma()
            if (gamma > 0 or self.ask_when_off) and room > 0:
                new = yield from self.speculative_step(committed, min(gamma, room), room)
            else:
                new = yield from self.plain_step(committed)
            committed += new
            self.proposer.commit(committed, len(new))
            yield new


def first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Start of the stop string that completes first in `text` (ties: the longer one), or None.
    Generation halts when a stop string completes, so this does not depend on how the text was
    split into pieces."""
    ends = [(i + len(s), -len(s), i) for s in stops if (i := text.find(s)) >= 0]
    return min(ends)[2] if ends else None


class StopText:
    """Holds back the last (longest stop - 1) characters so a stop string split over pieces
    is never half-emitted; `push` returns (text safe to emit, whether a stop string hit)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.hold, self.pending = stops, max((len(s) for s in stops), default=1) - 1, ""

    def push(self, piece: str) -> tuple[str, bool]:
        buf = self.pending + piece
        cut = first_stop(buf, self.stops)
        if cut is not None:
            self.pending = ""
            return buf[:cut], True
        cut = max(0, len(buf) - self.hold)
        self.pending = buf[cut:]
        return buf[:cut], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def validate_prompt_ids(ids: Sequence[int], vocab: int, max_context: int) -> list[int]:
    ids = list(ids)
    if not ids:
        raise PromptError("prompt has no tokens (expected at least one)")
    bad = [t for t in ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
    if bad:
        raise PromptError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
    if len(ids) >= max_context:
        raise PromptError(
            f"prompt has {len(ids)} tokens; the artifact's max_context is {max_context}"
            " (need at least one free position)"
        )
    return [int(t) for t in ids]


def run_generation(
    loop: SpeculativeLoop,
    codec: TextCodec,
    prompt_ids: list[int],
    options: GeneratorConfig,
    eos: set[int],
    max_context: int,
) -> Iterator[tuple[list[int], str, str | None] | TargetCall | DraftCall]:
    """Drive the loop and apply the stops (options.stop, options.max_new_tokens); yields (new
    ids, new text, finish reason or None), and a batched loop's TargetCall / DraftCall items, to
    be answered with `send(logits)`."""
    stats = loop.stats
    stats.prompt_tokens = len(prompt_ids)
    decoder, stops = IncrementalDecoder(codec), StopText(options.stop)
    produced = 0
    start = time.perf_counter()
    rounds = loop.rounds(prompt_ids, max_context)
    reply = None
    try:
        while True:
            try:
                new = rounds.send(reply)
            except StopIteration:
                return
            reply = None
            if isinstance(new, (TargetCall, DraftCall)):  # batched: the driver answers with the call's logits
                reply = yield new
                continue
            # a round may emit one token past the context (k drafts + 1); target-only stops at max_context
            new = new[: min(options.max_new_tokens, max_context - len(prompt_ids)) - produced]
            reason = None
            for i, token in enumerate(new):
                if token in eos:
                    new, reason = new[:i], "eos"
                    break
            produced += len(new)
            if reason is None and (produced >= options.max_new_tokens or len(prompt_ids) + produced >= max_context):
                reason = "length"
            piece = decoder.push(new) + (decoder.flush() if reason else "")
            piece, hit = stops.push(piece)
            if hit:
                reason = "stop"
            elif reason:
                piece += stops.flush()
            now = time.perf_counter() - start
            stats.token_times.extend([now] * len(new))
            stats.new_tokens = produced
            stats.total_seconds = now
            yield new, piece, reason
            if reason:
                return
    finally:
        rounds.close()
