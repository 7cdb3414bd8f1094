"""The decode's heartbeat: probe every target the decode endpoints name, every interval.

A target is a prefill instance's own health endpoint (a PrefillNode serves one and registers
its address), or the registry's ``/health`` for a prefill that registered none (SGLang). Lost
instances stay targets, so one that was only paused is seen answering again. The shell only
reports what it saw (``HeartbeatResult``); counting failures, declaring an instance dead and
readmitting it are the core's decisions.

Targets are probed concurrently and each result is delivered as it comes, so one slow target
never holds back another's: each target is probed every interval unless its last probe is still
running (a paused process's probe waits out the client's whole read timeout, 3 s by default;
waiting for it before probing anyone again made a dead prefill beside a paused one take 6.4 s,
not 1 s, to be noticed). Each probe has a deadline (``PROBE_DEADLINE_S``; the client's own probe
gives up sooner, at its connect + read budget): one that overruns it is a failed probe.

A target with its own health address is a pdflow prefill, whose every answer carries its
incarnation (``X-Pdflow-Incarnation``). A 200 without it came from some other server (one that
took a dead prefill's port, say) and speaks for no prefill: it is a failed probe, or that server
would keep the dead prefill alive for ever. Only the registry's ``/health`` (SGLang's, for ranks
that registered no health address) may answer without one.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable

import anyio
import structlog

from pdflow.core.endpoints.endpoint_io import HeartbeatResult
from pdflow.core.endpoints.liveness import ProbeTarget
from pdflow.io.bootstrap_client import INCARNATION_HEADER, HealthStatus

log = structlog.get_logger("pdflow.heartbeat")

Probe = Callable[[ProbeTarget], Awaitable[HealthStatus]]
Deliver = Callable[[HeartbeatResult], Awaitable[None]]

PROBE_DEADLINE_S = 10.0
"""The most one probe may take, whatever the probe does (BootstrapClient.health gives up at
its own budget, 5 s by default): past it the target is reported down."""


REPEAT_LOG_S = 60.0
"""A target failing probe after probe is logged (``heartbeat_failed``) at its first failure,
then at most once per this many seconds, with how many failures went unlogged meanwhile."""


class FailureLog:
    """``heartbeat_failed`` lines, rate-limited per target: a lost prefill is probed every
    interval until it is given up (``lost_instance_forget``), and logged each time it flooded
    the log with one line per interval."""

    def __init__(self, every_s: float = REPEAT_LOG_S,
                 clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.every_s = every_s
        self._clock = clock
        self._streaks: dict[ProbeTarget, tuple[float, int]] = {}
        """Per failing target: when its failure was last logged, and failures since."""

    def failed(self, target: ProbeTarget, detail: str) -> None:
        now = self._clock()
        streak = self._streaks.get(target)
        if streak is not None and now - streak[0] < self.every_s:
            self._streaks[target] = (streak[0], streak[1] + 1)
            return
        self._streaks[target] = (now, 0)
        log.warning("heartbeat_failed", bootstrap=target.bootstrap, health=target.health,
                    detail=detail[:200], unlogged_since=streak[1] if streak else 0)  # fmt: skip

    def answered(self, target: ProbeTarget) -> None:
        self._streaks.pop(target, None)

    def keep_only(self, targets: set[ProbeTarget]) -> None:
        """Forget the streaks of targets no longer probed."""
        for gone in self._streaks.keys() - targets:
            del self._streaks[gone]


async def probe_and_deliver(target: ProbeTarget, probe: Probe, deliver: Deliver,
                            deadline_s: float = PROBE_DEADLINE_S,
                            failures: FailureLog | None = None) -> None:  # fmt: skip
    """Probe one target within ``deadline_s`` and deliver what it answered (down if nothing);
    a failure is logged through ``failures`` (every one, without it)."""
    status = HealthStatus(False, None, f"no answer within the probe's deadline of {deadline_s:g}s")
    with anyio.move_on_after(deadline_s):
        status = await probe(target)
    if status.ok and status.incarnation is None and target.health is not None:
        status = HealthStatus(False, None, f"{target.health} answered 200 without the "
                              f"{INCARNATION_HEADER} header: not a pdflow prefill's health "
                              "endpoint (did another server take the port of a dead one?)")
    failures = failures if failures is not None else FailureLog(every_s=0.0)
    if status.ok:
        failures.answered(target)
    else:
        failures.failed(target, status.detail)
    await deliver(HeartbeatResult(target.bootstrap, status.ok, status.incarnation,
                                  target.health))  # fmt: skip


async def probe_once(
    targets: Iterable[ProbeTarget],
    probe: Probe,
    deliver: Deliver,
    deadline_s: float = PROBE_DEADLINE_S,
) -> None:
    """Probe every target concurrently and deliver each result as it comes."""
    async with anyio.create_task_group() as tasks:
        for target in sorted(set(targets)):
            tasks.start_soon(probe_and_deliver, target, probe, deliver, deadline_s)


async def run_heartbeat(
    interval_s: float,
    targets: Callable[[], Iterable[ProbeTarget]],
    probe: Probe,
    deliver: Deliver,
    deadline_s: float = PROBE_DEADLINE_S,
) -> None:
    """Forever: every ``interval_s``, probe each target ``targets()`` names now whose last probe
    has ended; a target still being probed is left for a later tick, not waited for."""
    if interval_s <= 0:
        raise ValueError(f"heartbeat interval must be positive seconds, got {interval_s}")
    if deadline_s <= 0:
        raise ValueError(f"probe deadline must be positive seconds, got {deadline_s}")
    probing: set[ProbeTarget] = set()
    failures = FailureLog()

    async def probe_one(target: ProbeTarget) -> None:
        try:
            await probe_and_deliver(target, probe, deliver, deadline_s, failures)
        finally:
            probing.discard(target)

    async with anyio.create_task_group() as tasks:
        while True:
            await anyio.sleep(interval_s)
            now_probed = set(targets())
            failures.keep_only(now_probed | probing)
            for target in sorted(now_probed - probing):
                probing.add(target)
                tasks.start_soon(probe_one, target)
