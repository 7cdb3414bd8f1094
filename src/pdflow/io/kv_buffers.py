"""KV buffers as the shell sees them: layouts, write plans and digests.

The core says *which* pages go where (``StartTransfer``); this module turns that into byte
writes with :mod:`pdflow.core.dataplane.planning`, using the KV layout each decode rank announced
with a :class:`~pdflow.core.protocol.messages.KvArgs` message (SGLang's "register KV args"
frame), which the prefill rank's core keeps. Equal head ranges copy whole
pages, coalesced; different TP sizes copy head slices. The staged path (gather into a staging ring,
one bulk write, scatter on the decode) plugs in by overriding :meth:`TransferPlanner.plan`.

The end-to-end digest (:func:`kv_digest`) is what ``checksum`` in ``StatusReport`` carries when
checksums are on. It is additive over transfers (the sender room sums a rank's transfers with
the same modulus, ``ROOM_FOLD_MODULUS``), so it is built from one term per (buffer, destination
page): the page's bytes as written, checksummed in token order, keyed by where they land.
Reordered bytes change the weighted part; bytes landing in the wrong page or buffer change the
key. Each term is scaled by an odd multiplier drawn from its key (:func:`_key_multiplier`):
with the key only added, byte ``i`` of page ``k`` weighed what byte ``i - 1`` of page ``k + 1``
did, and swapping those two bytes, or pages whose bytes are permutations of each other, left
the digest unchanged. A swap of two equal-sum blocks within one page still does (the checksum's
weights are linear in the position: :mod:`pdflow.core.dataplane.checksum`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from pdflow.core.dataplane.buffers import (
    BufferSlice,
    KvBuffers,
    TpPlace,
    destination_slices,
    exchanged_slices,
    feeding_ranks,
    staging_groups,
    state_kv_buffers,
    writer_page_bytes,
)
from pdflow.core.dataplane.checksum import ROOM_FOLD_MODULUS, ByteRange, Checksum
from pdflow.core.dataplane.layout import (
    AuxBuffer,
    HeadRange,
    KvDtype,
    KvLayout,
    StateBuffers,
    packed_layout,
    rank_head_range,
)
from pdflow.core.dataplane.planning import (
    SlicePairs,
    StagedSlices,
    WriteOp,
    buffer_slice_pairs,
    plan_buffers,
)
from pdflow.core.framework.errors import InvalidInput
from pdflow.core.protocol.messages import KvArgs, PeerId
from pdflow.core.protocol.outputs import StartTransfer
from pdflow.dataplane.backend import load_optional
from pdflow.dataplane.executor import Executor, make_executor
from pdflow.dataplane.numpy_backend import NumpyExecutor
from pdflow.dataplane.pure import PythonExecutor


class RankKv(msgspec.Struct, frozen=True):
    """One rank's KV: its buffers and its place among the TP ranks, and the engine's aux buffer
    (where each request's first token and metadata row live), if it hands one to pdflow.

    ``layout`` is either the engine's own buffer description (:class:`KvBuffers`: any tensors,
    item lengths, layer ids, MLA latents, draft KV, page orders) or a classic :class:`KvLayout`
    (K and V of every layer, token-major), which stands for ``KvBuffers.from_layout``."""

    layout: KvLayout | KvBuffers
    tp_size: int
    tp_rank: int
    total_kv_heads: int
    """The finest TP split of any tensor (MLA: 1); the topology splits ranks by it."""
    aux: AuxBuffer | None = None
    state: tuple[StateBuffers, ...] = ()
    """The model-state components (Mamba slots, sliding-window pages, blobs) the engine hands
    pdflow, in the order ``state_indices`` name them."""
    device: str = "cpu"
    """Whose memory the KV, state and staging addresses name: "cpu" or "cuda[:n]"; it picks the
    executor the shell checksums, gathers and scatters with (aux rows are host memory)."""
    owner: object = None
    """What owns the memory the addresses name (the engine's tensors, a ``HostKvCache``): held
    here, so a node (which keeps its ``RankKv``) never writes into memory freed under it. None:
    the caller keeps the memory alive for as long as any node uses this description."""

    def __post_init__(self) -> None:
        described = self.kv_buffers
        if described.total_heads != self.total_kv_heads:
            raise InvalidInput(
                f"total_kv_heads is {self.total_kv_heads} but the finest split of the rank's "
                f"buffers is {described.total_heads} heads; pass the largest total_heads"
            )
        if isinstance(self.layout, KvLayout) and self.layout.num_heads != self.heads.count:
            raise InvalidInput(
                f"the layout holds {self.layout.num_heads} heads but TP rank {self.tp_rank} of "
                f"{self.tp_size} holds {self.heads.count} of {self.total_kv_heads}"
            )
        for buffer in described.buffers:
            described.head_bytes(buffer, self.tp)  # whole heads per page, or a clear error

    @property
    def kv_buffers(self) -> KvBuffers:
        layout = self.layout
        if isinstance(layout, KvLayout):
            return KvBuffers.from_layout(layout, self.total_kv_heads)
        return layout

    @property
    def token_layout(self) -> KvLayout:
        """The classic layout, for tools that only read those (chaos patterns, canaries)."""
        if not isinstance(self.layout, KvLayout):
            raise InvalidInput("this rank describes its own buffers; it has no KvLayout")
        return self.layout

    @property
    def tp(self) -> TpPlace:
        return TpPlace(self.tp_size, self.tp_rank)

    def buffers(self) -> tuple[tuple[int, int], ...]:
        """``(address, bytes)`` of every buffer a transport must register for this rank."""
        kv = tuple((buffer.addr, buffer.length) for buffer in self.kv_buffers.buffers)
        state = tuple(
            (addr, component.num_items * length)
            for component in self.state
            for addr, length in zip(component.addrs, component.item_lens, strict=True)
        )
        return kv + state

    @property
    def heads(self) -> HeadRange:
        return rank_head_range(self.total_kv_heads, self.tp_size, self.tp_rank)

    def kv_args(
        self, decode: PeerId, prefill: PeerId, session_id: str, staging_addr: int | None = None
    ) -> KvArgs:
        return KvArgs(decode, prefill, session_id, self.kv_buffers, self.tp_size, self.tp_rank,
                      self.total_kv_heads, staging_addr)  # fmt: skip


def peer_place(args: KvArgs) -> TpPlace:
    return TpPlace(args.tp_size, args.tp_rank)


# Peer layouts whose slice pairs a planner keeps; past this the oldest is dropped.
_KEPT_PEER_LAYOUTS = 256

_Kept = TypeVar("_Kept")


class _PerLayout(Generic[_Kept]):
    """A value worked out once per decode rank's announced layout (the ``KvArgs`` object the
    core keeps for it) and a variant of this side, kept while that object is; past
    ``_KEPT_PEER_LAYOUTS`` layouts the oldest is dropped. Holding the KvArgs keeps its id from
    being reused by another object while the entry lives."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[KvArgs, object, _Kept]] = {}

    def get(self, peer: KvArgs, variant: object, make: Callable[[], _Kept]) -> _Kept:
        kept = self._kept.get(id(peer))
        if kept is not None and kept[0] is peer and kept[1] == variant:
            return kept[2]
        value = make()
        if len(self._kept) >= _KEPT_PEER_LAYOUTS:
            del self._kept[next(iter(self._kept))]
        self._kept[id(peer)] = (peer, variant, value)
        return value


