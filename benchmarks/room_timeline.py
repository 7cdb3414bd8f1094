"""Where one room's time goes in `pdflow_vs_raw`: perf_counter marks from the last
``send_chunk`` to the decode's Success, per room, and the median of each step between marks.

It runs `pdflow_vs_raw` itself (both nodes in this process, Mooncake TCP on loopback, structlog
below WARNING off as `pdflow bench` runs it) with the nodes' methods wrapped to stamp a mark on
entry and exit: each endpoint step and its core ``handle``, each output carried out, the
transfer job, the planner, the transport's write and its worker-thread part, each engine
submit and each op seen completed, each control message sent and received, each room status
published, each deferred trace batch written. The marks cost about 1 us each, so the total runs
a little above the benchmark's. Each room's total is also split at its first engine submit and
its last op seen completed: before the wire, on the wire (what the raw engine's time compares
with) and after it; and the rooms in which a deferred trace batch was written are counted per
part (those writes are left out of the step order, their time stays in the step they fell in).

    python -m benchmarks.room_timeline --size-mib 1 --rooms 40

Rooms whose marks came in another order than most rooms' are counted and left out.
"""

from __future__ import annotations

import argparse
import collections
import functools
import inspect
import itertools
import json
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import structlog

import benchmarks.pdflow_vs_raw as bench
from pdflow.io import control, node_common, node_decode, node_prefill
from pdflow.trace import recorder
from pdflow.transport import mooncake

Mark = tuple[str, float]
TRACE_WRITE = "trace write"


class Marks:
    """The marks of the room being measured (on from send_chunk until the decode's Success)."""

    def __init__(self) -> None:
        self.on = False
        self.current: list[Mark] = []
        self.rooms: list[list[Mark]] = []

    def __call__(self, label: str) -> None:
        if self.on:
            self.current.append((label, time.perf_counter()))


def _around(marks: Marks, owner: Any, name: str, label: Callable[..., str] | str) -> None:
    """Wrap ``owner.name`` (sync or async) to mark ``label>`` on entry and ``label<`` on exit."""
    original = getattr(owner, name)
    name_of = label if callable(label) else (lambda *args, **kwargs: label)

    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def wrapped_async(*args: Any, **kwargs: Any) -> Any:
            tag = name_of(*args, **kwargs)
            marks(tag + ">")
            try:
                return await original(*args, **kwargs)
            finally:
                marks(tag + "<")

        setattr(owner, name, wrapped_async)
    else:

        @functools.wraps(original)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            tag = name_of(*args, **kwargs)
            marks(tag + ">")
            try:
                return original(*args, **kwargs)
            finally:
                marks(tag + "<")

        setattr(owner, name, wrapped)


def _step_label(host: Any, inp: Any) -> str:
    role = host.endpoint_id.split("-", 1)[0]
    kind = type(getattr(inp, "call", inp)).__name__  # a RoomCall: the engine call inside
    if kind == "Received":
        kind = "received " + type(inp.message).__name__
    return f"{role} step {kind}"


class _Engine:
    """The transport's engine, marking each submit and each op it reports completed."""

    def __init__(self, engine: Any, marks: Marks) -> None:
        self._engine = engine
        self._marks = marks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def transfer_submit_write(self, *args: Any) -> Any:
        handle = self._engine.transfer_submit_write(*args)
        self._marks("engine submit")
        return handle

    def transfer_check_status(self, handle: int) -> Any:
        status = self._engine.transfer_check_status(handle)
        if status == 1:
            self._marks("engine op completed")
        return status


