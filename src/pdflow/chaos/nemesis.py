"""The seeded nemesis: the whole fault schedule is drawn from the seed and written before the
run starts; then each fault is applied at its time and undone (healed) at its end.

Kinds (``--nemesis``): ``partition`` (a host's link down, then up), ``oneway`` (one host cannot
reach another, which still reaches it: see :mod:`pdflow.chaos.netns`), ``kill`` (kill -9 a
prefill instance, restart it with a new incarnation on the same addresses), ``pause``
(SIGSTOP a prefill or decode past the heartbeat window, the time a stopped process takes to be
declared dead, then SIGCONT),
``registry`` (kill -9 the standalone registry and restart it, empty) and ``slow`` (a
rate-limited link); and, only when named, ``pause_mid_write`` (a prefill stopped at the moment
it hands a write to a decode to the transport, so the write is still to land when the decode
declares it dead and lets its pages go; then SIGCONT). Faults do not overlap, so every one is
healed before the next begins. Each lasts its planned length from the moment it is in place
(a late start shifts its end, and the faults after it, rather than shortening it); the record
keeps the planned times (``fault.at``, ``fault.end``) and the actual ones. The schedule is drawn
over the kinds asked for whatever the network can do, so a seed gives one schedule everywhere; a
network fault the network cannot inject is skipped when it comes up, and recorded as skipped.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Awaitable, Callable, Sequence

import anyio
import msgspec
import structlog

from pdflow.chaos.netns import NETWORK_FAULTS, Network

log = structlog.get_logger("pdflow.chaos.nemesis")

KINDS = ("partition", "oneway", "kill", "pause", "registry", "slow")
"""The default kinds, in the default order (the order is part of the seed)."""
PAUSE_MID_WRITE = "pause_mid_write"
ALL_KINDS = (*KINDS, PAUSE_MID_WRITE)
"""What ``--nemesis`` accepts. ``pause_mid_write`` is left out of the default so that every
seed run before it existed keeps its schedule."""
MID_WRITE_WAIT_S = 3.0
"""How long an armed prefill may take to start a write to the decode before the fault gives up
(it is then not applied, and says so). Below the 4 s the schedule leaves after the last fault,
so a late stop still ends before the workload does."""


class Fault(msgspec.Struct, frozen=True):
    at: float
    duration: float
    kind: str
    target: str
    peer: str | None = None

    @property
    def end(self) -> float:
        return self.at + self.duration

    def describe(self) -> str:
        where = f"{self.target} -> {self.peer}" if self.peer else self.target
        return f"{self.kind} {where} for {self.duration:.1f}s"


class Applied(msgspec.Struct):
    """What became of one planned fault (times on the run's clock). ``started``: when it was in
    place (or, where ``error`` says it failed to apply, when the nemesis tried); ``healed``:
    when it was undone; the planned times are ``fault.at`` and ``fault.end``."""

    fault: Fault
    started: float | None = None
    healed: float | None = None
    error: str = ""
    heal_error: str = ""
    skipped: str = ""

    @property
    def applied(self) -> bool:
        return self.started is not None and not self.error and not self.skipped

    @property
    def late_s(self) -> float | None:
        return None if self.started is None else self.started - self.fault.at


def plan_faults(seed: int, duration_s: float, kinds: Sequence[str], prefills: Sequence[str],
                decodes: Sequence[str], heartbeat_window_s: float,
                warmup_s: float = 4.0, tail_s: float = 4.0) -> list[Fault]:  # fmt: skip
    """Non-overlapping faults from ``warmup_s`` until ``tail_s`` before the end."""
    rng = random.Random(f"nemesis-{seed}")
    faults: list[Fault] = []
    at = warmup_s
    while kinds:
        kind = rng.choice(list(kinds))
        peer = None
        if kind == "partition":
            target = rng.choice([*prefills, *decodes, "registry"])
            length = rng.uniform(2.0, 6.0)
        elif kind == "oneway":
            source_side, target_side = rng.choice([(prefills, decodes), (decodes, prefills)])
            target, peer = rng.choice(list(source_side)), rng.choice(list(target_side))
            length = rng.uniform(2.0, 6.0)
        elif kind == "kill":
            target, length = rng.choice(list(prefills)), rng.uniform(0.5, 3.0)
        elif kind == "pause":
            # Two prefill pauses for one decode pause: a writer declared dead while alive is
            # what a fence is for.
            target = rng.choice([*prefills, *prefills, *decodes])
            length = heartbeat_window_s * rng.uniform(1.3, 2.2)
        elif kind == PAUSE_MID_WRITE:
            target, peer = rng.choice(list(prefills)), rng.choice(list(decodes))
            length = heartbeat_window_s * rng.uniform(1.3, 2.2)
        elif kind == "registry":
            target, length = "registry", rng.uniform(0.5, 3.0)
        else:
            target, length = rng.choice([*prefills, *decodes]), rng.uniform(3.0, 8.0)
        if at + length > duration_s - tail_s:
            break
        faults.append(Fault(round(at, 3), round(length, 3), kind, target, peer))
        at += length + rng.uniform(1.0, 4.0)
    return faults


Restart = Callable[[str], Awaitable[None]]
Kill = Callable[[str], Awaitable[bool]]
"""kill -9 the named process; False when it was not running (nothing was killed)."""
Signal = Callable[[str, signal.Signals], bool]
"""Send a signal; False when the process was not running (nothing was sent)."""
PauseAtWrite = Callable[[str, str, float], Awaitable[bool]]
"""(prefill, decode, within_s): arm the prefill to stop itself inside its next write to the
decode; True once it is stopped, False if no such write began within ``within_s``."""


class NoWriteToPause(RuntimeError):
    """A ``pause_mid_write`` fault found no write to stop inside."""


class NotRunning(RuntimeError):
    """A process fault found its target not running (it died unplanned: the checker reports
    that as ``process_died``)."""


class Nemesis:
    """Applies a schedule. Process faults go through callbacks so the harness owns processes."""

    def __init__(self, schedule: Sequence[Fault], network: Network, kill: Kill,
                 restart: Restart, send_signal: Signal, pause_at_write: PauseAtWrite,
                 t0: float) -> None:  # fmt: skip
        self.applied = [Applied(fault) for fault in schedule]
        self.network = network
        self.kill, self.restart, self.send_signal = kill, restart, send_signal
        self.pause_at_write = pause_at_write
        self.t0 = t0

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def run(self) -> None:
        for applied in self.applied:
            fault = applied.fault
            if fault.at > self.now():
                await anyio.sleep(fault.at - self.now())
            if fault.kind in NETWORK_FAULTS and not self.network.can(fault.kind):
                applied.skipped = self.network.unavailable[fault.kind]
                log.info("fault_skipped", fault=fault.describe(), why=applied.skipped)
                continue
            in_place = False
            try:
                applied.started = self.now()
                await self._begin(fault)
                in_place = True
                # Its planned length runs from here (for pause_mid_write: from the stop).
                applied.started = self.now()
                log.info("fault_started", fault=fault.describe(), t=round(applied.started, 3))
                await anyio.sleep(fault.duration)
            except Exception as exc:
                applied.error = f"{type(exc).__name__}: {exc}"
                log.error("fault_failed", fault=fault.describe(), error=applied.error)
            finally:
                # A network fault that failed to apply left nothing to undo (the network cleans
                # up a half-applied one itself); a process is always resumed or restarted.
                if in_place or fault.kind not in NETWORK_FAULTS:
                    with anyio.CancelScope(shield=True):
                        await self._heal(fault, applied)

    async def _begin(self, fault: Fault) -> None:
        """Apply the fault; raises when it could not be."""
        if fault.kind == PAUSE_MID_WRITE:
            assert fault.peer is not None
            if not await self.pause_at_write(fault.target, fault.peer, MID_WRITE_WAIT_S):
                raise NoWriteToPause(f"{fault.target} began no write to {fault.peer} within "
                                     f"{MID_WRITE_WAIT_S:.0f}s of being armed; not paused")
        elif fault.kind == "partition":
            self.network.link_down(fault.target)
        elif fault.kind == "oneway":
            assert fault.peer is not None
            self.network.block_oneway(fault.target, fault.peer)
        elif fault.kind in ("kill", "registry"):
            if not await self.kill(fault.target):
                raise NotRunning(f"{fault.target} was not running; nothing was killed")
        elif fault.kind == "pause":
            if not self.send_signal(fault.target, signal.SIGSTOP):
                raise NotRunning(f"{fault.target} was not running; nothing was paused")
        elif fault.kind == "slow":
            self.network.slow(fault.target)

    async def _heal(self, fault: Fault, applied: Applied) -> None:
        try:
            if fault.kind == "partition":
                self.network.link_up(fault.target)
            elif fault.kind == "oneway":
                assert fault.peer is not None
                self.network.unblock_oneway(fault.target, fault.peer)
            elif fault.kind in ("kill", "registry"):
                await self.restart(fault.target)
            elif fault.kind in ("pause", PAUSE_MID_WRITE):
                self.send_signal(fault.target, signal.SIGCONT)
            elif fault.kind == "slow":
                self.network.unslow(fault.target)
        except Exception as exc:
            applied.heal_error = f"{type(exc).__name__}: {exc}"
            log.error("fault_heal_failed", fault=fault.describe(), error=applied.heal_error)
        applied.healed = self.now()
        log.info("fault_healed", fault=fault.describe(), t=round(applied.healed, 3))
