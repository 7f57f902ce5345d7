"""What one generation reports: its counters (GenerationStats) and its result (GenerationResult)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix pool (prefill skipped them)
    new_tokens: int = 0
    rounds: int = 0  # speculative rounds (one target verify call each)
    plain_steps: int = 0  # 1-token target steps (speculation off or nothing drafted)
    drafted: int = 0  # by the proposer (forced tokens apart)
    accepted: int = 0
    forced: int = 0  # drafted because a grammar forces them (structured output): free proposals
    forced_accepted: int = 0
    grammar_cut: int = 0  # proposer tokens a grammar forbade, cut before verification
    corrections: int = 0  # rounds ending with a rejected draft token
    bonus: int = 0  # rounds where every draft token was accepted
    # rounds that verified a free draft (Proposal.free: prompt lookup, suffix retrieval, a grammar's
    # forced run), the rest were drafted by a model (the name is the reports' and the JSON's)
    lookup_rounds: int = 0
    tree_rounds: int = 0  # rounds verified as a draft tree in one call (feature tree_verify)
    drafted_at: list[int] = field(default_factory=list)  # per draft position: times drafted
    accepted_at: list[int] = field(default_factory=list)  # per draft position: times accepted
    round_sizes: list[tuple[int, int]] = field(default_factory=list)  # (drafted k, accepted n) per round
    by_source: dict[str, list[int]] = field(default_factory=dict)  # proposal source -> [rounds, drafted, accepted]
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    target_seconds: float = 0.0  # verify and plain steps, prefill excluded
    total_seconds: float = 0.0
    token_times: list[float] = field(default_factory=list)  # seconds since start, per new token

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target call (speculative rounds and plain steps)."""
        calls = self.rounds + self.plain_steps
        return (self.accepted + self.forced_accepted + calls) / calls if calls else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def tokens_per_second(self) -> float:
        decode = self.total_seconds - self.prefill_seconds
        return (self.new_tokens - 1) / decode if decode > 0 and self.new_tokens > 1 else 0.0

    def record_round(self, k: int, n: int, forced: int = 0) -> None:
        """A round verified k drafted tokens, the first `forced` of them forced by a grammar, and
        accepted n; the per-position counts are the proposer's (after the forced run)."""
        self.round_sizes.append((k, n))
        self.rounds += 1
        self.forced += forced
        self.forced_accepted += min(n, forced)
        k, n = k - forced, max(0, n - forced)
        self.drafted += k
        self.accepted += n
        if n < k:
            self.corrections += 1
        else:
            self.bonus += 1
        while len(self.drafted_at) < k:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(k):
            self.drafted_at[i] += 1
            self.accepted_at[i] += int(i < n)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            per_position_acceptance=self.per_position_acceptance,
            tokens_per_second=self.tokens_per_second,
        )
        return data


@dataclass(frozen=True)
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    logprobs: list[dict] | None = None  # per token (sampling.token_logprobs), when the config asked
    tool_calls: tuple = ()  # tools.ToolCall of a chat answer that called tools (SpecGenerator.chat)
