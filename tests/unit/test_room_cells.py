"""Exhaustive state x input cells of both room machines.

A cell in the table whose row applies must reach one of its allowed targets; any other input
(no cell, or no guard of a guarded-only cell holds) must raise the typed ProtocolError (remote
inputs: RemoteProtocolError) and leave the room exactly as it was.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pdflow.core.framework.errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from pdflow.core.rooms.receiver_room import RECEIVER_TABLE, ReceiverState
from pdflow.core.rooms.sender_room import SENDER_TABLE, SenderState
from tests.unit.room_fixtures import receiver_in, receiver_samples, sender_in, sender_samples

CASES: list[tuple[Any, Any, Any, Any, str]] = [
    (SENDER_TABLE, sender_in, sender_samples, state, on)
    for state in SenderState
    for on in SENDER_TABLE.inputs
] + [
    (RECEIVER_TABLE, receiver_in, receiver_samples, state, on)
    for state in ReceiverState
    for on in RECEIVER_TABLE.inputs
]


@pytest.mark.parametrize(
    ("table", "build", "samples", "state", "on"),
    CASES,
    ids=[f"{c[0].machine}-{c[3].name}-{c[4]}" for c in CASES],
)
def test_every_cell(table: Any, build: Any, samples: Any, state: Any, on: str) -> None:
    room = build(state)
    *setup, probe = samples(room)[on]
    for inp in setup:
        room.handle(inp, 2.0)
        assert room.state is state, "setup inputs must not leave the state under test"
    cell = table.cell(state, on)
    # A cell of guarded rows only (a Tick before its deadline) refuses when no guard holds.
    if any(r.guard_fn is None or r.guard_fn(room, probe, 2.0) for r in cell):
        room.handle(probe, 2.0)
        assert room.state in {r.target for r in cell}
    else:
        before = copy.deepcopy(room.__dict__)
        expected = RemoteProtocolError if on in table.remote_inputs else LocalProtocolError
        with pytest.raises(expected) as info:
            room.handle(probe, 2.0)
        assert isinstance(info.value, ProtocolError)
        assert state.name in str(info.value) and on in str(info.value)
        assert room.__dict__ == before, "a refused input must change nothing"


def test_every_input_is_sampled() -> None:
    assert set(sender_samples(sender_in(SenderState.FAILED))) == set(SENDER_TABLE.inputs)
    assert set(receiver_samples(receiver_in(ReceiverState.FAILED))) == set(RECEIVER_TABLE.inputs)