def instrument(marks: Marks) -> None:
    """Wrap the nodes' methods in this process (for the measurement run only)."""
    _around(marks, node_common.EndpointHost, "_drive", _step_label)
    host_init = node_common.EndpointHost.__init__

    def init_host(host: Any, *args: Any, **kwargs: Any) -> None:
        host_init(host, *args, **kwargs)
        endpoint, dispatch = host.endpoint, host._dispatch

        class Timed:
            def __getattr__(self, name: str) -> Any:
                return getattr(endpoint, name)

            def handle(self, inp: Any, now: float) -> Any:
                marks("core handle>")
                try:
                    return endpoint.handle(inp, now)
                finally:
                    marks("core handle<")

        def timed_dispatch(output: Any, msg_id: str | None) -> Any:
            # An effect is done when it returns None, else when what it returned is awaited.
            tag = "output " + type(output).__name__
            marks(tag + ">")
            try:
                pending = dispatch(output, msg_id)
            except BaseException:
                marks(tag + "<")
                raise
            if pending is None:
                marks(tag + "<")
                return None

            async def finish() -> None:
                try:
                    await pending
                finally:
                    marks(tag + "<")

            return finish()

        host.endpoint, host._dispatch = Timed(), timed_dispatch

    node_common.EndpointHost.__init__ = init_host  # type: ignore[method-assign]
    write_pending = recorder.TraceRecorder.write_pending

    def marked_write(trace: Any) -> None:
        if not trace._pending:  # nothing deferred: no batch written
            write_pending(trace)
            return
        marks(TRACE_WRITE + ">")
        try:
            write_pending(trace)
        finally:
            marks(TRACE_WRITE + "<")

    recorder.TraceRecorder.write_pending = marked_write  # type: ignore[method-assign]
    _around(marks, node_prefill.PrefillNode, "transfer", "transfer job")
    _around(marks, node_prefill.TransferPlanner, "plan", "plan")
    _around(marks, mooncake.MooncakeTransport, "_engine_write", "transport write")
    # A small call (up to 1 MiB in up to 8 ops) is polled on the loop inside "polled write";
    # a worker job's small ops inside "settle"; a larger job (or what is left of a small call
    # after the loop's polling time) goes on to the "worker thread".
    _around(marks, mooncake.MooncakeTransport, "_write_polled", "polled write")
    _around(marks, mooncake.MooncakeTransport, "_settle", "settle")
    _around(marks, mooncake.MooncakeTransport, "_write_settled", "worker thread")
    _around(marks, control.ControlChannel, "send_soon",
            lambda channel, address, message, msg_id: "send " + type(message).__name__)  # fmt: skip

    channel_init = control.ControlChannel.__init__

    def init_channel(channel: Any, *args: Any, **kwargs: Any) -> None:
        channel_init(channel, *args, **kwargs)
        codec, decode = channel.codec, channel.codec.decode

        class Receiving:
            def __getattr__(self, name: str) -> Any:
                return getattr(codec, name)

            def decode(self, frames: Any) -> Any:
                marks("received")
                return decode(frames)

        channel.codec = Receiving()

    control.ControlChannel.__init__ = init_channel  # type: ignore[method-assign]

    publish = node_common.EventHub.publish

    def publishing(hub: Any, event: Any) -> None:
        if isinstance(event, node_common.RoomStatus):
            marks("publish " + event.poll.name)
        publish(hub, event)

    node_common.EventHub.publish = publishing  # type: ignore[method-assign]

    transport_open = mooncake.MooncakeTransport.open.__func__  # type: ignore[attr-defined]

    def open_marked(cls: Any, config: Any = None) -> Any:
        transport = transport_open(cls, config)
        transport._engine = _Engine(transport._engine, marks)
        return transport

    mooncake.MooncakeTransport.open = classmethod(open_marked)  # type: ignore[assignment]

    send_chunk = node_prefill.PrefillRank.send_chunk

    async def first_mark(rank: Any, *args: Any, **kwargs: Any) -> None:
        marks.on, marks.current = True, []
        marks("send_chunk called")
        await send_chunk(rank, *args, **kwargs)

    node_prefill.PrefillRank.send_chunk = first_mark  # type: ignore[method-assign]
    wait = node_decode.DecodeRank.wait

    async def last_mark(rank: Any, room: int, *, terminal: bool = False) -> Any:
        status = await wait(rank, room, terminal=terminal)
        if terminal and marks.on:
            marks("decode wait returned")
            marks.on = False
            marks.rooms.append(marks.current)
        return status

    node_decode.DecodeRank.wait = last_mark  # type: ignore[method-assign]


