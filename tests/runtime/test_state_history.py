"""recurrent.StateHistory's slots without a graph: the input state of a call is never among the
slots its outputs are bound to, whatever the call's rows."""

from __future__ import annotations

import numpy as np
import pytest

from specexport_runtime.errors import InvalidArgument
from specexport_runtime.recurrent import StateHistory


class _IO:
    """Records what bind() binds: input name -> address, output name -> (address, shape)."""

    def __init__(self):
        self.inputs, self.outputs = {}, {}

    def bind_cpu_input(self, name, value):
        self.inputs[name] = value

    def bind_input(self, name, device, device_id, dtype, shape, address):
        self.inputs[name] = address

    def bind_output(self, name, device, device_id, dtype, shape, address):
        self.outputs[name] = (address, shape)


def _call(h: StateHistory, P: int, S: int, last_rows: int = 1) -> tuple[int, range]:
    """Bind a call of S rows at P, write each returned row's state as its position, store it:
    (the input state's slot address, the output slots' address range)."""
    rows = h.rows(S, last_rows)
    io = _IO()
    h.bind(io, P, rows)
    past = io.inputs["past_state_0"]
    out, shape = io.outputs["new_state_0"]
    item = h.ring[0].strides[0]
    assert shape == [1, rows.size, 2]
    block = h.ring[0][h._start : h._start + rows.size]
    block[...] = (P + rows + 1)[:, None]  # the state after row r holds its position
    h.store(P, rows, S)
    return past, range(out, out + rows.size * item)


@pytest.mark.parametrize("S", range(1, 40))
def test_a_call_never_writes_over_its_input_state(S):
    h = StateHistory([(2,)], np.float32, depth=10, max_rows=9)
    P = 0
    for step in (3, 5, 2, 9, 1, 4):  # verify-sized calls move the ring around
        _call(h, P, step)
        P += step
    past, outs = _call(h, P, S)
    assert past not in outs
    assert h.kept(P + S)
    np.testing.assert_array_equal(h.state(P + S)[0], [[P + S, P + S]])


def test_a_long_call_wrapping_onto_its_input_slot_keeps_it_until_written():
    """The case a draft model's catch-up call met: P = 26 at slot 6, 40 rows, the last row's
    position 66 has residue 6 modulo depth 10."""
    h = StateHistory([(2,)], np.float32, depth=10, max_rows=9)
    P = 0
    for step in (9, 9, 8):
        _call(h, P, step)
        P += step
    assert P == 26 and h.slot_of[26] % 10 == 6
    past, outs = _call(h, 26, 40)
    assert past not in outs
    np.testing.assert_array_equal(h.state(66)[0], [[66, 66]])
    with pytest.raises(InvalidArgument, match="not kept"):
        h.state(30)  # inside the long call: only its last row is kept
