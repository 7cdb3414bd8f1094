"""NodeMetrics' per-room calls skip repeated work (a cached labelled child, unchanged quarantine
gauges left alone) and still expose exactly what every call asked for."""

from __future__ import annotations

from pdflow.io.metrics import NodeMetrics, RoomReport


def _report(outcome: str) -> RoomReport:
    return RoomReport(role="decode", endpoint="e", room=1, generation=1, outcome=outcome,
                      latency_s=0.01, transfer_s=None, allocation_wait_s=None,
                      bytes_moved=None)  # fmt: skip


def test_rooms_are_counted_per_outcome() -> None:
    metrics = NodeMetrics("decode", "n")
    for outcome in ("success", "success", "failed", "success"):
        metrics.room_finished(_report(outcome))
    assert metrics.value("pdflow_rooms_total", {"outcome": "success"}) == 3
    assert metrics.value("pdflow_rooms_total", {"outcome": "failed"}) == 1


def test_quarantine_gauges_follow_every_change_of_each_value() -> None:
    metrics = NodeMetrics("decode", "n")

    def gauges() -> tuple[float, float, float]:
        return (metrics.value("pdflow_quarantined_pages"),
                metrics.value("pdflow_quarantine_oldest_age_seconds"),
                metrics.value("pdflow_quarantined_staging_bytes"))  # fmt: skip

    steps = [(0, 0.0, 0), (3, 0.5, 0), (3, 0.5, 0), (3, 0.7, 0), (3, 0.7, 64), (0, 0.0, 64),
             (0, 0.0, 0), (0, 0.0, 0)]  # fmt: skip
    for pages, age, staging in steps:
        metrics.quarantine(pages, age, staging)
        assert gauges() == (pages, age, staging)