class TransferPlanner:
    """Plans the writes of one prefill rank. Override :meth:`plan` for a staged path.

    Which slice of each buffer lands where depends on the two layouts only, so it is worked out
    once per peer's ``KvArgs`` (the object the core keeps for that decode rank) and kept; each
    room then only pairs its pages. Finding those slices was most of a small room's plan."""

    stage = False
    """The rank is one pipeline stage: it writes only the tensors (layers) it holds."""

    def __init__(self, local: RankKv) -> None:
        self.local = local
        self._local_buffers = local.kv_buffers
        self._pairs: _PerLayout[SlicePairs] = _PerLayout()
        self._regions: _PerLayout[WriterRegion | None] = _PerLayout()

    def plan(self, start: StartTransfer, peer: KvArgs) -> tuple[WriteOp, ...]:
        """Raises ``InvalidInput`` (from planning) when the two layouts cannot exchange pages."""
        pairs = self._pairs.get(peer, self.stage, lambda: buffer_slice_pairs(
            self._local_buffers, self.local.tp, peer.layout, peer_place(peer), self.stage))
        return plan_buffers(self._local_buffers, self.local.tp, peer.layout, peer_place(peer),
                            start.src_pages, start.dst_pages, self.stage, pairs)  # fmt: skip

    def region(self, peer: KvArgs) -> WriterRegion | None:
        """This rank's staged region in the decode rank ``peer`` (None: they share no heads),
        worked out once per announced layout: finding the slices costs more than a small
        room's whole gather."""
        return self._regions.get(peer, None, lambda: writer_region(
            self._local_buffers, True, self.local.tp, peer_place(peer), peer.layout))


