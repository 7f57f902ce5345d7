"""ONNX Runtime backend for a slots graph (feature cache_slots): K sequences, one cache
slot each, fed in one call.

Each layer's K and V live in one buffer [K, H_kv, T_max, D] (fused) or [K, T_max, H_kv, D]
(time_major) allocated once. Fused: slot b's graph inputs past_key_{i}_slot{b} /
present_key_{i}_slot{b} are bound once to its [1, H_kv, T_max, D] part, and its
GroupQueryAttention writes rows P_b .. P_b + S_b - 1 there in place. Time_major: per call, slot
b's past_key_{i}_slot{b} is bound to its rows [0, P_b) and new_key_{i}_slot{b} to rows
[P_b, P_b + S_b) of its part (rebound only where P_b or S_b changed). A call packs the
slots' rows one slot after another (slot_rows [K]); a slot without rows in a call has 0 rows
(feature idle_slots: the fused graph gives its attention one throwaway row, written past its valid
rows and never read), or one throwaway token of its own in a 1.5 graph (idle_rows 1). Each slot
keeps its own cursor; rollback is a cursor move per slot.

`SlotModel.view(b)` is slot b as the speculative loop sees its target (the cursor side of
model.Model); the calls themselves go through `forward(calls)` for all slots at once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import contract
from .contract import GraphSpec
from .engine import NP_DTYPES, SessionConfig, check_contract, check_layout_provider, make_session
from .errors import ContractError, InvalidArgument
from .model import CacheCursor, CallStats, plan_rows
from .recurrent import StateHistory


def too_few_slots(root, has: int, wanted: int) -> InvalidArgument:
    """The error of asking an artifact with `has` batch slots (1: no batch graph) for `wanted`,
    naming the command that rebuilds it with them (recipe.json is the recipe it was built from)."""
    root = Path(root)
    return InvalidArgument(
        f"{wanted} requests at once need an artifact with a batch graph of at least {wanted} slots; {root} has"
        f" max_batch {has}. Rebuild it with slots: specexport build {root / 'recipe.json'} --max-batch {wanted}"
        f" -o {root.parent / (root.name + f'-batch{wanted}')} (docs/batching.md)"
    )


def idle_rows(contract_version: str) -> int:
    """The rows an idle slot feeds in a slots graph of this contract version (SlotModel)."""
    return 0 if contract.parse_version(contract_version) >= contract.parse_version(contract.IDLE_SLOTS_VERSION) else 1


@dataclass(frozen=True)
class SlotCall:
    """S tokens for one slot at its cursor, and how many of their last logits rows come back."""

    slot: int
    ids: Sequence[int]
    last_rows: int = 1


class SlotView(CacheCursor):
    """Slot b of a SlotModel: its cursor, as model.Model has it (forward goes through the batch)."""

    def __init__(self, model: SlotModel, slot: int):
        self.model, self.slot = model, slot
        self.spec, self.max_context, self.max_rows, self.min_rows = model.spec, model.max_context, model.max_rows, 1
        self.stats = model.stats

    @property
    def length(self) -> int:  # type: ignore[override]
        return int(self.model.lengths[self.slot])

    @length.setter
    def length(self, value: int) -> None:
        self.model.lengths[self.slot] = value

    def kv_nbytes(self) -> int:
        return self.model.kv_nbytes() // self.model.slots

    @property
    def states(self) -> StateHistory | None:
        """This slot's recurrent states (feature recurrent_slots), as an OrtModel's `states`; else None."""
        return None if self.model.states is None else self.model.states[self.slot]

    def truncate(self, length: int) -> None:
        """Roll back to `length` rows; a slot of a recurrent graph also needs its state after them kept."""
        if self.states is not None and 0 <= length <= self.length:
            self.states.rollback(length)  # InvalidArgument when its state is not kept
        super().truncate(length)

    def reset(self) -> None:
        if self.states is not None:
            self.states.reset()
        super().reset()

    def forward(self, ids, last_rows: int = 1, features=None, hidden=None) -> np.ndarray:
        """This slot alone in a call (the others get throwaway rows): model.Model's forward."""
        if features is not None or hidden is not None:
            raise InvalidArgument("a slots graph takes no head inputs (features / hidden)")
        ids = self.check_call(ids, last_rows)[0]
        self.last_start = self.length
        return self.model.forward([SlotCall(self.slot, ids, last_rows)])[0]


