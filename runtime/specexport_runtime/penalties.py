"""Repetition penalty as a transform of the target's logits rows, applied before verification.

With penalty r > 0 (1 = off), a token x already in the row's context has its logit l replaced by
l / r when l > 0 and l * r otherwise (r > 1 discourages repeats; the rule of transformers' and
vLLM's `repetition_penalty`). The context of a row is the whole sequence before the token it
draws: prompt + committed tokens, and for row j of a verify call on [last, d1..dk] also the
drafted d1..dj. Verification then compares drafts with these penalized rows, so speculative
output is exactly target-only output under the same penalty (greedy: the same tokens; sampled:
the same law). The draft's rows are not penalized: a draft's q is whatever law it drew from.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import numpy as np

from .errors import InvalidArgument

MAX_PENALTY = 10.0


def check_penalty(value) -> float:
    """repetition_penalty in (0, MAX_PENALTY] (1 = off), else InvalidArgument naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise InvalidArgument(f"repetition_penalty must be a number in (0, {MAX_PENALTY:g}] (1 = off), got {value!r}")
    if not 0 < value <= MAX_PENALTY:
        raise InvalidArgument(f"repetition_penalty must be a number in (0, {MAX_PENALTY:g}] (1 = off), got {value!r}")
    return float(value)


def _penalize(values: np.ndarray, penalty: float) -> np.ndarray:
    return np.where(values > 0, values / penalty, values * penalty)


def repetition_rows(logits: np.ndarray, context: Sequence[int], draft: Sequence[int], penalty: float) -> np.ndarray:
    """logits [R, V] of a call whose row 0 follows `context` and row j > 0 follows context +
    draft[:j] (R <= len(draft) + 1) -> a penalized copy [R, V] float32 (the input is untouched)."""
    out = np.array(logits, dtype=np.float32, copy=True)  # [R, V]
    if penalty == 1.0:
        return out
    ids = np.unique(np.asarray(context, dtype=np.int64))  # [n] tokens every row has seen
    out[:, ids] = _penalize(out[:, ids], penalty)
    seen = set(ids.tolist())
    for j, token in enumerate(draft[: out.shape[0] - 1]):  # rows j+1.. have seen draft[j]
        if int(token) not in seen:
            seen.add(int(token))
            out[j + 1 :, token] = _penalize(out[j + 1 :, token], penalty)
    return out
