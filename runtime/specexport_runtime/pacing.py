"""The draft-length policy's named constants and its one probe/recheck clock.

Every strategy of the policy (policy.DraftPolicy) reads its constants here and times its probes
with ProbeClock: one sequence's gamma (adaptive.GammaController: probes while speculation is
off), a batch's gamma (batch_gamma.BatchGamma: the guard's rechecks) and the suffix draft
limit (suffix_limit.LimitTuner: replayed probe rounds). A bottom-floor module: it imports
only the runtime's errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidArgument

# --- shared by the strategies --------------------------------------------------------------
PROBE_GAMMA = 2  # draft length of a probe round (one sequence's off-probe; a batch's call-size probe)
FREE = "free"  # the batch's record of free drafts (Proposal.free), apart from their proposers'

# --- one sequence (adaptive.GammaController defaults; GeneratorConfig.controller overrides them)
PROBE_EVERY = 16  # decode steps while speculation is off before the first probe
PROBE_MAX = 256  # cap of the doubling probe interval
CHEAP_PROBE = 1.25  # a probe round costing at most this many decode steps is cheap: it never backs off
PROBE_BUDGET = 0.01  # probes while off lose at most this share of decode time: a probe costing c decode
# steps (its draft rejected: one token, as a plain step) comes at least (c - 1) / PROBE_BUDGET steps after the last
HYSTERESIS = 0.05  # off -> on needs a best expected speedup >= 1 + HYSTERESIS
GAMMA_TOLERANCE = 0.03  # take the longest gamma whose expected speedup is within this of the best

# --- a batch (batch_gamma.BatchGamma; docs/batching.md). The guard checks the batch's model
# against what whole rounds realize, per bucket of batch sizes (1, 2, 3-4, 5-8, ...); a rate is
# tokens per second of steady rounds of one kind, counted once the bucket has GUARD_ROUNDS of
# them; a ProbeClock per bucket counts its judged rounds and times its rechecks:
#   model says 0:
#       drafted rate, the draft's catch-up paid, > plain rate x (1 + MARGIN) -> the gamma last drafted with
#       otherwise                                                           -> 0
#   model says g > 0 (a judged round):
#       a recheck under way               -> its next round: g if it drafts, else 0
#       too few plain rounds to compare:
#           recheck due                   -> 0: a plain recheck of RECHECK_ROUNDS rounds; next in one interval
#           otherwise                     -> g
#       drafted rate < plain rate:
#           not due                       -> 0
#           due, the catch-up spread over the recheck's rounds would sink it -> 0; due again in one interval
#           due                           -> g: a drafting recheck of RECHECK_ROUNDS rounds; the interval
#                                            doubles, up to RECHECK_EVERY x RECHECK_BACKOFF
#       otherwise (drafting holds its own) -> g; the interval back to RECHECK_EVERY, the next
#                                            recheck at most RECHECK_EVERY rounds away
MARGIN = 0.1  # a draft must promise (and, to overrule the model, realize) this much more than plain rounds
GUARD_ROUNDS = 4  # rounds of each kind (drafted, plain) a bucket needs before the guard compares them
RECHECK_EVERY = 64  # judged rounds between the guard's rechecks (doubled after each recheck that confirms)
RECHECK_BACKOFF = 16  # the recheck interval grows to at most RECHECK_EVERY x this
RECHECK_ROUNDS = GUARD_ROUNDS + 1  # a recheck's rounds in a row: the first is a switch, the others are observed
SWITCH_ROUNDS = 32  # most rounds a draft model's catch-up call is spread over (fewer for a sequence near its end)
EVIDENCE_ROUNDS = 8  # drafted rounds (over its sequences) a proposer's acceptance needs before gamma 0 stands
PRIOR_ALPHA = 0.5  # a new sequence's acceptance before any sequence of its proposer drafted
TRUST_SEQUENCES = 2  # the prior's weight, in sequences: a record of n sequences weighs n / (n + this)
SEQUENCES_KEPT = 64  # sequences counted per proposer (past them the record is trusted: 64 / 66)

# --- the suffix draft limit (suffix_limit.LimitTuner)
LIMIT_WARMUP = 16  # the first probes: every round drafts at the largest scale
LIMIT_PROBE_EVERY = 8  # then one round in this many probes
LIMIT_SLOW_PROBES = 4  # ... and one in this many times that while the largest scale's replays are slow
LIMIT_SLOW = 1.05  # slow: its replays cost more than this times the best scale's
LIMIT_HORIZON = 1000.0  # the replay sums halve past this many probes


@dataclass
class ProbeClock:
    """When the next probe (or recheck) is due, counted in decisions.

    Invariants: 1 <= first <= every <= cap; a probe is due once count >= due; `left` > 0 while a
    probe of several rounds is under way (each of its rounds is one decision). After a probe
    that changed nothing the interval doubles (back_off), up to cap; reset() returns it to
    `first`. Aligned schedules (align) put probes on the multiples of their interval."""

    first: int
    cap: int
    count: int = 0  # decisions seen
    every: int = 0  # the interval between probes (0: first)
    due: int = 0  # the decision at which the next probe is due (0: first)
    left: int = 0  # rounds left of a probe under way
    drafting: bool = True  # what the probe under way does (a batch recheck drafts, or not)

    def __post_init__(self) -> None:
        if not 1 <= self.first <= self.cap:
            raise InvalidArgument(f"a probe clock needs 1 <= first <= cap, got first {self.first}, cap {self.cap}")
        self.every = self.every or self.first
        self.due = self.due or self.first

    def tick(self) -> int:
        """One more decision; returns the count."""
        self.count += 1
        return self.count

    @property
    def is_due(self) -> bool:
        return self.count >= self.due

    def wait(self) -> None:
        """The next probe is due one interval from now."""
        self.due = self.count + self.every

    def due_now(self) -> None:
        self.due = self.count

    def due_within(self, decisions: int) -> None:
        """The next probe is due in at most `decisions`."""
        self.due = min(self.due, self.count + decisions)

    def back_off(self) -> None:
        self.every = min(2 * self.every, self.cap)

    def reset(self) -> None:
        self.every = self.first

    def align(self, every: int) -> None:
        """Probes fall on the multiples of `every` (the count's next one is due)."""
        self.every = every
        self.due = -(-self.count // every) * every

    def begin(self, rounds: int, drafting: bool = True) -> None:
        """A probe of `rounds` more decisions after this one starts."""
        self.left, self.drafting = rounds, drafting

    def in_probe(self) -> bool:
        """Whether this decision is a round of a probe under way (then counted off)."""
        if self.left <= 0:
            return False
        self.left -= 1
        return True
