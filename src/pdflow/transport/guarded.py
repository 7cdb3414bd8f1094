"""Shared behaviour of every concrete transport: argument checks, local bounds, close fencing.

Concrete transports subclass `GuardedTransport` and implement only the engine-specific steps
(`_engine_register`, `_engine_unregister`, `_engine_write`, `_engine_shutdown`). Everything a
caller can get wrong is checked here, before the engine sees it, so both transports reject the
same inputs with the same messages.
"""

from __future__ import annotations

import abc
import operator
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

from pdflow.core.dataplane.layout import ADDRESS_SPACE
from pdflow.transport.base import (
    FenceUnavailableError,
    InvalidWriteError,
    RegistrationError,
    TransferOutcome,
    Transport,
    TransportClosedError,
    WriteOpLike,
)
from pdflow.transport.inflight import InflightWrites
from pdflow.transport.regions import RegionTable


class CheckedWrite(NamedTuple):
    """A write op whose fields were validated and whose source lies in a registered buffer."""

    src_addr: int
    dst_addr: int
    length: int


def _as_address(value: int, what: str, index: int) -> int:
    # Checked at run time too: callers may pass floats, bools or None despite the annotation.
    try:
        number = operator.index(value)
    except TypeError:
        raise InvalidWriteError(
            f"op {index}: {what} must be an integer, got {type(value).__name__}"
        ) from None
    if isinstance(value, bool) or number <= 0:
        raise InvalidWriteError(f"op {index}: {what} must be a positive integer, got {value!r}")
    return number


class GuardedTransport(Transport):
    """Template for transports: subclasses move bytes, this class keeps the contract."""

    def __init__(self) -> None:
        self._regions = RegionTable()
        self._inflight = InflightWrites()
        self._closing_peers: Counter[str] = Counter()
        self._closed = False

    # -- engine-specific steps -------------------------------------------------------------

    @abc.abstractmethod
    def _engine_register(self, addr: int, length: int) -> None:
        """Register with the engine; raise `RegistrationError` if it refuses."""

    @abc.abstractmethod
    def _engine_unregister(self, addr: int) -> None:
        """Unregister from the engine; raise `RegistrationError` if it refuses."""

    @abc.abstractmethod
    async def _engine_write(self, peer: str, writes: Sequence[CheckedWrite]) -> TransferOutcome:
        """Perform the writes; return only when none of them can still land."""

    @abc.abstractmethod
    async def _engine_shutdown(self) -> None:
        """Release the engine; called once, after every write has finished."""

    def _engine_fence(self, peer: str) -> None:
        """Refuse, from now on, every landing here of the peer's writes (if `fence_is_real`)."""
        raise FenceUnavailableError(f"{type(self).__name__} has no receiver-side fence")

    def _engine_lift_fence(self, peer: str) -> None:
        """Let the peer's writes issued from now on land here again (if `fence_is_real`)."""
        raise FenceUnavailableError(f"{type(self).__name__} has no receiver-side fence")

    # -- public contract -----------------------------------------------------------------

    @property
    def registered_buffers(self) -> list[tuple[int, int]]:
        """Registered buffers as (address, length), in address order."""
        return self._regions.regions()

    def register_buffer(self, addr: int, length: int) -> None:
        self._check_open()
        self._regions.check_can_add(addr, length)
        self._engine_register(addr, length)
        self._regions.add(addr, length)

    def unregister_buffer(self, addr: int) -> None:
        self._check_open()
        self._regions.check_can_remove(addr)
        if self._inflight.count():
            raise RegistrationError(
                f"cannot unregister {addr:#x} while {self._inflight.count()} write(s) are in "
                "flight; await them or close their sessions first"
            )
        self._engine_unregister(addr)
        self._regions.remove(addr)

    async def batch_write(
        self, peer_session_id: str, ops: Sequence[WriteOpLike]
    ) -> TransferOutcome:
        self._check_open()
        writes = self._check_writes(ops)
        if self._closing_peers[peer_session_id]:
            return TransferOutcome(
                ok=False,
                nbytes=0,
                nops=0,
                seconds=None,
                error=f"session to {peer_session_id} is being closed; write again after "
                "close_session returns",
            )
        if not writes:
            return TransferOutcome(ok=True, nbytes=0, nops=0, seconds=0.0)
        self._inflight.enter(peer_session_id)
        try:
            return await self._engine_write(peer_session_id, writes)
        finally:
            self._inflight.leave(peer_session_id)

    async def close_session(self, peer_session_id: str) -> None:
        """Wait for every write to the peer issued before this call; refuse new ones meanwhile.

        Each implementation's `_engine_write` returns only once its writes are settled, so when
        the in-flight count for the peer reaches zero nothing issued earlier can still land.
        A later `batch_write` to the same peer opens a fresh session.
        """
        self._closing_peers[peer_session_id] += 1
        try:
            await self._inflight.wait_idle(peer_session_id)
        finally:
            self._closing_peers[peer_session_id] -= 1
            if not self._closing_peers[peer_session_id]:
                del self._closing_peers[peer_session_id]

    async def fence(self, peer_session_id: str) -> None:
        self._check_fence_is_real(peer_session_id)
        self._engine_fence(peer_session_id)

    async def lift_fence(self, peer_session_id: str) -> None:
        self._check_fence_is_real(peer_session_id)
        self._engine_lift_fence(peer_session_id)

    def _check_fence_is_real(self, peer: str) -> None:
        self._check_open()
        if not self.fence_is_real:
            raise FenceUnavailableError(
                f"{type(self).__name__} cannot stop writes from {peer} landing in this process "
                "(fence_is_real is False); keep that writer's pages quarantined until its "
                "drain ACK"
            )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._inflight.wait_all_idle()
        for addr, _length in self._regions.regions():
            self._engine_unregister(addr)
            self._regions.remove(addr)
        await self._engine_shutdown()

    # -- helpers -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosedError(
                f"transport {self.session_id} is closed; create a new transport"
            )

    def _check_writes(self, ops: Sequence[WriteOpLike]) -> list[CheckedWrite]:
        writes: list[CheckedWrite] = []
        for index, op in enumerate(ops):
            write = CheckedWrite(
                _as_address(op.src_addr, "src_addr", index),
                _as_address(op.dst_addr, "dst_addr", index),
                _as_address(op.length, "length", index),
            )
            if write.dst_addr + write.length > ADDRESS_SPACE:
                # A peer's layout names the destination: refused here, before any op of the
                # call is on the wire (an engine may raise on it mid-call instead).
                raise InvalidWriteError(
                    f"op {index}: destination [{write.dst_addr:#x}, +{write.length}) ends past "
                    "the 64-bit address space; the peer's layout is corrupt"
                )
            if not self._regions.covers(write.src_addr, write.length):
                raise InvalidWriteError(
                    f"op {index}: source [{write.src_addr:#x}, +{write.length}) is not inside a "
                    f"buffer registered with {self.session_id}; call register_buffer first"
                )
            writes.append(write)
        return writes
