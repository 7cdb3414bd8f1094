"""CPU per room of two calls the decode's loop thread makes once per room (seventh pass, issue
15): ``NodeMetrics.room_finished`` with INFO filtered (the suite's drivers' setting) and one
room's ``RoomBook`` writes. Compare trees side by side:
``PYTHONPATH=TREE/src python -m benchmarks.decode_bookkeeping`` for each, alternating."""

from __future__ import annotations

import logging
import resource
from collections.abc import Callable

import structlog

import pdflow
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.io.metrics import NodeMetrics, RoomReport
from pdflow.io.node_common import PagesReleased, RoomClosed, RoomStatus
from pdflow.sglang.rooms import RoomBook

CALLS = 20_000
REPORT = RoomReport(role="decode", endpoint="d#0", room=1, generation=1, outcome="success",
                    latency_s=0.01, transfer_s=None, allocation_wait_s=0.001, bytes_moved=4096,
                    reason="")  # fmt: skip


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def room_finished() -> None:
    metrics = NodeMetrics("decode", "d")
    for _ in range(CALLS):
        metrics.room_finished(REPORT)


def room_book() -> None:
    book = RoomBook()
    for room in range(CALLS):
        book.start(room)
        for poll in (KVPoll.WaitingForInput, KVPoll.Transferring, KVPoll.Success):
            book.apply(RoomStatus(0, room, 1, poll, ""))
        book.apply(PagesReleased(0, room, 1, (1, 2)))
        book.apply(RoomClosed(0, room, 1))
        book.forget(room)


def best_us_per_call(run: Callable[[], None], tries: int = 5) -> float:
    best = float("inf")
    for _ in range(tries):
        start = cpu_s()
        run()
        best = min(best, cpu_s() - start)
    return best / CALLS * 1e6


def main() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    tree = pdflow.__file__.rsplit("/src/", 1)[0]
    for name, run in (("room_finished", room_finished), ("room_book_one_room", room_book)):
        print(f"{tree} {name}: {best_us_per_call(run):.2f} us CPU per room")


if __name__ == "__main__":
    main()
