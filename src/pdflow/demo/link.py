"""The prefill's side of the link to the decode: every write it hands to its transport.

Two jobs, both on the writes themselves rather than on the protocol around them:

* measure: the interval and bytes of each write, so the demo's GB/s is bytes over the time at
  least one write was in flight (concurrent rooms' transfers overlap; summing their durations
  would understate the rate);
* hold: the demo's faults that must land *inside* a transfer arm a hold on one room attempt's
  first write to reach the link (a room's chunks run on several transfer lanes: not always
  chunk 0, nor rank 0's). The node has planned the chunk, emitted ``start_transfer`` and handed
  the write to its transport; the link keeps it, as a slow link would, until the fault is done.
  A torn hold writes the first half of the chunk's bytes into the decode before holding the
  rest: stopping the prefill there leaves a write that started, partly landed and never
  completes, which is what a process killed mid-transfer leaves behind.

A cancelled instance cannot stand in for a killed process once the bytes are in the transport
engine: the engine's writes are seen through (shielded), and the node would record the write's
completion before the cancellation lands. Holding the rest of the write in the link is what
makes "stopped while the write was in flight" true of the trace, not just of the label.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import anyio

from pdflow.core.dataplane.planning import WriteOp
from pdflow.core.protocol.messages import KvArgs
from pdflow.core.protocol.outputs import StartTransfer
from pdflow.io.node_common import EndpointHost
from pdflow.io.node_prefill import PrefillNode
from pdflow.transport.base import TransferOutcome, Transport, WriteOpLike

_WRITING: ContextVar[tuple[int, int] | None] = ContextVar("pdflow_demo_writing", default=None)
"""(room, generation) of the chunk the current transfer task writes (set by RoomTaggingNode)."""


class HeldWrite:
    """One room attempt's first write to reach the link, held there until ``release``."""

    def __init__(self, room: int, generation: int, *, tear: bool) -> None:
        self.room = room
        self.generation = generation
        self.tear = tear
        self.reached = anyio.Event()
        """The write is in the link: its first half landed (torn) and the rest is held."""
        self.release = anyio.Event()
        self.landed_bytes = 0
        self.held_bytes = 0


class PrefillLink:
    """Shared by every life of the prefill: the holds armed and the writes measured."""

    def __init__(self) -> None:
        self._armed: dict[tuple[int, int], HeldWrite] = {}
        self.writes: list[tuple[float, float, int]] = []
        """(start, end, bytes) of every write that landed whole and was not held."""

    def arm(self, room: int, generation: int, *, tear: bool = False) -> HeldWrite:
        hold = HeldWrite(room, generation, tear=tear)
        self._armed[(room, generation)] = hold
        return hold

    def disarm(self, hold: HeldWrite) -> None:
        """The attempt is over: a write that reaches the link later is not held; one held now
        goes on (a stopped instance's held write was cancelled with it and never goes)."""
        if self._armed.get((hold.room, hold.generation)) is hold:
            del self._armed[(hold.room, hold.generation)]
        hold.release.set()

    def take(self, writing: tuple[int, int] | None) -> HeldWrite | None:
        return None if writing is None else self._armed.pop(writing, None)

    def busy_seconds(self) -> float:
        """Length of the union of the write intervals: time with at least one write in flight."""
        total, reach = 0.0, float("-inf")
        for start, end, _ in sorted(self.writes):
            if end > reach:
                total += end - max(start, reach)
                reach = end
        return total

    def bytes_written(self) -> int:
        return sum(nbytes for _, _, nbytes in self.writes)


class LinkTransport(Transport):
    """The prefill's transport, seen through its link: measured, and holding armed writes."""

    def __init__(self, inner: Transport, link: PrefillLink) -> None:
        self.inner = inner
        self.link = link

    @property
    def session_id(self) -> str:
        return self.inner.session_id

    def register_buffer(self, addr: int, length: int) -> None:
        self.inner.register_buffer(addr, length)

    def unregister_buffer(self, addr: int) -> None:
        self.inner.unregister_buffer(addr)

    async def batch_write(self, peer_session_id: str,
                          ops: Sequence[WriteOpLike]) -> TransferOutcome:  # fmt: skip
        hold = self.link.take(_WRITING.get())
        if hold is not None:
            return await self._held(hold, peer_session_id, list(ops))
        started = time.perf_counter()
        outcome = await self.inner.batch_write(peer_session_id, ops)
        if outcome.ok:
            self.link.writes.append((started, time.perf_counter(), outcome.nbytes))
        return outcome

    async def _held(self, hold: HeldWrite, peer: str, ops: list[WriteOpLike]) -> TransferOutcome:
        first: TransferOutcome | None = None
        if hold.tear and ops and ops[0].length >= 2:
            head = ops[0]
            half = head.length // 2
            first = await self.inner.batch_write(
                peer, [WriteOp(head.src_addr, head.dst_addr, half)]
            )
            hold.landed_bytes = first.nbytes
            ops[0] = WriteOp(head.src_addr + half, head.dst_addr + half, head.length - half)
        hold.held_bytes = sum(op.length for op in ops)
        hold.reached.set()
        await hold.release.wait()  # a stopped instance is cancelled here: the rest never goes
        rest = await self.inner.batch_write(peer, ops)
        if first is None:
            return rest
        return TransferOutcome(
            ok=first.ok and rest.ok, nbytes=first.nbytes + rest.nbytes,
            nops=first.nops + rest.nops,
            seconds=None if first.seconds is None or rest.seconds is None
            else first.seconds + rest.seconds,
            error=first.error or rest.error,
        )  # fmt: skip

    async def close_session(self, peer_session_id: str) -> None:
        await self.inner.close_session(peer_session_id)

    @property
    def fence_is_real(self) -> bool:
        return self.inner.fence_is_real

    async def fence(self, peer_session_id: str) -> None:
        await self.inner.fence(peer_session_id)

    async def lift_fence(self, peer_session_id: str) -> None:
        await self.inner.lift_fence(peer_session_id)

    @property
    def can_rotate(self) -> bool:
        return self.inner.can_rotate

    async def rotate(self) -> str:
        return await self.inner.rotate()

    async def retire(self, session_id: str) -> None:
        await self.inner.retire(session_id)

    async def aclose(self) -> None:
        await self.inner.aclose()


@contextmanager
def _writing(room: int, generation: int) -> Iterator[None]:
    token = _WRITING.set((room, generation))
    try:
        yield
    finally:
        _WRITING.reset(token)


class RoomTaggingNode(PrefillNode):
    """A prefill node that tells its link which room attempt each write carries."""

    async def transfer(self, host: EndpointHost, start: StartTransfer, args: KvArgs | None,
                       worker: int) -> None:  # fmt: skip
        with _writing(start.room, start.generation):
            await super().transfer(host, start, args, worker)
