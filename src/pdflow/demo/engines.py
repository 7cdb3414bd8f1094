"""The demo's two inference engines, embedding pdflow's nodes the way a real engine would.

The prefill engine holds a TP=2 paged KV cache (two rank shards, KV heads split in halves) and
computes each prompt's KV with the tiny model; the decode engine holds a TP=1 cache, receives the
KV through pdflow (staged: each prefill rank gathers its head slices and writes them in one bulk
write per chunk) and generates greedily. Neither engine touches a socket or decides a protocol
question: they call the node's rank handles and react to its events.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

import anyio
import anyio.to_thread
import msgspec

from pdflow.core.dataplane.layout import KvDtype, KvLayout
from pdflow.core.framework.errors import InvalidInput, LocalProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.demo.aux_rows import AuxRows
from pdflow.demo.kvcache import PagedKVCache
from pdflow.demo.model import TinyTransformer, decode, prefill_sharded
from pdflow.demo.state_slots import MemorySlots
from pdflow.io.kv_buffers import RankKv
from pdflow.io.node_common import NodeEvent, PagesReleased
from pdflow.io.node_decode import DecodeNode, DecodeRank
from pdflow.io.node_prefill import PrefillNode, PrefillRank

CHUNK_PAGES = 2
"""Pages per chunk: small, so every room's transfer is really chunked."""


def rank_kv(cache: PagedKVCache, aux: AuxRows, memory: MemorySlots) -> RankKv:
    """Describe a demo cache to pdflow: ``[layer][K,V][page][token][head][dim]`` float32, the
    rank's aux rows and its model state (the recurrent memory slots)."""
    geometry = cache.geometry
    base, size = cache.base_ptr, cache.buffer_nbytes
    layout = KvLayout(
        page_size=geometry.page_size,
        num_heads=cache.heads_local,
        head_dim=geometry.head_dim,
        dtype=KvDtype.FP32,
        num_pages=cache.num_pages,
        k_addrs=tuple(base + (2 * layer) * size for layer in range(geometry.n_layers)),
        v_addrs=tuple(base + (2 * layer + 1) * size for layer in range(geometry.n_layers)),
    )
    return RankKv(layout, cache.tp_size, cache.tp_rank, geometry.n_kv_heads, aux.buffer,
                  (memory.component,), owner=(cache, aux, memory))  # fmt: skip


class RoomOutcome(msgspec.Struct):
    """What one side saw of one room: the poll it ended on, why, and when things happened."""

    poll: KVPoll
    reason: str = ""
    first_token: int | None = None
    tokens: list[int] = msgspec.field(default_factory=list)
    handshake_s: float | None = None
    ttft_s: float | None = None
    transfer_s: float | None = None
    bytes_written: int = 0
    """Bytes the prefill's ranks wrote for the room: its KV pages and its model state."""
    stopped: bool = False
    """The prefill instance stopped: nobody reported the failure, its peers must notice it."""


