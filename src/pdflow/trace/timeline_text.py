"""`pdflow trace show` in the terminal: a bounded summary of rooms, then selected timelines.

Output never grows with the trace by default: the summary lists counts by outcome and at most
``limit`` rooms (failed and errored rooms first), and a detailed timeline is printed only for
rooms asked for with --room (or automatically when the trace has very few rooms).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text

from pdflow.trace.timeline import RoomEvent, RoomTimeline

AUTO_DETAIL_ROOMS = 3
_STYLE = {
    "open": "bold", "clear": "dim", "call": "cyan", "pages": "cyan", "recv": "blue",
    "send": "magenta", "transfer_start": "yellow", "transfer_done": "yellow", "timer": "bright_red",
    "transition": "green", "status": "bold green", "fence": "red", "freed": "dim green",
    "quarantined": "red", "removed": "dim", "dropped": "bright_black", "error": "bold red",
}  # fmt: skip
_OUTCOME_STYLE = {"Success": "green", "Failed": "red"}


def interesting_first(timelines: Iterable[RoomTimeline]) -> list[RoomTimeline]:
    """Rooms with refused inputs first, then failed ones, then the rest, each in room order."""
    return sorted(timelines, key=lambda r: (r.errors == 0, not r.failed, r.room))


def render_summary(
    console: Console, timelines: dict[int, RoomTimeline], endpoints: list[str], limit: int
) -> None:
    outcomes = Counter(r.outcome for r in timelines.values())
    errors = sum(1 for r in timelines.values() if r.errors)
    counts = ", ".join(f"{name}: {n}" for name, n in sorted(outcomes.items()))
    console.print(
        f"[bold]{len(timelines)} rooms[/] on {len(endpoints)} endpoints ({counts}); "
        f"{errors} with refused inputs"
    )
    shown = interesting_first(timelines.values())[:limit]
    labels = [f"{room.room}/{','.join(map(str, room.generations)) or '-'}"
              for room in shown]  # fmt: skip
    # The room id (what --room takes) and the outcome never shrink; on a narrow terminal the
    # per-endpoint columns give way, under headers short enough to tell the ranks apart.
    keep = {"room": max(map(len, ["room", *labels])),
            "outcome": max(len(room.outcome) for room in shown) if shown else 7}  # fmt: skip
    table = Table(show_edge=False, header_style="bold")
    for column in ("room", "outcome", *endpoints, "start", "duration", "events", "errors"):
        left = column in endpoints or column == "outcome"
        header = short_endpoint(column) if column in endpoints else column
        table.add_column(header, justify="left" if left else "right", no_wrap=True,
                         min_width=keep.get(column))  # fmt: skip
    for label, room in zip(labels, shown, strict=True):
        per_endpoint = [_endpoint_cell(room, name) for name in endpoints]
        table.add_row(
            label, Text(room.outcome, style=_OUTCOME_STYLE.get(room.outcome, "yellow")),
            *per_endpoint, f"{room.first_t:.4f}", _duration(room.last_t - room.first_t),
            str(len(room.events)), str(room.errors) if room.errors else "",
        )  # fmt: skip
    console.print(table)
    if len(timelines) > len(shown):
        console.print(
            f"[dim]{len(timelines) - len(shown)} more rooms not listed (failed and refused "
            "first); use --limit N, or --room R for one room's timeline[/]"
        )


def short_endpoint(endpoint: str) -> str:
    """``prefill-49cf00126055a1b2#1`` -> ``pre#1 49cf0012``: role and rank first, so a header
    cut on a narrow terminal still tells the ranks apart, then enough of the instance id."""
    name, hash_mark, rank = endpoint.rpartition("#")
    role, dash, instance = name.partition("-")
    if not hash_mark or not dash or len(instance) <= 8:
        return endpoint
    return f"{role[:3]}#{rank} {instance[:8]}"


def render_room(console: Console, room: RoomTimeline) -> None:
    console.rule(f"room {room.room}: {room.outcome}")
    table = Table(show_edge=False, header_style="bold", pad_edge=False)
    table.add_column("t", justify="right")
    table.add_column("endpoint")
    table.add_column("seq", justify="right")
    table.add_column("event")
    start = room.first_t
    for event in room.events:
        table.add_row(
            f"+{_duration(event.t - start)}", event.endpoint, str(event.seq), _event_text(event)
        )
    console.print(table)


def _event_text(event: RoomEvent) -> Text:
    text = Text(event.text, style=_STYLE.get(event.kind, ""))
    if event.msg_id and event.kind in ("send", "recv"):
        text.append(f"  [{event.msg_id}]", style="dim")
    return text


def _endpoint_cell(room: RoomTimeline, endpoint: str) -> Text:
    poll = room.final_poll.get(endpoint)
    if poll is None:
        return Text("-", style="dim")
    suffix = "" if endpoint in room.removed else " open"
    return Text(poll + suffix, style=_OUTCOME_STYLE.get(poll, "yellow"))


def _duration(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f}us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f}ms"
    return f"{seconds:.3f}s"
