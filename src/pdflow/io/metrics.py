"""Per-node metrics: Prometheus text from a private registry, plus one JSON log line per room.

Each node owns a :class:`NodeMetrics` with its own ``CollectorRegistry`` (never the global one),
so several nodes in one process never share or clash. A figure the transport could not measure
is left out of the histogram and logged as ``null``; it is never reported as 0.
"""

from __future__ import annotations

import logging

import msgspec
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = structlog.get_logger("pdflow.metrics")

# Whether each of structlog's filtering wrapper classes (make_filtering_bound_logger, one class
# per level) logs at a level; what `logs_at` answers without binding a logger.
_FILTERING_LEVELS = {
    structlog.make_filtering_bound_logger(level): level
    for level in (
        logging.NOTSET, logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR,
        logging.CRITICAL,
    )
}


def logs_at(level: int) -> bool:
    """Whether a line at ``level`` would be logged through a ``structlog.get_logger`` proxy now.

    Asking the proxy binds a logger first (a logger, its context and its wrapper built on every
    call, about 3 us): under structlog's filtering wrappers (its default, and what the nodes'
    benchmarks set) the configured wrapper class alone answers. Under any other wrapper class
    the bound logger is asked, as before."""
    wrapper = structlog.get_config()["wrapper_class"]
    min_level = _FILTERING_LEVELS.get(wrapper)
    if min_level is not None:
        return level >= min_level
    enabled: bool = log.bind().is_enabled_for(level)
    return enabled


_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                    10, 30, 60)  # fmt: skip


class RoomReport(msgspec.Struct, frozen=True):
    """How one room went on one endpoint; ``None`` where nothing was measured."""

    role: str
    endpoint: str
    room: int
    generation: int
    outcome: str
    latency_s: float | None
    """Open to terminal status, as this endpoint saw it."""
    transfer_s: float | None
    """Time the transport spent writing this room's KV (prefill; transport-measured)."""
    allocation_wait_s: float | None
    """Decode: from WaitingForInput until the engine published pages."""
    bytes_moved: int | None
    reason: str = ""