class PrefillEngine:
    """Prefill instance: computes a prompt's KV into TP=2 shards and sends it through pdflow."""

    def __init__(self, model: TinyTransformer, caches: Sequence[PagedKVCache],
                 aux: Sequence[AuxRows], memory: Sequence[MemorySlots],
                 node: PrefillNode) -> None:  # fmt: skip
        self.model = model
        self.caches = list(caches)
        self.aux = list(aux)
        self.memory = list(memory)
        """One state pool per rank; every rank holds the request's whole memory (a BLOB)."""
        """One aux buffer per rank, as SGLang's metadata buffers (every rank fills its own)."""
        self.node = node
        self.compute_lock = anyio.Lock()  # one forward pass at a time, like one GPU
        self.page_space = anyio.Condition()

    async def serve(self, room: int, generation: int, prompt: Sequence[int],
                    on_transferred: Callable[[RoomOutcome], None] | None = None,
                    ) -> RoomOutcome:  # fmt: skip
        """Compute and send one room; ``on_transferred`` hears of a completed transfer before
        the room is cleared (an instance stopped while clearing still moved the KV)."""
        num_pages = self.caches[0].geometry.pages_for(len(prompt))
        async with self.page_space:
            while any(c.allocator.num_free < num_pages for c in self.caches):
                await self.page_space.wait()
            pages = [cache.allocator.allocate(num_pages) for cache in self.caches]
        ranks = self.node.ranks
        rows = [aux.allocate() for aux in self.aux]
        slots = [memory.allocate() for memory in self.memory]
        try:
            for rank in ranks:
                await rank.open_room(room, generation)
            async with self.compute_lock:
                state = self.memory[0].vector(slots[0])
                first = await anyio.to_thread.run_sync(
                    prefill_sharded, self.model, list(prompt), self.caches, pages, state
                )
            for memory, slot in zip(self.memory[1:], slots[1:], strict=True):
                memory.vector(slot).copy_(state)
            for aux, row in zip(self.aux, rows, strict=True):
                aux.write(row, first, room)
            # Both ranks wait for the decode's pages (WaitingForInput), then send in chunks.
            statuses = [await rank.wait(room) for rank in ranks]
            failed = [s for s in statuses if s.poll is KVPoll.Failed]
            bytes_written, transfer_s = 0, 0.0
            if not failed:
                async with anyio.create_task_group() as tasks:
                    for rank, rank_pages, row, slot in zip(ranks, pages, rows, slots,
                                                           strict=True):  # fmt: skip
                        tasks.start_soon(self._send, rank, room, rank_pages, row, slot)
                final = [await rank.wait(room, terminal=True) for rank in ranks]
                failed = [s for s in final if s.poll is KVPoll.Failed]
                for rank in ranks:
                    nbytes, seconds = rank.transfer_stats(room)
                    bytes_written += nbytes or 0
                    # Ranks write concurrently: the room took as long as its slowest rank.
                    transfer_s = max(transfer_s, seconds or 0.0)
            outcome = (RoomOutcome(KVPoll.Failed, failed[0].reason) if failed else
                       RoomOutcome(KVPoll.Success, first_token=first,
                                   transfer_s=transfer_s or None,
                                   bytes_written=bytes_written))  # fmt: skip
            if not failed and on_transferred is not None:
                on_transferred(outcome)
            for rank in ranks:
                await rank.clear(room)
            return outcome
        finally:
            for cache, rank_pages in zip(self.caches, pages, strict=True):
                cache.allocator.free(rank_pages)
            for aux, row in zip(self.aux, rows, strict=True):
                aux.free(row)
            for memory, slot in zip(self.memory, slots, strict=True):
                memory.free(slot)
            with anyio.CancelScope(shield=True):
                async with self.page_space:
                    self.page_space.notify_all()

    async def abort(self, room: int, reason: str) -> None:
        """The router gave up on this attempt: fail the room on every rank that has it."""
        for rank in self.node.ranks:
            if rank.poll(room) not in (None, KVPoll.Failed, KVPoll.Success):
                await rank.abort(room, reason)

    @staticmethod
    async def _send(rank: PrefillRank, room: int, pages: list[int], aux_row: int,
                    slot: int) -> None:  # fmt: skip
        await rank.init_transfer(room, len(pages), aux_index=aux_row)
        for start in range(0, len(pages), CHUNK_PAGES):
            chunk = pages[start : start + CHUNK_PAGES]
            last = start + CHUNK_PAGES >= len(pages)
            state = ((slot,),) if last else ()  # the recurrent memory goes with the last chunk
            await rank.send_chunk(room, chunk, is_last=last, state_indices=state)