# ---- model state ---------------------------------------------------------------------------------
StateIndices = tuple[tuple[int, ...], ...]


def check_state_indices(state: Sequence[StateBuffers], indices: StateIndices, what: str) -> None:
    """One index list per state component, every index inside its component."""
    if len(indices) != len(state):
        raise InvalidInput(
            f"{what} names state indices for {len(indices)} components but this rank has "
            f"{len(state)} ({[c.kind.value for c in state]}); give one index list per component"
        )
    for component, chosen in zip(state, indices, strict=True):
        component.check_indices(chosen, what)


def _same_components(local: Sequence[StateBuffers], peer: Sequence[StateBuffers]) -> None:
    if len(local) != len(peer) or not all(
        a.same_split(b) for a, b in zip(local, peer, strict=True)
    ):
        raise InvalidInput(
            "the two ranks' model-state components differ in kind, buffers, TP split or tokens "
            "per item; both engines must describe the same model's state in the same order"
        )


def plan_state(local: Sequence[StateBuffers], peer: Sequence[StateBuffers],
               src: StateIndices, dst: StateIndices, src_tp: TpPlace,
               dst_tp: TpPlace) -> tuple[WriteOp, ...]:  # fmt: skip
    """Item ``src[c][i]`` of each buffer of component ``c`` into item ``dst[c][i]`` of the
    peer's same buffer, split by the TP rule as KV is (:func:`state_kv_buffers`): whole items
    between equal TP, this rank's heads of them otherwise, a replicated buffer from one writer."""
    if not src and not dst:
        return ()
    _same_components(local, peer)
    check_state_indices(local, src, "the prefill")
    check_state_indices(peer, dst, "the decode")
    ops: list[WriteOp] = []
    for mine, theirs, src_items, dst_items in zip(local, peer, src, dst, strict=True):
        ops += plan_buffers(state_kv_buffers(mine), src_tp, state_kv_buffers(theirs), dst_tp,
                            src_items, dst_items)  # fmt: skip
    return tuple(ops)


StateSlices = tuple[tuple[BufferSlice, ...], ...]


def state_slices(own: Sequence[StateBuffers], own_is_source: bool, src: TpPlace, dst: TpPlace,
                 peer: Sequence[StateBuffers] = ()) -> StateSlices:  # fmt: skip
    """Per component, the slices of its items the writer ``src`` moves into ``dst`` (a source
    passes the decode's components as ``peer``)."""
    if own_is_source:
        _same_components(own, peer)
    return tuple(
        exchanged_slices(state_kv_buffers(mine), own_is_source, src, dst,
                         state_kv_buffers(peer[c]) if own_is_source else None)
        for c, mine in enumerate(own)
    )  # fmt: skip


_STATE_KEY_BASE = 1 << 48
"""State terms of the digest are keyed above every KV key (buffer * pool + page + 1)."""