class NodeMetrics:
    def __init__(self, role: str, node: str) -> None:
        self.role = role
        self.node = node
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rooms = Counter("pdflow_rooms", "Rooms finished, by outcome", ["outcome"], registry=r)
        # The child per outcome, looked up once: `labels()` validates, builds a key and takes
        # the metric's lock on every call, once per room (it returns the same child each time).
        self._rooms_by_outcome: dict[str, Counter] = {}
        # What the quarantine gauges were last set to (they start at 0): each set takes a lock.
        self._quarantine_set: tuple[int, float, int] = (0, 0.0, 0)
        self.room_latency = Histogram("pdflow_room_latency_seconds",
                                      "Room open to terminal status", buckets=_LATENCY_BUCKETS,
                                      registry=r)  # fmt: skip
        self.transfer_seconds = Histogram("pdflow_room_transfer_seconds",
                                          "Transport time per room (when measured)",
                                          buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.allocation_wait = Histogram("pdflow_allocation_wait_seconds",
                                         "Decode wait for destination pages",
                                         buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.bytes_moved = Counter("pdflow_bytes_moved", "KV bytes confirmed written", registry=r)
        self.dropped_frames = Counter("pdflow_dropped_frames", "Control frames dropped",
                                      ["reason"], registry=r)  # fmt: skip
        self.core_dropped = Counter("pdflow_core_dropped", "Messages the core refused",
                                    ["kind"], registry=r)  # fmt: skip
        self.send_failures = Counter(
            "pdflow_control_send_failures", "Control messages that could not be queued", registry=r
        )
        self.refused_sends = Counter(
            "pdflow_control_refused_sends", "Control messages refused before sending (bad "
            "address, failed connect, oversized)", ["reason"], registry=r,
        )  # fmt: skip
        self.evictions = Counter(
            "pdflow_control_evictions", "Least recently used entries closed at a limit",
            ["what"], registry=r,
        )  # fmt: skip
        self.heartbeat_failures = Counter(
            "pdflow_heartbeat_failures", "Failed /health probes, by the address probed (an "
            "instance's own health endpoint, or the registry)", ["bootstrap"], registry=r,
        )  # fmt: skip
        self.readmitted = Counter(
            "pdflow_writers_readmitted", "Prefill writers wrongly declared dead that answered "
            "again, drained and were readmitted", registry=r,
        )  # fmt: skip
        self.superseded = Counter(
            "pdflow_prefill_superseded", "Prefill incarnations replaced by another one (never "
            "readmitted)", registry=r,
        )  # fmt: skip
        self.step_errors = Counter("pdflow_step_errors", "Shell inputs the core refused",
                                   ["input"], registry=r)  # fmt: skip
        self.quarantined_pages = Gauge("pdflow_quarantined_pages",
                                       "Decode pages held until their writers are cleared",
                                       registry=r)  # fmt: skip
        self.admission_queued = Gauge(
            "pdflow_admission_queued", "Decode requests waiting for admission", registry=r
        )
        self.admission_admitted = Gauge(
            "pdflow_admission_admitted",
            "Decode requests admitted and not yet finished (their pages are counted)", registry=r,
        )  # fmt: skip
        self.session_rotations = Counter(
            "pdflow_session_rotations", "Decode transport engines rotated and retired (fence by "
            "engine rotation), by what asked", ["reason"], registry=r,
        )  # fmt: skip
        self.rotation_released_pages = Counter(
            "pdflow_rotation_released_pages", "Quarantined pages released by retiring an engine",
            registry=r,
        )
        self.quarantine_oldest_age = Gauge(
            "pdflow_quarantine_oldest_age_seconds", "Age of the oldest quarantined room", registry=r
        )
        self.quarantined_staging_bytes = Gauge(
            "pdflow_quarantined_staging_bytes",
            "Decode staging-ring bytes held by quarantined rooms until their writers are cleared",
            registry=r,
        )

    def room_finished(self, report: RoomReport) -> None:
        rooms = self._rooms_by_outcome.get(report.outcome)
        if rooms is None:
            rooms = self._rooms_by_outcome[report.outcome] = self.rooms.labels(report.outcome)
        rooms.inc()
        if report.latency_s is not None:
            self.room_latency.observe(report.latency_s)
        if report.transfer_s is not None:
            self.transfer_seconds.observe(report.transfer_s)
        if report.allocation_wait_s is not None:
            self.allocation_wait.observe(report.allocation_wait_s)
        if report.bytes_moved:
            self.bytes_moved.inc(report.bytes_moved)
        # One line per room; a benchmark filters it out, and then it should cost one level
        # check (no logger bound) rather than the report's dict and the filtered call (the
        # decode loop's hot path).
        if logs_at(logging.INFO):
            log.info("room_finished", node=self.node, **msgspec.structs.asdict(report))

    def frame_dropped(self, reason: str) -> None:
        self.dropped_frames.labels(reason).inc()

    def send_refused(self, reason: str) -> None:
        self.refused_sends.labels(reason).inc()

    def quarantine(self, pages: int, oldest_age_s: float, staging_bytes: int = 0) -> None:
        """Set the quarantine gauges (pages and staging bytes summed over the node's ranks by
        the caller)."""
        values = (pages, oldest_age_s, staging_bytes)
        if values == self._quarantine_set:
            return  # called on every released room; mostly nothing is quarantined and nothing moved
        self._quarantine_set = values
        self.quarantined_pages.set(pages)
        self.quarantine_oldest_age.set(oldest_age_s)
        self.quarantined_staging_bytes.set(staging_bytes)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample's current value (0.0 when never touched), for tests and status lines."""
        found = self.registry.get_sample_value(name, labels or {})
        return 0.0 if found is None else found

    def text(self) -> str:
        """Prometheus exposition text of this node's metrics."""
        return generate_latest(self.registry).decode()
