"""The `Model` protocol: one contract graph with its KV cache, as the speculative loop, the
proposers and the API use it, whatever runs it (engine.OrtModel: ONNX Runtime;
trt_backend.TrtModel: native TensorRT). Also the backend-neutral parts both implement it with:
the cache cursor, call statistics, padded calls (feature row_padding) and the head's row inputs.

A model holds `length` valid cache rows (the cursor P) of `max_context`. `forward(ids)` feeds S
tokens at positions P .. P+S-1, advances P by S and returns the logits rows of the last
`last_rows` of them, [last_rows, V] float32, a view the next call overwrites. Rollback is
`truncate(P')` for P' <= P: a cursor move; rows >= P' are never read again, so nothing is copied
or cleared. Feature tensors (feature eagle3_head; docs/graph-contract.md, Draft heads):
    a decoder with spec.feature_width F: after each call `features` is [S, F], the hidden_states
        rows of that call's S real tokens, and `last_start` the position P of its first row;
    an EAGLE-3 head (spec.is_head): forward also takes the rows' `features` [S, F] or the
        head's own earlier `hidden` [S, H] (the other side is fed zeros), and after each call
        `hidden_out` is [last_rows, H], the hidden_out rows of the returned logits rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from .contract import GraphSpec
from .errors import InvalidArgument


@runtime_checkable
class Model(Protocol):
    """A contract graph with its KV cache (module docstring)."""

    spec: GraphSpec
    max_context: int  # positions the cache holds
    max_rows: int  # most logits rows one call returns (a verify call holds max_rows - 1 drafts)
    min_rows: int  # feature row_padding: every call gets >= min_rows rows (plan_rows); 1 = unpadded
    length: int  # the cursor P: valid cache rows
    last_start: int  # position of the last call's first row
    features: np.ndarray | None  # decoders with feature_width: [S, F] of the last call (a view)
    hidden_out: np.ndarray | None  # heads: [last_rows, H] of the last call (a view)
    stats: CallStats

    @property
    def free(self) -> int: ...

    def forward(
        self,
        ids: Sequence[int] | np.ndarray,
        last_rows: int = 1,
        features: np.ndarray | None = None,
        hidden: np.ndarray | None = None,
    ) -> np.ndarray: ...

    def truncate(self, length: int) -> None: ...

    def reset(self) -> None: ...

    def kv_nbytes(self) -> int: ...


@dataclass
class CallStats:
    calls: int = 0
    tokens: int = 0
    seconds: float = 0.0
    by_len: dict[int, list[float]] = field(default_factory=dict)  # S -> [calls, seconds]

    def add(self, s: int, seconds: float) -> None:
        self.calls += 1
        self.tokens += s
        self.seconds += seconds
        entry = self.by_len.setdefault(s, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds


@dataclass(frozen=True)
class CallRows:
    """How S real tokens are fed to a graph that gets at least `min_rows` rows per call
    (feature row_padding): the ids with padding after the real tokens, the logits rows asked for,
    and where the caller's rows lie among them."""

    ids: np.ndarray  # int64 [1, M], M = max(S, min_rows): real tokens, then copies of the last
    first: int  # first logits row asked for (logits_index = first .. first + count - 1)
    count: int  # logits rows asked for: max(last_rows, min(min_rows, M))
    keep: slice  # the caller's last_rows rows within the `count` returned


def plan_rows(ids: np.ndarray, last_rows: int, min_rows: int) -> CallRows:
    """ids int64 [1, S] -> the padded call. With min_rows 1 this is the plain call."""
    S = ids.shape[1]
    M = max(S, min_rows)
    if M > S:  # padding rows sit after the real ones, so causal attention keeps them unseen
        ids = np.concatenate([ids, np.repeat(ids[:, -1:], M - S, axis=1)], axis=1)
    count = max(last_rows, min(min_rows, M))
    first = min(S - last_rows, M - count)  # the window [first, first + count) holds rows S-last_rows .. S-1
    offset = S - last_rows - first
    return CallRows(ids, first, count, slice(offset, offset + last_rows))


def head_rows(name: str, value: np.ndarray | None, S: int, width: int) -> np.ndarray | None:
    """A head's row input (`features` or `draft_hidden`) as float32 [S, width], C-contiguous, or
    None when not given (the caller feeds zeros)."""
    if value is None:
        return None
    value = np.ascontiguousarray(value, np.float32)
    if value.size != S * width:
        raise InvalidArgument(f"{name} must hold {S} rows of {width} (one per token), got shape {list(value.shape)}")
    return value.reshape(S, width)


def move_rows(buffers: Sequence[np.ndarray], time_axis: int, src: Sequence[int], dst: int) -> None:
    """Copy cache rows src[0], src[1], ... of every K/V buffer to rows dst, dst + 1, ... in place
    (the accepted path of a tree call into the contiguous rows after the committed prefix).
    buffers: [1, T, H_kv, D] (time_axis 1) or [1, H_kv, T, D] (time_axis 2); src ascending and
    src[i] >= dst + i, so no row is overwritten before it is read."""
    src = np.asarray(src, dtype=np.int64)  # [n]
    n = src.size
    if n == 0:
        return
    if dst < 0 or np.any(src[1:] <= src[:-1]) or np.any(src < dst + np.arange(n)):
        raise InvalidArgument(f"rows to move must ascend from at least dst + i (dst={dst}), got {src.tolist()}")
    if src[-1] >= buffers[0].shape[time_axis]:
        raise InvalidArgument(f"row {int(src[-1])} is past the cache's {buffers[0].shape[time_axis]} rows")
    if np.array_equal(src, dst + np.arange(n)):
        return  # already in place (a chain: the path is the first n rows)
    for b in buffers:
        view = np.moveaxis(b, time_axis, 0)  # [T, ...] view of the same memory
        view[dst : dst + n] = view[src]  # fancy indexing reads a copy first


class CacheCursor:
    """The KV cache cursor and call checks shared by every backend: `length` valid rows of
    `max_context`, calls of at most `max_rows` logits rows."""

    max_context: int
    max_rows: int
    min_rows: int = 1
    length: int = 0
    last_start: int = 0
    features: np.ndarray | None = None
    hidden_out: np.ndarray | None = None

    @property
    def free(self) -> int:
        return self.max_context - self.length

    def truncate(self, length: int) -> None:
        """Roll back to `length` valid rows (a cursor move; nothing is copied or cleared)."""
        if not 0 <= length <= self.length:
            raise InvalidArgument(f"cannot truncate cache of length {self.length} to {length}")
        self.length = length

    def reset(self) -> None:
        self.length = 0

    def check_call(self, ids, last_rows: int) -> np.ndarray:
        """`ids` as int64 [1, S], checked: S >= 1, 1 <= last_rows <= min(S, max_rows), and the S
        rows fit in the cache after the cursor."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        S = ids.shape[1]
        if S < 1 or not 1 <= last_rows <= min(S, self.max_rows):
            raise InvalidArgument(
                f"forward needs S >= 1 and 1 <= last_rows <= min(S, {self.max_rows}); got S={S}, rows={last_rows}"
            )
        if self.length + S > self.max_context:
            raise InvalidArgument(f"{self.length} cached + {S} new tokens exceed max_context {self.max_context}")
        return ids

    @staticmethod
    def check_min_rows(spec: GraphSpec, min_rows: int, max_rows: int) -> None:
        if not 1 <= min_rows <= max_rows:
            raise InvalidArgument(f"min_rows must be in 1..{max_rows}, got {min_rows!r}")
        if spec.is_head and min_rows != 1:
            raise InvalidArgument("a head graph is never padded (min_rows 1)")