def state_digest(executor: ChecksumExecutor, slices: StateSlices, indices: StateIndices,
                 dst_indices: StateIndices) -> int:  # fmt: skip
    """The digest part of the model state: one term per (component, buffer, item), the slice
    of the item at ``indices`` this writer moves, keyed by where it lands (``dst_indices``);
    the decode calls it with ``indices == dst_indices`` over its own state; 0 without state."""
    if not indices:
        return 0
    return sum(
        kv_digest(executor, component, items, dst_items, 1 << 32,
                  key_base=_STATE_KEY_BASE + (c << 40))
        for c, (component, items, dst_items) in enumerate(zip(slices, indices, dst_indices,
                                                              strict=True))
    ) % ROOM_FOLD_MODULUS  # fmt: skip


# ---- staging -----------------------------------------------------------------------------------
class WriterRegion(msgspec.Struct, frozen=True):
    """Where one prefill rank's slices of one room sit in the decode's staging region.

    The region of a room is writer-major: writers (the prefill ranks feeding the decode rank,
    in rank order) follow each other, writer ``w`` owning ``room_pages * page_bytes`` bytes
    after ``room_pages * before`` (``before``: the page bytes of the writers ahead of it), and
    page ``i`` of the room sits at ``i * page_bytes`` inside it, its slices in
    :func:`~pdflow.core.dataplane.buffers.staging_groups` order; so every chunk of one writer is
    one contiguous bulk write whatever the chunking.
    """

    before: int
    page_bytes: int
    slices: tuple[BufferSlice, ...]

    def chunk_offset(self, room_pages: int, page_start: int) -> int:
        return self.before * room_pages + page_start * self.page_bytes


def writer_region(own: KvBuffers, own_is_source: bool, src: TpPlace, dst: TpPlace,
                  destination: KvBuffers) -> WriterRegion | None:  # fmt: skip
    """The staged region of the writer ``src`` in the decode rank ``dst``, seen from either side
    (``own``: this side's buffers; ``destination``: the decode's, which fix the order)."""
    peer = destination if own_is_source else None
    slices = exchanged_slices(own, own_is_source, src, dst, peer)
    if not slices:
        return None
    before = sum(
        writer_page_bytes(destination_slices(destination, TpPlace(src.size, rank), dst))
        for rank in feeding_ranks(src.size, dst)
        if rank < src.rank
    )
    return WriterRegion(before, writer_page_bytes(slices), slices)


def staged_slices(region: WriterRegion, pages: Sequence[int],
                  staging_addr: int) -> tuple[StagedSlices, ...]:  # fmt: skip
    """Gather (prefill) or scatter (decode) of one writer's slices of ``pages``, page after page
    from ``staging_addr`` (one description per page and geometry group: the layout must not
    depend on chunking)."""
    found = []
    groups = staging_groups(region.slices)
    for index, page in enumerate(pages):
        where = staging_addr + index * region.page_bytes
        for group in groups:
            cut = group[0].slice
            found.append(StagedSlices(
                buffer_addrs=tuple(member.addr for member in group), pages=(page,),
                page_size=cut.pieces, item_len=group[0].item_len, token_bytes=cut.stride,
                slice_offset=cut.offset, slice_bytes=cut.nbytes, staging_addr=where,
            ))  # fmt: skip
            where += len(group) * cut.pieces * cut.nbytes
    return tuple(found)


@functools.lru_cache(maxsize=_KEPT_PEER_LAYOUTS)
def _page_segments(region: WriterRegion) -> tuple[tuple[int, int, int, int], ...]:
    """Every slice of one page of ``region`` in staging order, as (address in the page-0 buffer,
    the buffer's item length, offset in the staged page, bytes): the order of
    :func:`staged_slices`, worked out once per region."""
    found = []
    where = 0
    for group in staging_groups(region.slices):
        for member in group:
            cut = member.slice
            for piece in range(cut.pieces):
                found.append((member.addr + cut.offset + piece * cut.stride, member.item_len,
                              where, cut.nbytes))  # fmt: skip
                where += cut.nbytes
    return tuple(found)


