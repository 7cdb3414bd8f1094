"""In-process transport: engines in one process, bytes moved with memmove.

An `InProcessFabric` is the "network": it maps session ids to engines. A write is checked
against the registered buffers of both sides before any byte moves, so a bad destination fails
the whole batch cleanly instead of corrupting memory. The fabric also carries the explicit test
hooks (`fail_next_writes`, `hold_writes`); nothing else injects faults.

Fencing: the copy itself runs synchronously on the event loop, so a write is either finished
or not started; the only way a write can be "in flight" is while it waits on a test hold.
`close_session` (sender side) waits for those. `fence` (receiver side) is real: the fabric
records (receiver, writer) and checks it when a write lands, after any hold, so a fenced
writer's write that was already in flight is refused when it is released. Every write is
numbered when it is issued; `lift_fence` lets only writes numbered after it land again.
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections.abc import Sequence

import anyio

from pdflow.transport.base import TransferOutcome
from pdflow.transport.guarded import CheckedWrite, GuardedTransport


class _FailurePlan:
    """The next `count` writes to a peer fail after landing their first `land_ops` ops."""

    def __init__(self, count: int, land_ops: int, message: str) -> None:
        self.count = count
        self.land_ops = land_ops
        self.message = message


class WriteHold:
    """Test hook: writes to one peer wait here, already in flight, until `release()`."""

    def __init__(self) -> None:
        self._released = anyio.Event()
        self._arrived = anyio.Event()
        self.waiting = 0

    def release(self) -> None:
        self._released.set()

    async def wait_for_writer(self) -> None:
        """Return once at least one write is blocked on this hold."""
        await self._arrived.wait()

    async def _block(self) -> None:
        self.waiting += 1
        self._arrived.set()
        try:
            await self._released.wait()
        finally:
            self.waiting -= 1


class InProcessFabric:
    """Registry of in-process engines, addressed by session ids "inproc:N"."""

    def __init__(self, *, receiver_fence: bool = True) -> None:
        # receiver_fence=False models a transport that cannot fence on the receiving side
        # (Mooncake today), so a node's quarantine-until-ACK path runs without one.
        self.receiver_fence = receiver_fence
        self._engines: dict[str, InProcessTransport] = {}
        self._numbers = itertools.count(1)
        self._failures: dict[str, _FailurePlan] = {}
        self._holds: dict[str, WriteHold] = {}
        # (receiver, writer) -> None while fenced, else the first write number allowed again
        self._fences: dict[tuple[str, str], int | None] = {}
        self._issued = itertools.count()

    def create_transport(self) -> InProcessTransport:
        session_id = f"inproc:{next(self._numbers)}"
        engine = InProcessTransport(self, session_id)
        self._engines[session_id] = engine
        return engine

    def engine(self, session_id: str) -> InProcessTransport | None:
        return self._engines.get(session_id)

    def _remove(self, session_id: str) -> None:
        self._engines.pop(session_id, None)

    def _fence(self, receiver: str, writer: str) -> None:
        self._fences[(receiver, writer)] = None

    def _lift_fence(self, receiver: str, writer: str) -> None:
        if (receiver, writer) in self._fences:
            self._fences[(receiver, writer)] = next(self._issued)

    def _issue(self) -> int:
        return next(self._issued)

    def _refuses(self, receiver: str, writer: str, issued: int) -> bool:
        if (receiver, writer) not in self._fences:
            return False
        allowed_from = self._fences[(receiver, writer)]
        return allowed_from is None or issued < allowed_from

    # -- test hooks ----------------------------------------------------------------------

    def fail_next_writes(
        self,
        peer_session_id: str,
        count: int = 1,
        *,
        land_ops: int = 0,
        message: str = "injected failure",
    ) -> None:
        """Make the next `count` writes to the peer fail, each after landing `land_ops` ops."""
        if count <= 0 or land_ops < 0:
            raise ValueError(f"need count > 0 and land_ops >= 0, got {count=} {land_ops=}")
        self._failures[peer_session_id] = _FailurePlan(count, land_ops, message)

    def hold_writes(self, peer_session_id: str) -> WriteHold:
        """Make writes to the peer block (counted in flight) until the hold is released."""
        hold = WriteHold()
        self._holds[peer_session_id] = hold
        return hold

    def clear_hooks(self) -> None:
        """Remove every injected failure and release every hold."""
        self._failures.clear()
        for hold in self._holds.values():
            hold.release()
        self._holds.clear()

    def _take_failure(self, peer_session_id: str) -> _FailurePlan | None:
        plan = self._failures.get(peer_session_id)
        if plan is None:
            return None
        plan.count -= 1
        if plan.count == 0:
            del self._failures[peer_session_id]
        return plan


class InProcessTransport(GuardedTransport):
    """One engine on an `InProcessFabric`; create it with `fabric.create_transport()`."""

    def __init__(self, fabric: InProcessFabric, session_id: str) -> None:
        super().__init__()
        self._fabric = fabric
        self._session_id = session_id

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def fence_is_real(self) -> bool:
        return self._fabric.receiver_fence

    def accepts(self, addr: int, length: int) -> bool:
        """Whether `[addr, addr+length)` lies inside one buffer registered here."""
        return self._regions.covers(addr, length)

    def _engine_register(self, addr: int, length: int) -> None:
        """Nothing to tell an engine: the fabric reads the region table directly."""

    def _engine_unregister(self, addr: int) -> None:
        """Nothing to tell an engine: the fabric reads the region table directly."""

    def _engine_fence(self, peer: str) -> None:
        self._fabric._fence(receiver=self._session_id, writer=peer)

    def _engine_lift_fence(self, peer: str) -> None:
        self._fabric._lift_fence(receiver=self._session_id, writer=peer)

    async def _engine_write(self, peer: str, writes: Sequence[CheckedWrite]) -> TransferOutcome:
        issued = self._fabric._issue()
        hold = self._fabric._holds.get(peer)
        if hold is not None:
            await hold._block()
        target = self._fabric.engine(peer)
        if target is None:
            return _failed(f"no in-process engine has session id {peer} (never created or closed)")
        # Checked at landing time, after any hold: a write in flight when its receiver fenced
        # this writer must not land.
        if self._fabric._refuses(receiver=peer, writer=self._session_id, issued=issued):
            return _failed(f"{peer} fenced writes from {self._session_id}; nothing was written")
        for index, write in enumerate(writes):
            if not target.accepts(write.dst_addr, write.length):
                return _failed(
                    f"op {index}: destination [{write.dst_addr:#x}, +{write.length}) is not "
                    f"inside a buffer registered at {peer}; nothing was written"
                )
        plan = self._fabric._take_failure(peer)
        to_land = writes if plan is None else writes[: plan.land_ops]
        started = time.perf_counter()
        for write in to_land:
            ctypes.memmove(write.dst_addr, write.src_addr, write.length)
        seconds = time.perf_counter() - started
        nbytes = sum(write.length for write in to_land)
        if plan is not None:
            return TransferOutcome(
                ok=False, nbytes=nbytes, nops=len(to_land), seconds=None, error=plan.message
            )
        return TransferOutcome(ok=True, nbytes=nbytes, nops=len(to_land), seconds=seconds)

    async def _engine_shutdown(self) -> None:
        self._fabric._remove(self._session_id)


def _failed(error: str) -> TransferOutcome:
    return TransferOutcome(ok=False, nbytes=0, nops=0, seconds=None, error=error)
