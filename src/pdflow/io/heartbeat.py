"""The decode's heartbeat: probe each known prefill bootstrap's ``/health`` every interval.

The shell only reports what it saw (``HeartbeatResult(bootstrap, ok, incarnation)``); counting
consecutive failures and declaring an instance dead is the core's decision.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

import anyio
import structlog

from pdflow.core.endpoints.endpoint_io import HeartbeatResult
from pdflow.io.bootstrap_client import HealthStatus

log = structlog.get_logger("pdflow.heartbeat")

Probe = Callable[[str], Awaitable[HealthStatus]]
Deliver = Callable[[HeartbeatResult], Awaitable[None]]


async def probe_once(bootstraps: Iterable[str], probe: Probe, deliver: Deliver) -> None:
    """Probe every bootstrap concurrently and deliver each result as it comes."""

    async def one(bootstrap: str) -> None:
        status = await probe(bootstrap)
        if not status.ok:
            log.warning("heartbeat_failed", bootstrap=bootstrap, detail=status.detail[:200])
        await deliver(HeartbeatResult(bootstrap, status.ok, status.incarnation))

    async with anyio.create_task_group() as tasks:
        for bootstrap in sorted(set(bootstraps)):
            tasks.start_soon(one, bootstrap)


async def run_heartbeat(
    interval_s: float,
    bootstraps: Callable[[], Iterable[str]],
    probe: Probe,
    deliver: Deliver,
) -> None:
    """Forever: wait ``interval_s``, then probe whatever ``bootstraps()`` names now."""
    if interval_s <= 0:
        raise ValueError(f"heartbeat interval must be positive seconds, got {interval_s}")
    while True:
        await anyio.sleep(interval_s)
        await probe_once(bootstraps(), probe, deliver)
