"""Per-room timelines from a merged trace: the model behind `pdflow trace show` (text and HTML).

For each room id, in merged order: what happened on each endpoint (inputs, transitions fired,
messages sent and received, transfers started and completed, timers, refused inputs), and the
room's outcome per endpoint (its last KVPoll before removal).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdflow.core.endpoints.endpoint_io import (
    ClearRoom,
    OpenReceiver,
    OpenRoom,
    Received,
    RoomCall,
    TimerFired,
)
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Fired
from pdflow.core.protocol.inputs import PublishPages, TransferCompleted
from pdflow.core.protocol.messages import PeerId, RoomMessage
from pdflow.trace.format import StepRecord, message_id
from pdflow.trace.merge import Trace
from pdflow.trace.observe import input_rooms, record_rooms, room_fired


@dataclass(frozen=True)
class RoomEvent:
    t: float
    endpoint: str
    seq: int
    kind: str
    """open, call, clear, pages, recv, send, transfer_start, transfer_done, timer, transition,
    status, fence, freed, quarantined, removed, dropped, error."""
    text: str
    msg_id: str | None = None
    """For send: the id of this message; for recv: the id of the message that arrived."""
    peer: str | None = None
    """For send: the endpoint (or address) the message went to."""


@dataclass
class RoomTimeline:
    room: int
    events: list[RoomEvent] = field(default_factory=list)
    generation_polls: dict[int, dict[str, str]] = field(default_factory=dict)
    """Per generation of the room id, per endpoint: its last KVPoll name there. A reused id's
    failed attempt stays visible after a later attempt succeeded."""
    removed: set[str] = field(default_factory=set)
    errors: int = 0

    @property
    def first_t(self) -> float:
        return self.events[0].t if self.events else 0.0

    @property
    def last_t(self) -> float:
        return self.events[-1].t if self.events else 0.0

    @property
    def generations(self) -> list[int]:
        return sorted(self.generation_polls)

    @property
    def final_poll(self) -> dict[str, str]:
        """Per endpoint: the KVPoll name of the room's latest generation there."""
        polls: dict[str, str] = {}
        for generation in self.generations:
            polls.update(self.generation_polls[generation])
        return polls

    @property
    def outcome(self) -> str:
        """The room's outcome per generation, in order ("Failed->Success": an attempt failed
        and the id's next one succeeded); within one generation Failed wins over the rest."""
        outcomes: list[str] = []
        for generation in self.generations:
            outcome = _outcome_of(set(self.generation_polls[generation].values()))
            if not outcomes or outcomes[-1] != outcome:
                outcomes.append(outcome)
        return "->".join(outcomes) if outcomes else "unknown"

    @property
    def failed(self) -> bool:
        return any("Failed" in polls.values() for polls in self.generation_polls.values())

    def span(self, endpoint: str) -> tuple[float, float] | None:
        times = [e.t for e in self.events if e.endpoint == endpoint]
        return (min(times), max(times)) if times else None


def endpoint_names(trace: Trace) -> dict[str, str]:
    """Each endpoint's peer key (address/incarnation#rank) -> its endpoint id in the trace."""
    return {_me_key(header.config.me): name for name, header in trace.headers.items()}


def build_timelines(trace: Trace) -> dict[int, RoomTimeline]:
    peers = endpoint_names(trace)
    rooms: dict[int, RoomTimeline] = {}
    for record in trace.records:
        for room_id, event in _events(record, peers):
            rooms.setdefault(room_id, RoomTimeline(room_id)).events.append(event)
        touched = record_rooms(record)
        for entry in record.rooms:
            room_id = int(str(entry["room"]))
            if room_id not in touched:
                continue  # a rank-keyed machine's key, listed by the recorder as a room
            timeline = rooms.setdefault(room_id, RoomTimeline(room_id))
            summary = entry.get("summary")
            if isinstance(summary, dict):
                polls = timeline.generation_polls.setdefault(int(summary["generation"]), {})
                polls[record.endpoint] = KVPoll(summary["poll"]).name
            else:
                timeline.removed.add(record.endpoint)
        if record.error is not None:
            for room_id in input_rooms(record.input):
                rooms.setdefault(room_id, RoomTimeline(room_id)).errors += 1
    return dict(sorted(rooms.items()))


def _outcome_of(polls: set[str]) -> str:
    if "Failed" in polls:
        return "Failed"
    return polls.pop() if len(polls) == 1 else "/".join(sorted(polls))


