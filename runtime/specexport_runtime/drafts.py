"""What a proposer hands the loop, and the suffix proposer's settings: the bottom of the proposer
layer (numpy and the runtime's errors only), so that the grammar, the suffix index and the config
can name them without importing the proposers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .errors import InvalidArgument


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    q: np.ndarray | None  # [k, V_target] draft distributions; None for greedy or deterministic proposers
    catchup_seconds: float = 0.0  # one-off cost of feeding the draft a backlog (its prefill), not per token
    # a free draft: no model call made it (prompt lookup, suffix retrieval, a grammar's forced run);
    # no evidence on a draft model's acceptance or cost
    free: bool = False
    source: str = ""  # what drafted it (stats per source): draft, eagle, lookup, suffix-request, suffix-store
    forced: int = 0  # the first `forced` tokens are forced by a grammar (structured.Guide), not the proposer's
    cut_q: np.ndarray | None = None  # [V] the distribution of a drawn token a grammar cut after `tokens` (sampling)
    cut: int = 0  # proposer tokens a grammar forbade, dropped from the end of `tokens`
    # a draft tree (feature tree_verify): parents[i] is token i's parent row, 0 the root (the last
    # committed token) and j + 1 token j (so j < i); None: a chain
    parents: tuple[int, ...] | None = None


@dataclass(frozen=True)
class DraftCall:
    """A batched proposer's draft-model call (Proposer.propose_steps): `ids` fed at its draft
    cursor, and the logits rows [last_rows, V_draft] of the last of them expected back."""

    ids: list[int]
    last_rows: int = 1


@dataclass(frozen=True)
class SuffixConfig:
    """SuffixDecoding's knobs (ArcticInference's names and defaults where they exist)."""

    max_depth: int = 24  # longest suffix matched
    max_spec: int = 16  # most tokens per draft (the loop verifies at most OrtModel.max_rows - 1 of them)
    factor: float = 1.0  # draft length limit: floor(factor * match_length + offset)
    offset: float = 0.0
    min_prob: float = 0.1  # stop drafting when the path probability falls below this
    global_tokens: int = 200_000  # budget of the store of past responses (0: no store)
    hybrid_min_score: float = 1.0  # in `hybrid`: a suffix draft is used when its score reaches this
    # the draft limit is scaled per round by one of these, the scale with the best measured
    # throughput winning (LimitTuner); (1.0,): the limit exactly as configured
    limit_scales: tuple[float, ...] = (0.5, 1.0, 2.0)

    def __post_init__(self) -> None:
        for name, lo, hi in (("max_depth", 1, 4096), ("max_spec", 1, 256), ("global_tokens", 0, 1 << 31)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise InvalidArgument(f"suffix {name} must be an integer in {lo}..{hi}, got {value!r}")
        for name, lo, hi in (
            ("factor", 0.0, 64.0),
            ("offset", -64.0, 64.0),
            ("min_prob", 0.0, 1.0),
            ("hybrid_min_score", 0.0, 256.0),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise InvalidArgument(f"suffix {name} must be a number in [{lo}, {hi}], got {value!r}")
        scales = self.limit_scales
        if (
            not isinstance(scales, tuple)
            or not scales
            or len(set(scales)) != len(scales)
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not 0.125 <= x <= 8.0 for x in scales)
        ):
            raise InvalidArgument(
                f"suffix limit_scales must be a tuple of distinct numbers in [0.125, 8], got {scales!r}"
            )

    def limit(self, match_length: int) -> int:
        return max(0, min(self.max_spec, math.floor(self.factor * match_length + self.offset)))

    @classmethod
    def fixed_limit(cls, factor: float | None = None, max_spec: int | None = None) -> SuffixConfig | None:
        """The settings for a draft limit a user gave (--suffix-factor / --suffix-max-spec): the
        defaults with those values, kept as given (no tuning); None when neither was given."""
        given = {k: v for k, v in (("factor", factor), ("max_spec", max_spec)) if v is not None}
        return cls(**given, limit_scales=(1.0,)) if given else None

    def scaled(self, scale: float) -> SuffixConfig:
        """The same settings with the draft limit (factor, offset, max_spec) times `scale`."""
        return replace(
            self,
            factor=min(64.0, self.factor * scale),
            offset=max(-64.0, min(64.0, self.offset * scale)),
            max_spec=max(1, min(256, round(self.max_spec * scale))),
            limit_scales=(1.0,),
        )
