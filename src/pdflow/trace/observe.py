"""What a trace record says about one step, computed the same way when recording and replaying."""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from pdflow.core.endpoints.endpoint_io import (
    AnyEndpointInput,
    DecodeEndpointConfig,
    PrefillEndpointConfig,
    Received,
)
from pdflow.core.framework.machines import MACHINES
from pdflow.core.framework.step import Fired, Step
from pdflow.core.protocol.messages import RoomMessage
from pdflow.core.protocol.outputs import Output
from pdflow.trace.format import StepRecord


class TracedEndpoint(Protocol):
    """What the recorder and replay need of an endpoint (PrefillEndpoint, DecodeEndpoint)."""

    @property
    def role(self) -> str: ...

    @property
    def config(self) -> PrefillEndpointConfig | DecodeEndpointConfig: ...

    def handle(self, inp: AnyEndpointInput, now: float) -> Step: ...

    def summary(self, room_id: int) -> msgspec.Struct | None: ...

    def timer_at(self) -> float | None: ...

    def snapshot(self) -> msgspec.Struct: ...


def input_rooms(inp: AnyEndpointInput) -> set[int]:
    """The room an input addresses, if any (a received message names its room)."""
    room = getattr(inp, "room", None)
    if isinstance(room, int):
        return {room}
    if isinstance(inp, Received) and isinstance(inp.message, RoomMessage):
        return {inp.message.room}
    return set()


def touched_rooms(inp: AnyEndpointInput, step: Step | None) -> list[int]:
    """The input's room, every room a transition fired in, every room an output names."""
    rooms = input_rooms(inp)
    if step is not None:
        rooms.update(f.key for f in step.fired)
        for output in step.outputs:
            room = getattr(output, "room", None)
            if isinstance(room, int):
                rooms.add(room)
    return sorted(rooms)


def record_rooms(record: StepRecord) -> set[int]:
    """The rooms a record concerns: its input's, its outputs', and those of its transitions
    in room-keyed machines (the recorder also lists the keys of the others, which replay
    compares as recorded, so they are filtered here rather than there)."""
    rooms = input_rooms(record.input)
    rooms.update(f.key for f in room_fired(record))
    for output in record.outputs:
        room = output.get("room")
        if isinstance(room, int):
            rooms.add(room)
    return rooms


def room_fired(record: StepRecord) -> list[Fired]:
    """The record's transitions that belong to one room: a layout announcement's key is a
    rank, the admission queue's 0, and neither is a room id."""
    return [f for f in record.fired
            if (table := MACHINES.get(f.machine)) is None or table.keyed_by_room]  # fmt: skip


def room_summaries(endpoint: TracedEndpoint, rooms: list[int]) -> list[dict[str, object]]:
    return [{"room": room, "summary": _builtins(endpoint.summary(room))} for room in rooms]


def outputs_as_builtins(outputs: tuple[Output, ...]) -> list[dict[str, object]]:
    return [_builtins(output) for output in outputs]


def _builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)