def transition_text(fired: Fired) -> str:
    """``Machine: SOURCE -> TARGET on Event [guard]`` (``=`` where the state stays)."""
    guard = f" [{fired.guard}]" if fired.guard else ""
    arrow = "=" if fired.source == fired.target else "->"
    return f"{fired.machine}: {fired.source} {arrow} {fired.target} on {fired.on}{guard}"


def peer_key(address: str, incarnation: str, rank: int) -> str:
    return f"{address}/{incarnation}#{rank}"


def _me_key(peer: PeerId) -> str:
    return peer_key(peer.address, peer.incarnation, peer.rank)


def _events(record: StepRecord, peers: dict[str, str]) -> list[tuple[int, RoomEvent]]:
    out: list[tuple[int, RoomEvent]] = []

    def add(room: int, kind: str, text: str, **extra: Any) -> None:
        out.append((room, RoomEvent(record.t, record.endpoint, record.seq, kind, text, **extra)))

    _input_events(record, add)
    if record.error is not None:
        for room in input_rooms(record.input):
            add(room, "error", f"refused: {record.error.kind}: {record.error.message}")
    for fired in room_fired(record):
        add(fired.key, "transition", transition_text(fired))
    for index, output in enumerate(record.outputs):
        _output_event(record, index, output, peers, add)
    return out


def _input_events(record: StepRecord, add: Any) -> None:
    inp = record.input
    if isinstance(inp, OpenRoom | OpenReceiver):
        source = f" from {inp.bootstrap}" if isinstance(inp, OpenReceiver) else ""
        add(inp.room, "open", f"engine opens room (generation {inp.generation}){source}")
    elif isinstance(inp, RoomCall):
        add(inp.room, "call", f"engine calls {type(inp.call).__name__}")
    elif isinstance(inp, ClearRoom):
        add(inp.room, "clear", "engine clears the room")
    elif isinstance(inp, PublishPages):
        add(inp.room, "pages", f"engine publishes {len(inp.dst_pages)} destination pages")
    elif isinstance(inp, Received) and isinstance(inp.message, RoomMessage):
        # (A layout announcement and its answer concern no room.)
        tag = type(inp.message).__struct_config__.tag
        add(inp.message.room, "recv", f"received {tag}", msg_id=inp.msg_id)
    elif isinstance(inp, TransferCompleted):
        result = "ok" if inp.ok else f"FAILED ({inp.reason})"
        add(inp.room, "transfer_done", f"transfer #{inp.seq} done: {result}")
    elif isinstance(inp, TimerFired):
        for fired in room_fired(record):
            if fired.on == "Tick":
                add(fired.key, "timer", "timer fired")


def _output_event(
    record: StepRecord, index: int, output: dict[str, Any], peers: dict[str, str], add: Any
) -> None:
    kind = output.get("type")
    room = output.get("room")
    if kind == "dropped":
        for dropped_room in input_rooms(record.input):
            add(dropped_room, "dropped", f"dropped ({output['kind']}): {output['reason']}")
    elif kind == "send" and "room" in output["message"]:  # (a KvArgs concerns no room)
        message, to = output["message"], output["to"]
        target = peers.get(peer_key(to["address"], to["incarnation"], to["rank"]), to["address"])
        add(
            message["room"], "send", f"sends {message['type']} to {target}",
            msg_id=message_id(record.endpoint, record.seq, index), peer=target,
        )  # fmt: skip
    elif not isinstance(room, int):
        return
    elif kind == "start_transfer":
        pages = len(output["src_pages"])
        last = ", last" if output["is_last"] else ""
        add(room, "transfer_start", f"transfer #{output['seq']} started: {pages} pages{last}")
    elif kind == "status_changed":
        reason = f" ({output['reason']})" if output.get("reason") else ""
        add(room, "status", f"KVPoll -> {KVPoll(output['poll']).name}{reason}")
    elif kind == "arm_fence":
        add(room, "fence", f"fence armed for {len(output['writers'])} writer(s)")
    elif kind in ("pages_freed", "release_pages"):
        add(room, "freed", f"{len(output['pages'])} pages freed")
    elif kind == "pages_quarantined":
        add(room, "quarantined", f"{len(output['pages'])} pages quarantined")
    elif kind == "room_removed":
        add(room, "removed", "room removed")
    elif kind == "verify_checksums":
        add(room, "status", "checksums to verify")
