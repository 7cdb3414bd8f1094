"""`pdflow replay --room/--endpoint/--until` in the terminal: followed steps and the stop state.

Values are shown compactly and generically: ``type(field=value, ...)`` with empty fields left
out, a peer as the endpoint id the trace knows it by (else ``address#rank``), long strings and
lists cut, KVPoll numbers as names. Nothing here knows one output type from another, so new
inputs and outputs show without changes.
"""

from __future__ import annotations

import json
from typing import Any

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Fired
from pdflow.trace.follow import EndpointState, RoomChange, RoomOnEndpoint, StepView, StopState
from pdflow.trace.timeline import peer_key, transition_text

_STRING_CHARS = 160
_LIST_ITEMS = 8
_PEER_FIELDS = {"address", "incarnation", "rank"}
_KVPOLL_FIELDS = {"poll", "status"}
"""Fields that hold a KVPoll (a summary's and StatusChanged's poll, a status message's status)."""
_SUMMARY_HEAD = ("room", "generation", "state", "poll")
"""Fields of a room summary (sender or receiver) shown first, as ``room/generation STATE``."""


def compact(value: Any, names: dict[str, str]) -> str:
    """One line for any builtin value of a trace (an input, an output, a summary)."""
    if isinstance(value, dict):
        if set(value) == _PEER_FIELDS:
            key = peer_key(value["address"], value["incarnation"], value["rank"])
            return names.get(key, f"{value['address']}#{value['rank']}")
        fields = ", ".join(f"{key}={_field(key, item, names)}" for key, item in value.items()
                           if key != "type" and not _empty(item))  # fmt: skip
        return f"{value['type']}({fields})" if "type" in value else f"{{{fields}}}"
    if isinstance(value, list | tuple):  # to_builtins keeps a struct's tuples
        items = [compact(item, names) for item in value[:_LIST_ITEMS]]
        more = len(value) - _LIST_ITEMS
        return "[" + ", ".join(items) + (f", ... +{more}" if more > 0 else "") + "]"
    if isinstance(value, str):
        cut = value if len(value) <= _STRING_CHARS else value[:_STRING_CHARS] + "..."
        return json.dumps(cut)
    return json.dumps(value)


def step_lines(view: StepView, names: dict[str, str]) -> list[str]:
    lines = [f"{view.endpoint} seq {view.seq} t={view.t}: {compact(view.input, names)}"]
    if view.error is not None:
        lines.append(f"  refused  {view.error['kind']}: {view.error['message']}")
    for fired in view.fired:
        lines.append(f"  fired    {transition_text(Fired(**fired))} (key {fired['key']})")
    for output in view.outputs:
        lines.append(f"  out      {compact(output, names)}")
    lines.extend(f"  room     {change_text(change)}" for change in view.rooms)
    return lines


def change_text(change: RoomChange) -> str:
    """How the step changed one room's summary on its endpoint."""
    before, after = change.before, change.after
    if before is None and after is None:
        return f"{change.room}: not open here"
    if before is None:
        return f"{summary_text(after)} (opened)"
    if after is None:
        return f"{change.room}: removed (was {summary_text(before)})"
    if before == after:
        return f"{summary_text(after)} (unchanged)"
    head = f"{after['room']}/{after['generation']}"
    changes = [f"{key} {_field(key, before.get(key))} -> {_field(key, value)}"
               for key, value in after.items() if before.get(key) != value]  # fmt: skip
    return f"{head}: {'; '.join(changes)}"


def summary_text(summary: dict[str, Any] | None) -> str:
    """``7/1 TRANSFERRING poll=Transferring outstanding=1 ...`` (empty fields left out)."""
    if summary is None:
        return "-"
    rest = " ".join(f"{key}={_field(key, value)}" for key, value in summary.items()
                    if key not in _SUMMARY_HEAD and value not in (None, "", 0))  # fmt: skip
    head = f"{summary['room']}/{summary['generation']} {summary['state']}"
    return f"{head} poll={_field('poll', summary['poll'])}" + (f" {rest}" if rest else "")


