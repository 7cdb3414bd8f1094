"""The per-room ``room_finished`` log line: written with every figure when INFO is on, and not
built at all when the configured level filters it out (a benchmark's setting)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import structlog
from structlog.testing import LogCapture

from pdflow.io.metrics import NodeMetrics, RoomReport

REPORT = RoomReport(role="decode", endpoint="d#0", room=7, generation=2, outcome="success",
                    latency_s=0.01, transfer_s=None, allocation_wait_s=0.002, bytes_moved=4096,
                    reason="")  # fmt: skip


@pytest.fixture
def saved_config() -> Iterator[None]:
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def capture(level: int) -> LogCapture:
    cap = LogCapture()
    wrapper = structlog.make_filtering_bound_logger(level)
    structlog.configure(processors=[cap], wrapper_class=wrapper)
    return cap


def test_room_finished_logs_every_figure_at_info(saved_config: None) -> None:
    cap = capture(logging.INFO)
    metrics = NodeMetrics("decode", "n1")
    metrics.room_finished(REPORT)
    assert cap.entries == [{
        "event": "room_finished", "log_level": "info", "node": "n1", "role": "decode",
        "endpoint": "d#0", "room": 7, "generation": 2, "outcome": "success", "latency_s": 0.01,
        "transfer_s": None, "allocation_wait_s": 0.002, "bytes_moved": 4096, "reason": "",
    }]  # fmt: skip
    assert metrics.value("pdflow_rooms_total", {"outcome": "success"}) == 1


def test_room_finished_counts_but_logs_nothing_when_info_is_filtered(saved_config: None) -> None:
    cap = capture(logging.WARNING)
    metrics = NodeMetrics("decode", "n1")
    metrics.room_finished(REPORT)
    assert cap.entries == []
    assert metrics.value("pdflow_rooms_total", {"outcome": "success"}) == 1
