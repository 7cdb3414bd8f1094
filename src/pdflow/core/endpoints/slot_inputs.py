"""Engine calls as the room-slot machines see them: one (room id, generation) each."""

from __future__ import annotations

from pdflow.core.protocol.inputs import Input

CLEAR_HINT = "only a terminal room can be cleared: abort it first (RoomCall with AbortRequested)"


class OpenSlot(Input, frozen=True, tag="OpenSlot"):
    """The engine opens this generation of the room id."""

    room: int
    generation: int


class ClearSlot(Input, frozen=True, tag="ClearSlot"):
    """The engine is done with this (terminal) generation of the room id."""

    room: int
    generation: int