def state_lines(state: StopState, names: dict[str, str], where: str) -> list[str]:
    """The replayed state of the followed rooms and endpoints, ``where`` replay stopped."""
    lines = [f"state {where}:"]
    for room, holders in state.rooms.items():
        lines.append(f"room {room}:")
        if not holders:
            lines.append("  no followed endpoint has held it yet")
        for holder in holders:
            lines.extend(_room_lines(holder, names))
    for endpoint in state.endpoints.values():
        lines.extend(_endpoint_lines(endpoint, names))
    return lines


def _room_lines(room: RoomOnEndpoint, names: dict[str, str]) -> list[str]:
    who = f"  {room.endpoint} ({room.role}): "
    if room.summary is None:
        seen = room.last_seen
        gone = (f"last seen at seq {seen.seq} t={seen.t} as {summary_text(seen.summary)}"
                if seen is not None else "never open here")  # fmt: skip
        lines = [f"{who}not open; {gone}"]
    else:
        timer = f", timer at {room.timer_at}" if room.timer_at is not None else ""
        lines = [f"{who}{summary_text(room.summary)}{timer}"]
    if room.writers:
        lines.append(f"    writers: {compact(room.writers, names)}")
    lines.extend(f"    draining: {summary_text(s)}" for s in room.draining)
    lines.extend(f"    pages: {_holding(h, names)}" for h in room.pages)
    lines.extend(f"    quarantined: {_quarantine(q, names)}" for q in room.quarantined)
    return lines


def _endpoint_lines(endpoint: EndpointState, names: dict[str, str]) -> list[str]:
    timer = f"next timer at {endpoint.timer_at}" if endpoint.timer_at is not None else "no timer"
    snapshot = dict(endpoint.snapshot)
    rooms, draining = snapshot.pop("rooms", []), snapshot.pop("draining", [])
    ledger = snapshot.pop("ledger", None)
    counters = snapshot.pop("counters", {})
    lines = [f"endpoint {endpoint.endpoint} ({endpoint.role}, {snapshot.pop('me', '')}): {timer}"]
    lines.append(f"  open rooms: {len(rooms)}")
    for summary in rooms:
        deadline = endpoint.room_timers.get(summary["room"])
        lines.append(f"    {summary_text(summary)}"
                     + (f", timer at {deadline}" if deadline is not None else ""))  # fmt: skip
    lines.extend(f"  draining: {summary_text(s)}" for s in draining)
    if ledger is not None:
        holdings = ledger.pop("rooms", [])
        lines.append(f"  pages: {compact(ledger, names)[1:-1]}")
        lines.extend(f"    {_holding(h, names)}" for h in holdings)
    lines.extend(f"  quarantined: {_quarantine(q, names)}" for q in endpoint.quarantined)
    rest = {key: value for key, value in snapshot.items() if not _empty(value) and value != 0}
    if rest:
        lines.append(f"  {compact(rest, names)[1:-1]}")
    if counters:
        lines.append(f"  counters: {', '.join(f'{k}={v}' for k, v in counters.items())}")
    return lines


def _holding(held: dict[str, Any], names: dict[str, str]) -> str:
    """One generation's pages in the decode's ledger."""
    fenced = f", fenced at t={held['fenced_at']}" if held.get("fenced_at") is not None else ""
    pages, writers = compact(held["pages"], names), compact(held["writers"], names)
    return (f"{held['room']}/{held['generation']} {held['state']} {pages} writers {writers} "
            f"acked {compact(held['acked'], names)}{fenced}")


def _quarantine(q: dict[str, Any], names: dict[str, str]) -> str:
    return (f"{q['room']}/{q['generation']} {len(q['pages'])} pages for {q['age_s']:.6g}s, "
            f"waiting on {compact(q['waiting_on'], names)}")


def _empty(value: Any) -> bool:
    return value is None or value == "" or (isinstance(value, list | tuple | dict) and not value)


def _field(key: str, value: Any, names: dict[str, str] | None = None) -> str:
    if key in _KVPOLL_FIELDS and isinstance(value, int):
        return KVPoll(value).name
    return value if isinstance(value, str) and key == "state" else compact(value, names or {})
