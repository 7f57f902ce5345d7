"""Recurrent state of a hybrid decoder (feature recurrent_state; docs/graph-contract.md).

A graph with states takes past_state_{j} [1, *s_j] (the state before its first row) and returns
new_state_{j} [1, Rs, *s_j], the state after each row of state_index. StateHistory keeps, for
one sequence, the state after each of the last `depth` positions in slots of one buffer per site:

    ring_j   [depth + max_rows, *s_j]   slot_of[p] holds the state after p tokens
    zeros_j  [1, *s_j]                  the state before the first token (P = 0)

A call's new_state_{j} is bound straight into consecutive slots for its rows (from (P + r0 + 1) %
depth, or beside the call's input state's slot when that block would hold it), so nothing is
copied after the call and the input state never shares a slot with the outputs. Rolling back to a
kept position is choosing which slot the next call binds as past_state_{j}: O(1).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from . import contract
from .errors import InvalidArgument

# A recurrent model's calls hold at most this many rows (a longer prefill runs as several calls in
# order): a Mamba2 scan's intermediates are [H, S, S], 3.2 GB per layer at S = 4096 for 48 heads
MAX_CALL_ROWS = 256
# Calls of at most this many rows (every decode and verify call: engine.OrtModel.max_rows) run a scan
# mixer's step recurrence, one row after another, so a row is the same whatever its call's size; longer
# calls (a prompt) run its chunked form
STEP_ROWS = 64


def solo_piece(S: int, fed: int, last_rows: int) -> int:
    """The rows of the next call reading rows [fed, S) of an S-row call of a recurrent model as
    engine.OrtModel does alone (calls of MAX_CALL_ROWS from the first row, the rest, at least
    last_rows, in the last): a scan's chunked form groups its sums by call, so a batch slot that
    reads a prompt in the same calls gets the same bits."""
    cut = S - max(last_rows, (S - 1) % MAX_CALL_ROWS + 1)  # where the last call starts
    return min(MAX_CALL_ROWS, cut - fed) if fed < cut else S - fed


class StateHistory:
    """The kept recurrent states of one sequence (module docstring)."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], dtype, depth: int, max_rows: int, slot: int | None = None):
        """slot: the cache slot whose names (state_index_slot{b}, ...) bind() binds (None: one slot)."""
        if depth <= max_rows:
            raise InvalidArgument(f"state depth {depth} must exceed the rows of one call ({max_rows})")
        if max_rows > STEP_ROWS:  # longer calls run a scan's chunked form (other bits than one-row calls)
            raise InvalidArgument(
                f"a recurrent model's calls after its prompt hold at most {STEP_ROWS} rows; got max_rows {max_rows}"
            )
        self.shapes, self.depth, self.max_rows = tuple(tuple(s) for s in shapes), depth, max_rows
        self.index_name = contract.state_index(slot)
        self.names = [(contract.past_state(j, slot), contract.new_state(j, slot)) for j in range(len(self.shapes))]
        slots = depth + max_rows
        self.ring = [np.full((slots, *s), 0, dtype) for s in self.shapes]
        self.zeros = [np.zeros((1, *s), dtype) for s in self.shapes]
        self.owner = np.full(slots, -1, np.int64)  # the position each slot holds (-1: none)
        self.slot_of: dict[int, int] = {}  # position -> its slot
        self.index = np.arange(max_rows, dtype=np.int64)  # state_index views
        self._start = 0  # the first slot the bound call writes
        # prefix reuse (prefix_cache.py): copies of the states a cold prompt reaches in the same calls,
        # length -> [arrays [1, *s_j]]; None: not recorded
        self.checkpoints: dict[int, list[np.ndarray]] | None = None

    def kept(self, length: int) -> bool:
        """Whether the state after `length` tokens is held."""
        return length == 0 or length in self.slot_of

    def state(self, length: int) -> list[np.ndarray]:
        """Views [1, *s_j] of the state after `length` tokens (InvalidArgument when not kept)."""
        if not self.kept(length):
            raise InvalidArgument(
                f"the recurrent state after {length} tokens is not kept (the last {self.depth} positions"
                " are): roll back at most that far"
            )
        if length == 0:
            return self.zeros
        slot = self.slot_of[length]
        return [r[slot : slot + 1] for r in self.ring]

    def rows(self, S: int, last_rows: int) -> np.ndarray:
        """state_index of a call of S real rows: every row when they fit one call's slots, else
        the last `last_rows` (a long prefill: only its end is ever rolled back to)."""
        if S <= self.max_rows:
            return self.index[:S]
        return np.arange(S - last_rows, S, dtype=np.int64)

    def bind(self, io, P: int, rows: np.ndarray) -> None:
        """Bind the state after P tokens, state_index `rows` (consecutive) and their output slots
        into `io`; the positions those slots held are dropped now (the call overwrites them)."""
        start = self._block(P, (P + int(rows[0]) + 1) % self.depth, rows.size)
        self._evict(range(start, start + rows.size))
        self._start = start
        io.bind_cpu_input(self.index_name, rows)
        for j, (past, ring, (name_in, name_out)) in enumerate(zip(self.state(P), self.ring, self.names)):
            io.bind_input(name_in, "cpu", 0, past.dtype, list(past.shape), past.ctypes.data)
            out = ring[start : start + rows.size]  # [Rs, *s_j], contiguous
            shape = [1, rows.size, *self.shapes[j]]
            io.bind_output(name_out, "cpu", 0, out.dtype, shape, out.ctypes.data)

    def bind_idle(self, io, P: int) -> None:
        """A slots graph's slot without rows this call: its throwaway row reads a kept state (the
        zeros when P's is not kept), and no state comes back (an empty state_index)."""
        io.bind_cpu_input(self.index_name, self.index[:0])
        states = self.state(P) if self.kept(P) else self.zeros
        for past, (name_in, name_out) in zip(states, self.names):
            io.bind_input(name_in, "cpu", 0, past.dtype, list(past.shape), past.ctypes.data)
            io.bind_output(name_out, "cpu")

    def _block(self, P: int, start: int, size: int) -> int:
        """The first of `size` consecutive slots for a call's states: `start` (its first row's
        position modulo depth) unless they would hold the call's input state (a long call's last
        rows can wrap onto it), then the slots just after or just before that one (the ring has
        depth + max_rows > 2 size slots, so one side fits)."""
        held = self.slot_of.get(P, -1)
        if not start <= held < start + size:
            return start
        return held + 1 if held + 1 + size <= len(self.owner) else held - size

    def store(self, P: int, rows: np.ndarray, S: int) -> None:
        """After the call of S rows bound at cursor P: its slots hold the state after row r
        (position P + r + 1) for each returned row; every other position past P is dropped (not
        this call's); a recorded history keeps its checkpoint (mark)."""
        self.forget_after(P)
        for k, r in enumerate(rows.tolist()):
            slot, length = self._start + k, P + r + 1
            self.owner[slot], self.slot_of[length] = length, slot
        self.mark(P, S)

    def _evict(self, slots: range) -> None:
        for slot in slots:
            held = int(self.owner[slot])
            if held >= 0 and self.slot_of.get(held) == slot:
                del self.slot_of[held]
            self.owner[slot] = -1

    def rollback(self, length: int) -> None:
        """Keep the first `length` positions: the state after them must be kept (InvalidArgument
        otherwise); the states past them are dropped."""
        self.state(length)
        self.forget_after(length)

    def forget_after(self, length: int) -> None:
        """Drop the states of positions past `length` (a rollback: they belong to rejected rows)."""
        for held in [p for p in self.slot_of if p > length]:
            self.owner[self.slot_of.pop(held)] = -1
        if self.checkpoints:
            for n in [n for n in self.checkpoints if n > length]:
                del self.checkpoints[n]

    def reset(self) -> None:
        self.owner[:] = -1
        self.slot_of.clear()
        if self.checkpoints is not None:
            self.checkpoints = {}

    def record(self) -> None:
        """Keep checkpoints from now on (mark)."""
        if self.checkpoints is None:
            self.checkpoints = {}

    def mark(self, P: int, S: int) -> None:
        """After a call of S rows at P (recorded, its states stored): keep a copy of the state at P + S when a
        cold prompt reaches it in the same calls, so that a prefix hit resuming there gives a cold
        start's bits: a whole MAX_CALL_ROWS call from position 0 or from such a checkpoint (a
        prompt is read in those calls from position 0, solo_piece; the chunked scan's bits follow
        the call)."""
        ckpt = self.checkpoints
        if ckpt is None or S != MAX_CALL_ROWS or P % MAX_CALL_ROWS or (P and P not in ckpt) or not self.kept(P + S):
            return
        ckpt[P + S] = [s.copy() for s in self.state(P + S)]

    def seed(self, length: int, checkpoints: dict[int, list[np.ndarray]]) -> None:
        """Forget everything, then hold checkpoints[length] as the state after `length` tokens
        (a prefix restored from the pool), the others as checkpoints; length 0: the zeros."""
        self.reset()
        if length:
            slot = length % self.depth
            for ring, state in zip(self.ring, checkpoints[length]):
                ring[slot] = state[0]
            self.owner[slot], self.slot_of[length] = length, slot
        if self.checkpoints is not None:
            self.checkpoints = {n: [a.copy() for a in st] for n, st in checkpoints.items() if n <= length}

    def nbytes(self) -> int:
        return sum(r.nbytes + z.nbytes for r, z in zip(self.ring, self.zeros))