class DecodeEngine:
    """Decode instance: reserves pages, receives the KV through pdflow, generates tokens."""

    def __init__(self, model: TinyTransformer, cache: PagedKVCache, aux: AuxRows,
                 memory: MemorySlots, node: DecodeNode) -> None:  # fmt: skip
        self.model = model
        self.cache = cache
        self.aux = aux
        self.memory = memory
        self._slots_held: dict[tuple[int, int], int] = {}
        """State slots of failed rooms: remote-writable until their pages are released."""
        self._serving: dict[int, int] = {}
        """room -> the generation this engine has open for it."""
        self._failing: dict[tuple[int, int], str] = {}
        """Room attempts the router failed (their prefill gave up) and why."""
        self.node = node
        self.page_space = anyio.Condition()

    async def watch_events(self) -> None:
        """Pages come back to the allocator only when pdflow says no writer can touch them."""
        async with self.node.subscribe() as events:
            async for event in events:
                await self._on_event(event)

    async def _on_event(self, event: NodeEvent) -> None:
        if isinstance(event, PagesReleased):
            self.cache.allocator.free(event.pages)
            slot = self._slots_held.pop((event.room, event.generation), None)
            if slot is not None:
                self.memory.free(slot)
            async with self.page_space:
                self.page_space.notify_all()

    async def fail(self, room: int, generation: int, reason: str) -> None:
        """The prefill side failed this attempt: abort the room now rather than let it wait
        out its timers (a prefill that reports a failure will never send the KV)."""
        self._failing[(room, generation)] = reason
        if self._serving.get(room) == generation:
            await self._abort(room, reason)

    async def _abort(self, room: int, reason: str) -> None:
        rank = self.node.ranks[0]
        if rank.poll(room) in (None, KVPoll.Failed, KVPoll.Success):
            return
        # It may end (or be cleared) while the call waits for the endpoint: nothing to abort.
        with contextlib.suppress(InvalidInput, LocalProtocolError):
            await rank.abort(room, reason)

    async def serve(self, room: int, generation: int, bootstrap: str, prompt_len: int,
                    max_new: int, abort_when: anyio.Event | None = None) -> RoomOutcome:
        """Receive one room and generate ``max_new`` tokens in all: the prefill's first token
        and ``max_new - 1`` decode steps. ``abort_when``: a demo fault; abort the room once it
        is set, if the room has not ended by then."""
        rank = self.node.ranks[0]
        opened = time.perf_counter()
        await rank.open(room, generation, bootstrap)
        self._serving[room] = generation
        try:
            reason = self._failing.get((room, generation))
            if reason is not None:  # failed by the router while we were opening the room
                await self._abort(room, reason)
            return await self._serve_open(room, generation, rank, opened, prompt_len, max_new,
                                          abort_when)  # fmt: skip
        finally:
            self._serving.pop(room, None)
            self._failing.pop((room, generation), None)

    async def _serve_open(self, room: int, generation: int, rank: DecodeRank, opened: float,
                          prompt_len: int, max_new: int,
                          abort_when: anyio.Event | None) -> RoomOutcome:  # fmt: skip
        status = await rank.wait(room)
        if status.poll is KVPoll.Failed:
            await rank.clear(room)
            return RoomOutcome(KVPoll.Failed, status.reason)
        # Admission first: a request in transfer cannot be retracted, so it waits until the
        # pages left cover the largest growth of any admitted request (sglang#30033).
        await rank.admit(room, input_len=prompt_len, max_new=max_new)
        if rank.poll(room) is KVPoll.Failed:  # failed while it waited: nothing published
            failed = await rank.wait(room)
            rank.finish_request(room, generation)
            await rank.clear(room)
            return RoomOutcome(KVPoll.Failed, failed.reason)
        pages, slot = await self._allocate(self.cache.geometry.pages_for(prompt_len))
        aux_row = self.aux.allocate()
        outcome = RoomOutcome(KVPoll.Failed, "the decode engine stopped")
        try:
            outcome = await self._receive(room, generation, rank, pages, aux_row, slot, opened,
                                          prompt_len, max_new, abort_when)  # fmt: skip
            return outcome
        finally:
            self.aux.free(aux_row)
            if outcome.poll is KVPoll.Success:
                self.memory.free(slot)
            else:  # a writer may still land in it: it comes back with the room's pages
                self._slots_held[(room, generation)] = slot

    async def _receive(self, room: int, generation: int, rank: DecodeRank, pages: list[int],
                       aux_row: int, slot: int, opened: float, prompt_len: int, max_new: int,
                       abort_when: anyio.Event | None) -> RoomOutcome:  # fmt: skip
        await rank.publish_pages(room, pages, aux_index=aux_row, state_indices=((slot,),))
        handshake_s = time.perf_counter() - opened
        if abort_when is not None and await _first_of(
            abort_when, lambda: rank.wait(room, terminal=True)
        ):
            await self._abort(room, "demo fault: the client went away mid-transfer")
        status = await rank.wait(room, terminal=True)
        if status.poll is KVPoll.Failed:
            await rank.clear(room)  # pages come back through PagesReleased, after the fence
            return RoomOutcome(KVPoll.Failed, status.reason, handshake_s=handshake_s)
        # The first token came with the KV: pdflow put the prefill's aux row in our slot.
        token, row_room = self.aux.read(aux_row)
        ttft_s = time.perf_counter() - opened
        if row_room != room:
            await rank.clear(room)
            rank.finish_request(room, generation)
            return RoomOutcome(KVPoll.Failed, f"aux row belongs to room {row_room}, not {room}")
        extra: list[int] = []

        def allocate_more(count: int) -> list[int]:
            extra.extend(self.cache.allocator.allocate(count))
            return extra[-count:]

        table = list(pages)
        try:
            tokens = await anyio.to_thread.run_sync(
                lambda: decode(
                    self.model, token, self.cache, table, prompt_len, max_new - 1,
                    memory=self.memory.vector(slot), allocate_pages=allocate_more,
                )
            )
        finally:
            self.cache.allocator.free(extra)  # never published: the engine's own to free
            await rank.clear(room)
            rank.finish_request(room, generation)
        return RoomOutcome(KVPoll.Success, first_token=token, tokens=[token, *tokens],
                           handshake_s=handshake_s, ttft_s=ttft_s)  # fmt: skip

    async def _allocate(self, count: int) -> tuple[list[int], int]:
        """``count`` pages and a state slot, once both are free (failed rooms hold theirs
        until pdflow releases them)."""
        async with self.page_space:
            while self.cache.allocator.num_free < count or not self.memory.num_free:
                await self.page_space.wait()
            return self.cache.allocator.allocate(count), self.memory.allocate()


async def _first_of(event: anyio.Event, other: Callable[[], Awaitable[object]]) -> bool:
    """Wait for ``event`` or ``other()``, whichever comes first; True if it was ``event``."""
    async with anyio.create_task_group() as tasks:

        async def wait_other() -> None:
            await other()
            tasks.cancel_scope.cancel()

        tasks.start_soon(wait_other)
        await event.wait()
        tasks.cancel_scope.cancel()
    return event.is_set()