def copy_staged_host(region: WriterRegion, pages: Sequence[int], staging_addr: int,
                     gather: bool) -> None:  # fmt: skip
    """Gather (prefill) or scatter (decode) of a small staged chunk in host memory, on the
    calling thread: one ``memmove`` per slice, with none of the per-room descriptions
    :func:`staged_slices` builds for an executor (a 4-buffer page: a few us, against tens of us
    for those descriptions and numpy's views). The same bytes as the executor path."""
    memmove = ctypes.memmove
    segments = _page_segments(region)
    for index, page in enumerate(pages):
        base = staging_addr + index * region.page_bytes
        for addr, item_len, offset, nbytes in segments:
            if gather:
                memmove(base + offset, addr + page * item_len, nbytes)
            else:
                memmove(addr + page * item_len, base + offset, nbytes)


def staging_page_bytes(kv: KvBuffers) -> int:
    """Bytes one destination page occupies in a staging region (every buffer, whole page)."""
    return kv.page_bytes


# ---- digest ------------------------------------------------------------------------------------
class ChecksumExecutor(Protocol):
    def checksum(self, ranges: Sequence[ByteRange]) -> Checksum: ...


def kv_digest(executor: ChecksumExecutor, slices: Sequence[BufferSlice], pages: Sequence[int],
              dst_pages: Sequence[int], dst_pool: int, key_base: int = 0) -> int:  # fmt: skip
    """Digest of the exchanged slice of every buffer in ``slices`` over ``pages``, keyed by the
    destination buffer and page each lands in; the decode calls it with ``pages == dst_pages``
    over its own slices (:func:`~pdflow.core.dataplane.buffers.destination_slices`)."""
    total = 0
    for found in slices:
        for page, dst_page in zip(pages, dst_pages, strict=True):
            part = executor.checksum(found.ranges(page))
            key = key_base + found.index * dst_pool + dst_page + 1
            term = (part.weighted + part.plain * key) * _key_multiplier(key)
            total = (total + term) % ROOM_FOLD_MODULUS
    return total


_MASK64 = (1 << 64) - 1


@functools.lru_cache(maxsize=1 << 16)
def _key_multiplier(key: int) -> int:
    """An odd 64-bit number drawn from ``key`` (splitmix64's finaliser): terms of different
    destination pages or buffers weigh their bytes unrelatedly, and an odd factor loses none
    of a term's bits modulo 2**64."""
    z = (key + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) | 1


def default_executor() -> Executor:
    """Host-memory checksums: numpy when installed (no torch import on this path), else Python."""
    numpy = load_optional("numpy")
    return PythonExecutor() if numpy is None else NumpyExecutor(numpy)


def in_host_memory(ranks: Sequence[RankKv]) -> bool:
    """Whether every rank's KV lives in host memory (what the small-room copies, `memmove`s,
    need)."""
    return all(rank.device == "cpu" for rank in ranks)


def executor_for(ranks: Sequence[RankKv]) -> Executor:
    """The executor for the memory the ranks' buffers live in: host memory as
    :func:`default_executor`, device memory the best of Triton and torch there."""
    devices = sorted({rank.device for rank in ranks})
    if len(devices) != 1:
        raise InvalidInput(
            f"a node's ranks must all live in one device's memory, got {devices}; run one node "
            "per device"
        )
    device = devices[0]
    return default_executor() if device == "cpu" else make_executor(device)


class EngineMemory(msgspec.Struct, frozen=True):
    """Bytes an engine owns and lends pdflow, e.g. a staging region it allocated itself."""

    addr: int
    nbytes: int

    @classmethod
    def of_tensor(cls, tensor: Any) -> EngineMemory:
        """A contiguous tensor's storage (torch: ``data_ptr()``, ``numel() * element_size()``)."""
        if not tensor.is_contiguous():
            raise InvalidInput("staging memory must be one contiguous tensor")
        return cls(int(tensor.data_ptr()), int(tensor.numel() * tensor.element_size()))

    def check_holds(self, nbytes: int, what: str) -> None:
        if self.nbytes < nbytes:
            raise InvalidInput(
                f"{what} needs {nbytes} bytes but the engine's memory holds {self.nbytes}"
            )


