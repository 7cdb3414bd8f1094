"""The prefill side of the ``pause_mid_write`` fault: the process stops itself inside its writes.

A SIGSTOP sent from outside lands wherever the process happens to be; a chaos room's chunk is
a few KiB, written over Mooncake TCP in microseconds, so a paused prefill almost never has a
write of its own still to land, and whether it writes late after SIGCONT is left to the event
loop (whether its transfer-queue workers take a queued chunk before the ABORTs are read).
Armed with a decode's host, this transport holds the next writes to that decode at the moment
the node hands them over, before Mooncake has them or a byte is sent: the first, and every
other that begins within :data:`HOLD_S` of it (at most :data:`HOLD_MAX`), as a slow link
would; then it stops the whole process (SIGSTOP to itself, every thread). The node has counted
those writes as in flight, and nothing in pdflow runs differently from a pause that landed
there. After SIGCONT (sent by the harness) the held calls go on into Mooncake as they would
have: into freed memory if the decode's fence was a no-op, refused by the retired engine if
the decode rotated, into still-held pages if it waits for the drain ACK.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence

import anyio

from pdflow.chaos.agent_io import emit
from pdflow.transport.base import TransferOutcome, WriteOpLike
from pdflow.transport.mooncake import MooncakeTransport

HOLD_S = 0.1
"""How long the first held write waits for others before the process stops: a room's chunks
follow each other within milliseconds, so its later chunks (and the other rank's) are held too,
and the late write is several pages, not one that another room may have taken meanwhile."""
HOLD_MAX = 8


class _Hold:
    """The writes held for one stop."""

    def __init__(self, arming: int) -> None:
        self.arming = arming
        self.writes = self.ops = self.bytes = 0
        self.enough = anyio.Event()  # HOLD_MAX writes held: stop now
        self.resumed = anyio.Event()  # set after SIGCONT: every held write goes on

    def add(self, ops: Sequence[WriteOpLike]) -> None:
        self.writes += 1
        self.ops += len(ops)
        self.bytes += sum(op.length for op in ops)
        if self.writes >= HOLD_MAX:
            self.enough.set()


class WritePausingTransport(MooncakeTransport):
    """Mooncake TCP that, when armed, stops this process inside its next writes to one host."""

    armed: tuple[int, str] | None = None
    """(arming id, decode host) until the stop."""
    _hold: _Hold | None = None

    def arm(self, arming: int, host: str | None) -> None:
        """Stop inside the next writes to ``host``. None disarms and says so, unless a stop is
        under way (writes held): that stop's own event answers instead, as does one already
        made (its event came first)."""
        if host is not None:
            self.armed = (arming, host)
        elif self._hold is None:
            self.armed = None
            emit(event="write_pause_disarmed", id=arming)

    async def batch_write(self, peer_session_id: str,
                          ops: Sequence[WriteOpLike]) -> TransferOutcome:  # fmt: skip
        armed = self.armed
        if armed is not None and peer_session_id.rpartition(":")[0] == armed[1]:
            hold = self._hold
            if hold is None:
                self._hold = hold = _Hold(armed[0])
                hold.add(ops)
                await self._stop_after_holding(hold, peer_session_id)
            else:
                hold.add(ops)
                await hold.resumed.wait()
        return await super().batch_write(peer_session_id, ops)

    async def _stop_after_holding(self, hold: _Hold, session: str) -> None:
        with anyio.move_on_after(HOLD_S):
            await hold.enough.wait()
        self.armed, self._hold = None, None
        emit(event="paused_mid_write", id=hold.arming, session=session, writes=hold.writes,
             ops=hold.ops, bytes=hold.bytes, found_at=time.time())  # fmt: skip
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once the harness sends SIGCONT
        hold.resumed.set()