def _parts(room: list[Mark]) -> tuple[float, float, float] | None:
    """(before, on, after) the wire in ms: split at the first engine submit and the last op
    seen completed; None for a room with neither mark."""
    submits = [t for label, t in room if label == "engine submit"]
    completed = [t for label, t in room if label == "engine op completed"]
    if not submits or not completed:
        return None
    start, first, last, end = room[0][1], submits[0], completed[-1], room[-1][1]
    return (first - start) * 1e3, (last - first) * 1e3, (end - last) * 1e3


def summarise(rooms: list[list[Mark]]) -> dict[str, Any]:
    """The median of each step between consecutive marks, over the rooms of the usual order;
    the medians of each room's parts before, on and after the wire; and in how many rooms a
    deferred trace batch was written in each part."""
    steps_of = [[mark for mark in room if not mark[0].startswith(TRACE_WRITE)] for room in rooms]
    orders = collections.Counter(tuple(label for label, _ in room) for room in steps_of)
    usual, count = orders.most_common(1)[0]
    steps: list[list[float]] = [[] for _ in usual[1:]]
    totals = []
    parts: list[tuple[float, float, float]] = []
    trace_rooms = {"before": 0, "wire": 0, "after": 0}
    for room, marked in zip(steps_of, rooms, strict=True):
        if tuple(label for label, _ in room) != usual:
            continue
        for index, ((_, start), (_, end)) in enumerate(itertools.pairwise(room)):
            steps[index].append((end - start) * 1e3)
        totals.append((room[-1][1] - room[0][1]) * 1e3)
        split = _parts(room)
        if split is None:
            continue
        parts.append(split)
        first = room[0][1] + split[0] / 1e3
        last = first + split[1] / 1e3
        writes = [t for label, t in marked if label == TRACE_WRITE + ">"]
        trace_rooms["before"] += any(t < first for t in writes)
        trace_rooms["wire"] += any(first <= t <= last for t in writes)
        trace_rooms["after"] += any(t > last for t in writes)
    rows = [
        {"from": usual[index], "to": usual[index + 1], "median_ms": statistics.median(values)}
        for index, values in enumerate(steps)
    ]
    medians = [statistics.median(part) for part in zip(*parts, strict=True)] if parts else []
    return {"rooms": count, "left_out": len(rooms) - count, "steps": rows,
            "total_median_ms": statistics.median(totals),
            "parts_median_ms": dict(zip(("before", "wire", "after"), medians, strict=True)),
            "rooms_with_trace_writes": trace_rooms}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=1)
    parser.add_argument("--rooms", type=int, default=40)
    parser.add_argument("--json", help="also write the timeline to this file")
    parser.add_argument(
        "--no-trace", action="store_true", help="trace recorder off (pdflow_vs_raw keeps it on)"
    )
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    if args.no_trace:
        settings = bench.load_settings
        bench.load_settings = lambda **kw: settings(**{**kw, "env": {"PDFLOW_TRACE": "0"}})
    marks = Marks()
    instrument(marks)
    result = bench.run(args.size_mib * bench.MIB, args.rooms, progress=print)
    timeline = summarise(marks.rooms[1:])  # the first room is the warm-up
    timeline["pdflow_vs_raw"] = result
    timeline["trace"] = not args.no_trace
    print(f"{timeline['rooms']} rooms ({timeline['left_out']} in another order left out)")
    running = 0.0
    for row in timeline["steps"]:
        running += row["median_ms"]
        print(f"{row['from']:34} -> {row['to']:34} {row['median_ms']:7.3f} ms  {running:7.3f}")
    print(f"median total {timeline['total_median_ms']:.3f} ms (sum of medians {running:.3f})")
    parts, traced = timeline["parts_median_ms"], timeline["rooms_with_trace_writes"]
    if parts:
        print(
            f"per room, medians: before the wire {parts['before']:.3f} ms, on the wire "
            f"{parts['wire']:.3f}, after it {parts['after']:.3f}"
        )
    print(
        f"rooms with a deferred trace batch written before the wire {traced['before']}, on "
        f"it {traced['wire']}, after it {traced['after']}"
    )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(timeline, out, indent=2)


if __name__ == "__main__":
    main()
