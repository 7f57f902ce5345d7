"""Recurrent state of a hybrid decoder (feature recurrent_state; docs/graph-contract.md).

A graph with states takes past_state_{j} [1, *s_j] (the state before its first row) and returns
new_state_{j} [1, Rs, *s_j], the state after each row of state_index. StateHistory keeps, for
one sequence, the state after each of the last `depth` positions in a ring indexed by position:

    ring_j   [depth, *s_j]   ring_j[p % depth] is the state after p tokens when lengths[p % depth] == p
    zeros_j  [1, *s_j]       the state before the first token (P = 0)
    out_j    [1, rows, *s_j] where a call's new_state_{j} lands; stored into the ring after the call

so rolling back to any kept position is choosing which ring entry the next call binds (O(1),
nothing is recomputed or copied back), and forward binds that entry in place as past_state_{j}.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import contract
from .errors import InvalidArgument

# A recurrent model's calls hold at most this many rows (a longer prefill runs as several calls in
# order): a Mamba2 scan's intermediates are [H, S, S], 3.2 GB per layer at S = 4096 for 48 heads
MAX_CALL_ROWS = 256


class StateHistory:
    """The kept recurrent states of one sequence (module docstring)."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtype, depth: int, max_rows: int):
        if depth <= max_rows:
            raise InvalidArgument(f"state depth {depth} must exceed the rows of one call ({max_rows})")
        self.shapes, self.depth, self.max_rows = tuple(tuple(s) for s in shapes), depth, max_rows
        self.ring = [np.full((depth, *s), 0, dtype) for s in self.shapes]
        self.zeros = [np.zeros((1, *s), dtype) for s in self.shapes]
        self.out = [np.full((1, max_rows, *s), 0, dtype) for s in self.shapes]
        self.lengths = np.full(depth, -1, np.int64)  # the position each ring entry holds (-1: none)
        self.index = np.arange(max_rows, dtype=np.int64)  # state_index views

    def kept(self, length: int) -> bool:
        """Whether the state after `length` tokens is held."""
        return length == 0 or (length > 0 and int(self.lengths[length % self.depth]) == length)

    def state(self, length: int) -> list[np.ndarray]:
        """Views [1, *s_j] of the state after `length` tokens (InvalidArgument when not kept)."""
        if not self.kept(length):
            raise InvalidArgument(
                f"the recurrent state after {length} tokens is not kept (the last {self.depth} positions"
                " are): roll back at most that far"
            )
        if length == 0:
            return self.zeros
        slot = length % self.depth
        return [r[slot : slot + 1] for r in self.ring]

    def rows(self, S: int, last_rows: int) -> np.ndarray:
        """state_index of a call of S real rows: every row when they fit the output buffers, else
        the last `last_rows` (a long prefill: only its end is ever rolled back to)."""
        if S <= self.max_rows:
            return self.index[:S]
        return np.arange(S - last_rows, S, dtype=np.int64)

    def bind(self, io, P: int, rows: np.ndarray) -> None:
        """Bind the state after P tokens, state_index `rows` and the output buffers into `io`."""
        io.bind_cpu_input(contract.STATE_INDEX, rows)
        for j, (past, out) in enumerate(zip(self.state(P), self.out)):
            io.bind_input(contract.past_state(j), "cpu", 0, past.dtype, list(past.shape), past.ctypes.data)
            shape = [1, rows.size, *self.shapes[j]]
            io.bind_output(contract.new_state(j), "cpu", 0, out.dtype, shape, out.ctypes.data)

    def store(self, P: int, rows: np.ndarray) -> None:
        """After a call at cursor P: the state after row r (position P + r + 1) for each returned row;
        the states of every other position past P are dropped (they were not this call's)."""
        self.forget_after(P)
        for k, r in enumerate(rows.tolist()):
            length = P + r + 1
            slot = length % self.depth
            for ring, out in zip(self.ring, self.out):
                ring[slot] = out[0, k]
            self.lengths[slot] = length

    def forget_after(self, length: int) -> None:
        """Drop the states of positions past `length` (a rollback: they belong to rejected rows)."""
        self.lengths[self.lengths > length] = -1

    def reset(self) -> None:
        self.lengths[:] = -1

    def nbytes(self) -> int:
        return sum(r.nbytes + z.nbytes + o.nbytes for r, z, o in zip(self.ring, self.zeros, self.out))