class SlotModel:
    """A slots graph with its K cache slots on ONNX Runtime's CPU provider (module docstring)."""

    def __init__(
        self,
        path: Path,
        spec: GraphSpec,
        max_context: int,
        config: SessionConfig,
        max_rows: int = 17,
        cache_pad: int = 0,
        min_rows: int = 1,
        idle_rows: int = 0,
    ):
        """max_rows: most logits rows one slot gets back per call (1 + the longest draft);
        cache_pad / min_rows: the entry's padding (feature row_padding), per slot: min_rows pads each
        slot's rows after its real ones with copies of its last token (the cursor advances by
        the real rows only); idle_rows: the rows a slot without a call feeds (0 since contract
        1.6, 1 for a 1.5 graph)."""
        if spec.slots < 2:
            raise ContractError(f"a SlotModel runs a graph of several slots; this graph has {spec.slots}")
        if config.provider != "cpu":
            raise ContractError(f"slots graphs run on the CPU provider for now, not {config.provider!r}")
        CacheCursor.check_min_rows(spec, min_rows, max_rows)
        if not 0 <= cache_pad <= 1 or not 0 <= idle_rows <= 1:
            raise InvalidArgument(f"cache_pad and idle_rows must be 0 or 1, got {cache_pad!r} and {idle_rows!r}")
        check_layout_provider(spec, config.provider)
        self.spec, self.max_context, self.config, self.slots = spec, max_context, config, spec.slots
        self.max_rows, self.cache_pad, self.min_rows, self.idle_rows = max_rows, cache_pad, min_rows, idle_rows
        self.cache_rows = max_context + min_rows - 1 + cache_pad
        self.session = make_session(path, config)
        check_contract(self.session, spec, str(path))
        dtype = self._dtype = NP_DTYPES[spec.kv_dtype]
        K, H, D, T = spec.slots, spec.num_kv_heads, spec.head_dim, self.cache_rows
        # one [K, H_kv, T, D] (time_major: [K, T, H_kv, D]) buffer per layer and K/V, filled (not
        # calloc'd, so resident from the start)
        shape = (K, *spec.layout.cache_shape(T, H, D)[1:])
        self._buffers = [np.full(shape, 0, dtype) for _ in range(2 * spec.num_layers)]
        # logits of every slot's rows: [1, K * max_rows, V] fp32, allocated once
        self._logits = np.full((1, K * max_rows, spec.embedding_rows), 0, np.float32)
        self.lengths = np.zeros(K, np.int64)  # per-slot cursor P_b
        # feature recurrent_slots: each slot keeps the state after its last max_rows + 1 positions
        self.states = None
        if spec.states:
            self.states = [StateHistory(spec.states, np.float32, max_rows + 1, max_rows, slot=b) for b in range(K)]
        self.stats = CallStats()
        self._io = self.session.io_binding()
        self._views = [SlotView(self, b) for b in range(K)]
        # per slot: (past name, output name, the slot's buffer part) of every layer's K and V;
        # time_major: the (P, S) bound last
        self._kv = [
            [
                (name_in, name_out, buf[b].ctypes.data)
                for i in range(spec.num_layers)
                for name_in, name_out, buf in zip(
                    (contract.past_key(i, b), contract.past_value(i, b)),
                    spec.layout.kv_outputs(i, b),
                    self._buffers[2 * i : 2 * i + 2],
                )
            ]
            for b in range(K)
        ]
        self._bound: list[tuple[int, int] | None] = [None] * K
        self._row_bytes = H * D * np.dtype(dtype).itemsize
        if spec.layout.in_place:  # past_* and present_* of a slot are one [1, H_kv, T, D] part, bound once
            for names in self._kv:
                for name_in, name_out, ptr in names:
                    self._io.bind_input(name_in, "cpu", 0, dtype, [1, H, T, D], ptr)
                    self._io.bind_output(name_out, "cpu", 0, dtype, [1, H, T, D], ptr)

    def _bind_rows(self, rows: np.ndarray) -> None:
        """time_major: slot b's past_* = its rows [0, P_b) [1, P_b, H_kv, D] and new_* = rows
        [P_b, P_b + S_b) (pointer + offset), rebound where (P_b, S_b) changed since its last call."""
        H, D, dt = self.spec.num_kv_heads, self.spec.head_dim, self._dtype
        for b, names in enumerate(self._kv):
            P, S = int(self.lengths[b]), int(rows[b])
            if self._bound[b] == (P, S):
                continue
            self._bound[b] = (P, S)
            for name_in, name_out, ptr in names:
                self._io.bind_input(name_in, "cpu", 0, dt, [1, P, H, D], ptr)
                self._io.bind_output(name_out, "cpu", 0, dt, [1, S, H, D], ptr + P * self._row_bytes)

    def _bind_states(self, by_slot: list[SlotCall | None]) -> dict[int, np.ndarray]:
        """Bind every slot's states: a slot with a call its kept state and the rows of its real
        tokens (recurrent.StateHistory.rows), an idle slot a throwaway read; -> slot -> rows bound."""
        picked = {}
        for b, c in enumerate(by_slot):
            P, history = int(self.lengths[b]), self.states[b]
            if c is None:
                history.bind_idle(self._io, P)
                continue
            picked[b] = history.rows(len(c.ids), c.last_rows)
            history.bind(self._io, P, picked[b])
        return picked

    def view(self, slot: int) -> SlotView:
        return self._views[slot]

    def kv_nbytes(self) -> int:
        return self.spec.kv_bytes(self.cache_rows)

    def kv_rows(self, slot: int, start: int, stop: int) -> list[np.ndarray]:
        """Views of slot `slot`'s cache rows [start, stop) of every K/V buffer as [n, H_kv, D]."""
        axis = self.spec.layout.time_axis - 1  # of b[slot]: [H_kv, T, D] or [T, H_kv, D]
        return [np.moveaxis(b[slot], axis, 0)[start:stop] for b in self._buffers]

    def forward(self, calls: Sequence[SlotCall]) -> list[np.ndarray]:
        """One graph call for every slot in `calls` (each at most once); returns each call's
        logits rows [last_rows, V] (views the next call overwrites), in the order of `calls`."""
        K = self.slots
        by_slot: list[SlotCall | None] = [None] * K
        for c in calls:
            if not 0 <= c.slot < K or by_slot[c.slot] is not None:
                raise InvalidArgument(f"slot {c.slot!r} is not one of 0..{K - 1} or is fed twice in one call")
            S = len(c.ids)
            if S < 1 or not 1 <= c.last_rows <= min(S, self.max_rows):
                raise InvalidArgument(
                    f"slot {c.slot} needs S >= 1 and 1 <= last_rows <= min(S, {self.max_rows});"
                    f" got S={S}, rows={c.last_rows}"
                )
            if self.lengths[c.slot] + S > self.max_context:
                raise InvalidArgument(
                    f"slot {c.slot}: {self.lengths[c.slot]} cached + {S} new tokens exceed"
                    f" max_context {self.max_context}"
                )
            by_slot[c.slot] = c
        rows = np.full(K, self.idle_rows, np.int64)  # slot_rows [K]
        ids, index, out_at = [], [], {}
        start = 0
        for b, c in enumerate(by_slot):
            if c is None:
                ids.append(np.zeros(self.idle_rows, np.int64))
            else:
                S = len(c.ids)  # padded with copies of the last token to min_rows (model.plan_rows)
                padded = plan_rows(np.asarray(c.ids, np.int64).reshape(1, -1), c.last_rows, self.min_rows).ids[0]
                rows[b] = len(padded)
                ids.append(padded)
                out_at[b] = len(index)
                index.extend(range(start + S - c.last_rows, start + S))
            start += rows[b]
        io, R = self._io, len(index)
        io.bind_cpu_input(contract.INPUT_IDS, np.concatenate(ids)[None])
        io.bind_cpu_input(contract.LOGITS_INDEX, np.asarray(index, np.int64))
        io.bind_cpu_input(contract.SLOT_ROWS, rows)
        if self.spec.layout.in_place:
            P = np.minimum(self.lengths, self.max_context - 1)  # a throwaway row of a full slot stays in the cache
            seqlens = (P + rows - 1).astype(np.int32)  # [K]; bound arrays stay referenced until the run
            total = (P + rows).astype(np.int32)  # [K]
            io.bind_cpu_input(contract.SEQLENS_K, seqlens)
            io.bind_cpu_input(contract.TOTAL_SEQUENCE_LENGTH, total)
        else:
            self._bind_rows(rows)
        V = self.spec.embedding_rows
        io.bind_output(contract.LOGITS, "cpu", 0, np.float32, [1, R, V], self._logits.ctypes.data)
        state_rows = self._bind_states(by_slot) if self.states is not None else {}
        t0 = time.perf_counter()
        self.session.run_with_iobinding(io)
        self.stats.add(int(rows.sum()), time.perf_counter() - t0)
        for b, picked in state_rows.items():
            self.states[b].store(int(self.lengths[b]), picked, len(by_slot[b].ids))
        out = []
        for c in calls:
            self.lengths[c.slot] += len(c.ids)
            at = out_at[c.slot]
            out.append(self._logits[0, at : at + c.last_rows])
        return out
