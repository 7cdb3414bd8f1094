"""`pdflow trace show --html`: one self-contained page (inline CSS, JS and SVG; no network).

The page holds every room's events as compact JSON and draws only what is asked for: the room
list shows at most a few hundred rooms matching the filter box, and the swimlane diagram (one lane
per endpoint, time flowing down, arrows for messages) is drawn for the selected room only, so
traces with thousands of rooms stay responsive.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from pdflow.trace.timeline import RoomEvent, RoomTimeline

_TEMPLATE = Path(__file__).with_name("timeline_page.html")


def page_data(timelines: dict[int, RoomTimeline], endpoints: list[str], title: str) -> Any:
    lane = {name: index for index, name in enumerate(endpoints)}
    return {
        "title": title,
        "endpoints": endpoints,
        "rooms": [
            {
                "id": room.room,
                "outcome": room.outcome,
                "gens": room.generations,
                "polls": room.final_poll,
                "first": room.first_t,
                "last": room.last_t,
                "errors": room.errors,
                "events": [_event_row(e, lane) for e in room.events],
            }
            for room in timelines.values()
        ],
    }


def _event_row(event: RoomEvent, lane: dict[str, int]) -> list[Any]:
    """[t, lane, seq, kind, text, msg_id, peer lane] (compact: pages can hold 10^5 events)."""
    peer = lane.get(event.peer or "", -1)
    return [event.t, lane[event.endpoint], event.seq, event.kind, event.text, event.msg_id, peer]


def render_html(
    timelines: dict[int, RoomTimeline], endpoints: list[str], title: str, selected: int | None
) -> str:
    data = msgspec.json.encode(page_data(timelines, endpoints, title)).decode()
    # A "</script>" inside event text must not end the data block.
    data = data.replace("</", "<\\/")
    template = _TEMPLATE.read_text(encoding="utf-8")
    return (
        template.replace("__TITLE__", _escape(title))
        .replace("__SELECTED__", "null" if selected is None else str(selected))
        .replace("__DATA__", data)
    )


def write_html(
    path: Path, timelines: dict[int, RoomTimeline], endpoints: list[str], title: str,
    selected: int | None = None,
) -> None:  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(timelines, endpoints, title, selected), encoding="utf-8")


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