# ---- aux rows ------------------------------------------------------------------------------------
def aux_buffer_of(kv: RankKv, what: str) -> AuxBuffer:
    """The rank's aux buffer, or a clear error for an engine that named an aux index without one."""
    if kv.aux is None:
        raise InvalidInput(
            f"{what} names an aux index but this rank has no aux buffer; give its RankKv an "
            "AuxBuffer (aux=) or pass aux_index=None"
        )
    return kv.aux


# One writable view per aux buffer (all its rows), made once per AuxBuffer: a row's items are
# then copied by slice assignment, which holds the GIL for its few bytes. ctypes.memmove and
# string_at are foreign calls that release and retake the GIL once per item (ten or more items
# per row in SGLang's metadata buffers), and each release handed the GIL to the scheduler's
# thread for a whole switch interval (benchmarks/README.md, nodes' per-room CPU pass).
_AUX_VIEWS: dict[AuxBuffer, tuple[memoryview, ...]] = {}
_AUX_VIEWS_KEPT = 64  # one AuxBuffer per rank: a handful per process


def _aux_views(aux: AuxBuffer) -> tuple[memoryview, ...]:
    views = _AUX_VIEWS.get(aux)
    if views is None:
        if len(_AUX_VIEWS) >= _AUX_VIEWS_KEPT:
            _AUX_VIEWS.clear()
        views = tuple(
            memoryview((ctypes.c_uint8 * (length * aux.num_rows)).from_address(addr)).cast("B")
            for addr, length in zip(aux.addrs, aux.item_lens, strict=True)
        )
        _AUX_VIEWS[aux] = views
    return views


def read_aux_row(aux: AuxBuffer, index: int) -> bytes:
    """Host memory: the row's bytes as they are now (its item in every aux buffer, in order)."""
    row = aux.row(index).row
    return b"".join(
        view[row * length : (row + 1) * length]
        for view, length in zip(_aux_views(aux), aux.item_lens, strict=True)
    )


def write_aux_row(aux: AuxBuffer, index: int, data: bytes) -> None:
    if len(data) != aux.row_bytes:
        raise InvalidInput(f"an aux row holds {aux.row_bytes} bytes, got {len(data)}")
    row = aux.row(index).row
    source = memoryview(data)
    offset = 0
    for view, length in zip(_aux_views(aux), aux.item_lens, strict=True):
        view[row * length : (row + 1) * length] = source[offset : offset + length]
        offset += length


# ---- host memory -------------------------------------------------------------------------------
class HostKvCache:
    """A zeroed, packed KV cache in host memory (tests, benchmarks, the demo's CPU engine)."""

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_heads: int,
                 head_dim: int, dtype: KvDtype) -> None:  # fmt: skip
        self.nbytes = 2 * num_layers * num_pages * page_size * num_heads * head_dim * dtype.itemsize
        self._memory = (ctypes.c_uint8 * self.nbytes)()
        self.base_addr = ctypes.addressof(self._memory)
        self.layout = packed_layout(base_addr=self.base_addr, num_layers=num_layers,
                                    num_pages=num_pages, page_size=page_size, num_heads=num_heads,
                                    head_dim=head_dim, dtype=dtype)  # fmt: skip

    @property
    def memory(self) -> ctypes.Array[ctypes.c_uint8]:
        """The bytes themselves (wrap with ``numpy.frombuffer`` or ``memoryview``)."""
        return self._memory


def host_cache_for_rank(*, total_kv_heads: int, tp_size: int, tp_rank: int, num_layers: int,
                        num_pages: int, page_size: int, head_dim: int,
                        dtype: KvDtype) -> tuple[HostKvCache, RankKv]:  # fmt: skip
    """Allocate the cache of one TP rank and describe it; the description holds the cache
    (``RankKv.owner``), so the memory lives at least as long as the ``RankKv``."""
    heads = rank_head_range(total_kv_heads, tp_size, tp_rank)
    cache = HostKvCache(num_layers=num_layers, num_pages=num_pages, page_size=page_size,
                        num_heads=heads.count, head_dim=head_dim, dtype=dtype)  # fmt: skip
    return cache, RankKv(cache.layout, tp_size, tp_rank, total_kv_heads, owner=cache)
