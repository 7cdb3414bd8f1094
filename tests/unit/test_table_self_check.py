"""A step checks its outputs against the row it took, with the rows the table holds now."""

from __future__ import annotations

import dataclasses

import pytest

from pdflow.core.framework.table import ConformanceError
from pdflow.core.protocol.inputs import AbortRequested
from pdflow.core.protocol.messages import PeerId
from pdflow.core.protocol.outputs import StatusChanged
from pdflow.core.rooms.sender_room import SENDER_TABLE, SenderRoom

ME = PeerId("127.0.0.1:17001", "prefill-incarnation", 0)
CELL = ("BOOTSTRAPPING", "AbortRequested")


def test_an_output_its_row_does_not_list_is_a_conformance_error() -> None:
    # A step with the table's own rows first, so the rows swapped in below replace compiled ones.
    outputs, _ = SenderRoom(1, 1, ME, 0.0).fire(AbortRequested("stop"), 1.0)
    assert [type(o) for o in outputs] == [StatusChanged]
    cells = SENDER_TABLE._cells
    mute = tuple(dataclasses.replace(r, emits=frozenset()) for r in cells[CELL])
    SENDER_TABLE._cells = {**cells, CELL: mute}
    try:
        room = SenderRoom(2, 1, ME, 0.0)
        with pytest.raises(ConformanceError, match="emitted status_changed, not in its row"):
            room.fire(AbortRequested("stop"), 1.0)
    finally:
        SENDER_TABLE._cells = cells
