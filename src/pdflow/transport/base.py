"""The transport contract: move bytes between registered buffers and report what happened.

A transport makes no protocol decisions. It is told which bytes to write where, does it, and
returns a `TransferOutcome`; deciding what a failure means is the caller's job.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from types import TracebackType
from typing import Protocol, Self

import msgspec


class WriteOpLike(Protocol):
    """One write: `length` bytes from local `src_addr` to remote `dst_addr` (absolute addresses).

    `pdflow.core.dataplane.planning.WriteOp` satisfies this protocol, as does any object with these
    three integer attributes.
    """

    @property
    def src_addr(self) -> int: ...

    @property
    def dst_addr(self) -> int: ...

    @property
    def length(self) -> int: ...


class TransferOutcome(msgspec.Struct, frozen=True):
    """What one `batch_write` achieved.

    `nbytes` and `nops` count the writes confirmed landed (the whole request when `ok`).
    `seconds` is the measured transfer time, or None when the transport cannot measure it.
    `error` says what went wrong when not `ok`.
    """

    ok: bool
    nbytes: int
    nops: int
    seconds: float | None
    error: str | None = None

    @property
    def gbps(self) -> float | None:
        """Throughput in GB/s (10^9 bytes per second), when it was measured."""
        if not self.seconds:
            return None
        return self.nbytes / self.seconds / 1e9


class TransportError(Exception):
    """Base class for misuse of a transport (bad arguments, wrong lifecycle stage)."""


class InvalidWriteError(TransportError, ValueError):
    """A write op is malformed or reads local memory outside every registered buffer."""


class RegistrationError(TransportError, ValueError):
    """A buffer cannot be registered or unregistered as asked."""


class TransportClosedError(TransportError):
    """The transport was closed with `aclose()`; create a new one."""


class FenceUnavailableError(TransportError):
    """`fence` was called on a transport whose receiver-side fence is not real."""


class RotationUnavailableError(TransportError):
    """`rotate` or `retire` was called on a transport whose `can_rotate` is False."""


class Transport(abc.ABC):
    """Abstract async transport between engines addressed by session ids.

    Failures of the transfer itself (peer unreachable, destination range not registered at the
    peer, injected faults) are reported in the returned `TransferOutcome`, never raised; misuse
    by the caller (malformed ops, unregistered local source, closed transport) raises a
    `TransportError` subclass and changes no state.
    """

    @property
    @abc.abstractmethod
    def session_id(self) -> str:
        """How peers address this engine, e.g. "127.0.0.1:15970"."""

    @abc.abstractmethod
    def register_buffer(self, addr: int, length: int) -> None:
        """Make `[addr, addr+length)` usable as a write source here and a destination for peers."""

    @abc.abstractmethod
    def unregister_buffer(self, addr: int) -> None:
        """Forget the buffer registered at `addr`; refused while writes are in flight."""

    @abc.abstractmethod
    async def batch_write(
        self, peer_session_id: str, ops: Sequence[WriteOpLike]
    ) -> TransferOutcome:
        """Write every op to the peer; when this returns, none of these ops can still land."""

    @abc.abstractmethod
    async def close_session(self, peer_session_id: str) -> None:
        """Sender side: when this returns, no write *this* transport issued to the peer earlier
        can still land there. It says nothing about the peer's writes into this process."""

    @property
    @abc.abstractmethod
    def fence_is_real(self) -> bool:
        """Whether `fence` is enforced on the receiving side by this transport.

        Where it is False, nothing this process can do stops a peer's in-flight write from
        landing here, so a caller must never treat a peer as fenced: the pages it may write
        stay quarantined until the writer itself proves it is done (its drain ACK).
        """

    @abc.abstractmethod
    async def fence(self, peer_session_id: str) -> None:
        """Receiver side: once this returns, no byte of any write by the peer, in flight now or
        issued later, can land in this process's memory. Permanent for that session id.

        Raises `FenceUnavailableError` where `fence_is_real` is False.
        """

    @abc.abstractmethod
    async def lift_fence(self, peer_session_id: str) -> None:
        """Receiver side: writes the peer issues from now on may land here again; every write
        it issued before this call stays refused. Call it only once the writer proved it no
        longer writes anything fenced (its drain ACKs). Raises `FenceUnavailableError` where
        `fence_is_real` is False.
        """

    @property
    def can_rotate(self) -> bool:
        """Whether this transport fences by engine rotation (`rotate`, then `retire`).

        A transport whose per-peer fence is not real may still offer this receiver-side cut for
        every peer at once: open a new engine with the same memory registered, let new writes
        go there, and destroy the old engine once nothing needs it.
        """
        return False

    async def rotate(self) -> str:
        """Open a new engine with every registered buffer registered in it too and make it the
        current one; return its session id. The previous engine keeps serving until `retire`."""
        raise RotationUnavailableError(f"{type(self).__name__} cannot rotate its engine")

    async def retire(self, session_id: str) -> None:
        """Destroy the engine behind a previous session id: once this returns, no byte of any
        peer's write through it, in flight or later, can land in this process."""
        raise RotationUnavailableError(f"{type(self).__name__} cannot rotate its engine")

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Fence every peer and release the engine; the transport is unusable afterwards."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
