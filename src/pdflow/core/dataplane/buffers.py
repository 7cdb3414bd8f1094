"""Engine-registered KV buffers: the memory an engine hands pdflow, as SGLang's ``KVArgs`` does.

An engine describes every KV tensor of one rank as a :class:`KvBuffer`: its base address, its
length and item length in bytes (one item is one page of that tensor; item lengths may differ
per buffer, e.g. per layer), its layer id and role (K, V, or an MLA latent, which has no V),
whether it belongs to the draft model (speculative decoding's extra buffers), how tensor
parallelism splits it (``total_heads``: heads over all TP ranks, split as
:func:`~pdflow.core.dataplane.layout.rank_head_range` splits them; 1 means every rank holds it
whole, as an MLA latent) and the order inside a page (:class:`PageOrder`). :class:`KvBuffers`
gathers one rank's buffers with their common page size. Buffers are matched across the two
sides by ``(draft, role, layer)``, so the two engines may list them in any order.

Which prefill rank writes which bytes of a decode rank's buffer (the TP rule,
:func:`shared_heads`): the prefill TP ranks feeding a decode rank are the one holding its heads
(decode TP >= prefill TP) or the group of ``prefill TP / decode TP`` ranks; within the group the
first rank holding each head range writes it and the rest write none of that tensor. For a
replicated tensor (an MLA latent) that makes exactly one writer per decode rank, and every other
rank of its group a dummy for it, as in :mod:`pdflow.core.cluster.topology`.

Inside one page a rank pair exchanges a :class:`PageSlice`: ``pieces`` runs of ``nbytes``,
``stride`` apart. Token-major pages (NHD, ``[token, head, dim]``) give one run per token,
head-major pages (HND, ``[head, token, dim]``) one run per page; a tensor both ranks hold whole
is one run per page, coalesced over pages consecutive on both sides.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence

import msgspec

from pdflow.core.dataplane.layout import (
    HeadRange,
    KvDtype,
    KvLayout,
    StateBuffers,
    check_spans,
    rank_head_range,
)
from pdflow.core.framework.errors import InvalidInput


class KvRole(enum.Enum):
    K = "k"
    V = "v"
    LATENT = "latent"
    """An MLA layer's compressed latent (and rope part): one buffer per layer, no V."""
    STATE = "state"
    """A model-state buffer (:func:`state_kv_buffers`; its "layer" is its buffer index)."""


class PageOrder(enum.Enum):
    NHD = "nhd"
    """Token-major: a page is ``[token, head, dim]`` (SGLang's default)."""
    HND = "hnd"
    """Head-major: a page is ``[head, token, dim]``; one head's tokens are contiguous."""


class TpPlace(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """A rank's place in its side's attention TP group."""

    size: int
    rank: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise InvalidInput(f"TP rank {self.rank} of size {self.size}: need 0 <= rank < size")


BufferKey = tuple[bool, str, int]
"""``(draft, role, layer)``: what names the same tensor on both sides."""


class KvBuffer(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """One KV tensor of one rank: ``length`` bytes from ``addr``, pages of ``item_len`` bytes."""

    addr: int
    length: int
    item_len: int
    layer: int
    role: KvRole = KvRole.K
    total_heads: int = 1
    """Heads of this tensor over all TP ranks; 1: replicated, every rank holds it whole."""
    draft: bool = False
    order: PageOrder = PageOrder.NHD

    def __post_init__(self) -> None:
        if self.addr < 0 or self.layer < 0:
            raise InvalidInput(f"KvBuffer address and layer must be >= 0 ({self.describe()})")
        for name in ("item_len", "total_heads"):
            if getattr(self, name) <= 0:
                raise InvalidInput(f"KvBuffer {name} must be positive ({self.describe()})")
        if self.length < self.item_len:
            raise InvalidInput(
                f"KvBuffer of {self.length} bytes cannot hold one page of {self.item_len} bytes "
                f"({self.describe()})"
            )
        check_spans(f"KvBuffer {self.describe()}", [(self.addr, self.length)])

    def describe(self) -> str:
        kind = "draft " if self.draft else ""
        return f"{kind}{self.role.value} of layer {self.layer}"

    @property
    def key(self) -> BufferKey:
        return (self.draft, self.role.value, self.layer)

    @property
    def num_pages(self) -> int:
        return self.length // self.item_len

    def heads(self, tp: TpPlace) -> HeadRange:
        return rank_head_range(self.total_heads, tp.size, tp.rank)

    def page_addr(self, page: int) -> int:
        return self.addr + page * self.item_len


class KvBuffers(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """One rank's KV tensors: every buffer is indexed by the same page ids."""

    page_size: int
    buffers: tuple[KvBuffer, ...]
    dtype: KvDtype = KvDtype.INT8
    """The element type the registry reports; only bytes move, so INT8 means "bytes"."""

    def __post_init__(self) -> None:
        if self.page_size <= 0 or not self.buffers:
            raise InvalidInput("KvBuffers needs a positive page_size and at least one buffer")
        keys = [buffer.key for buffer in self.buffers]
        if len(set(keys)) != len(keys):
            twice = sorted({b.describe() for b in self.buffers if keys.count(b.key) > 1})
            raise InvalidInput(f"KvBuffers names {twice} twice; each tensor is one buffer")
        spans = sorted((b.addr, b.addr + b.length) for b in self.buffers)
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise InvalidInput(f"KvBuffers overlap at {start:#x}; buffers must be disjoint")

    @property
    def num_pages(self) -> int:
        """Pages every buffer holds (the pool the page ids index)."""
        return min(buffer.num_pages for buffer in self.buffers)

    @property
    def total_heads(self) -> int:
        """The finest TP split of any tensor: what the topology splits the ranks by."""
        return max(buffer.total_heads for buffer in self.buffers)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over every buffer."""
        return sum(buffer.item_len for buffer in self.buffers)

    @classmethod
    def from_layout(cls, layout: KvLayout, total_heads: int) -> KvBuffers:
        """The description of a classic layout: K then V of every layer, token-major, the
        heads split over TP out of ``total_heads``."""
        return cls(layout.page_size, tuple(
            KvBuffer(addr, layout.buffer_bytes, layout.item_len, index % layout.num_layers,
                     KvRole.K if index < layout.num_layers else KvRole.V, total_heads)
            for index, addr in enumerate(layout.buffer_addrs)
        ), layout.dtype)  # fmt: skip

    def check_pages(self, pages: Sequence[int], what: str) -> None:
        """Reject page ids outside every buffer and pages listed twice."""
        pool = self.num_pages
        for page in pages:
            if not 0 <= page < pool:
                raise InvalidInput(f"{what} page {page} is outside [0, {pool})")
        if len(set(pages)) != len(pages):
            raise InvalidInput(f"{what} pages list a page twice; each page may be sent once")

    def head_bytes(self, buffer: KvBuffer, tp: TpPlace) -> int:
        """Bytes of one head of one token in ``buffer`` on the rank at ``tp``."""
        heads = buffer.heads(tp).count
        if buffer.item_len % (self.page_size * heads):
            raise InvalidInput(
                f"a page of {buffer.describe()} ({buffer.item_len} bytes) does not split into "
                f"{self.page_size} tokens x {heads} heads; give item lengths of whole heads"
            )
        return buffer.item_len // (self.page_size * heads)


class PageSlice(msgspec.Struct, frozen=True):
    """The bytes of one page a rank pair exchanges: ``pieces`` runs of ``nbytes``, the first at
    ``offset`` into the page and each ``stride`` after the previous."""

    offset: int
    nbytes: int
    pieces: int
    stride: int

    def ranges(self, page_addr: int) -> list[tuple[int, int]]:
        start = page_addr + self.offset
        return [(start + piece * self.stride, self.nbytes) for piece in range(self.pieces)]


def page_slice(item_len: int, order: PageOrder, page_size: int, head_bytes: int, own: HeadRange,
               shared: HeadRange, whole: bool) -> PageSlice:  # fmt: skip
    """Where ``shared`` heads sit in a page of ``item_len`` bytes on a rank holding ``own``
    heads; ``whole``: both ranks hold exactly these heads, so the page moves as one run."""
    if whole:
        return PageSlice(0, item_len, 1, item_len)
    skip = shared.start - own.start
    if order is PageOrder.HND:
        unit = page_size * head_bytes
        return PageSlice(skip * unit, shared.count * unit, 1, item_len)
    return PageSlice(skip * head_bytes, shared.count * head_bytes, page_size,
                     own.count * head_bytes)  # fmt: skip


def feeding_ranks(source_tp_size: int, dst: TpPlace) -> range:
    """The source TP ranks that feed the destination rank ``dst``."""
    if dst.size >= source_tp_size:
        if dst.size % source_tp_size:
            raise InvalidInput(f"TP sizes {source_tp_size} and {dst.size} do not divide")
        source = dst.rank // (dst.size // source_tp_size)
        return range(source, source + 1)
    if source_tp_size % dst.size:
        raise InvalidInput(f"TP sizes {source_tp_size} and {dst.size} do not divide")
    per = source_tp_size // dst.size
    return range(dst.rank * per, (dst.rank + 1) * per)


def shared_heads(total_heads: int, src: TpPlace, dst: TpPlace) -> HeadRange | None:
    """The heads of a tensor of ``total_heads`` that ``src`` writes into ``dst``; None when it
    writes none of it (it shares none, or an earlier rank of the group writes those heads)."""
    dst_heads = rank_head_range(total_heads, dst.size, dst.rank)
    covered: set[HeadRange] = set()
    for rank in feeding_ranks(src.size, dst):
        shared = rank_head_range(total_heads, src.size, rank).intersect(dst_heads)
        fresh = shared is not None and shared not in covered
        if rank == src.rank:
            return shared if fresh else None
        if shared is not None:
            covered.add(shared)
    return None


class BufferSlice(msgspec.Struct, frozen=True):
    """One buffer of one side and the slice of each of its pages a rank pair exchanges.
    ``index`` numbers the tensor in the destination's buffer order (the digest's key)."""

    index: int
    addr: int
    item_len: int
    slice: PageSlice
    group: tuple[int, int, str]
    """Buffers of one group have one geometry on either side (staging packs them together)."""

    def ranges(self, page: int) -> list[tuple[int, int]]:
        return self.slice.ranges(self.addr + page * self.item_len)


def _matched(src: KvBuffers, dst: KvBuffers,
             stage: bool = False) -> list[tuple[KvBuffer, KvBuffer]]:  # fmt: skip
    """The destination's buffers in order, each with the source's buffer of the same tensor;
    ``stage``: the source is one pipeline stage, holding only some of the tensors (the other
    stages write the rest)."""
    if src.page_size != dst.page_size:
        raise InvalidInput(f"page sizes differ: source {src.page_size}, destination "
                           f"{dst.page_size}; both engines must page KV alike")  # fmt: skip
    by_key = {buffer.key: buffer for buffer in src.buffers}
    missing = [] if stage else sorted(b.describe() for b in dst.buffers if b.key not in by_key)
    extra = sorted(b.describe() for b in src.buffers if b.key not in {d.key for d in dst.buffers})
    if missing or extra:
        raise InvalidInput(
            f"the two sides describe different KV tensors (only the destination has {missing}, "
            f"only the source {extra}); both engines must register the same model's buffers"
        )
    pairs = [(by_key[d.key], d) for d in dst.buffers if d.key in by_key]
    for s, d in pairs:
        if (s.total_heads, s.order) != (d.total_heads, d.order):
            raise InvalidInput(
                f"{d.describe()} differs between the sides: heads {s.total_heads} vs "
                f"{d.total_heads}, order {s.order.value} vs {d.order.value}"
            )
    return pairs


def exchanged_slices(own: KvBuffers, own_is_source: bool, src: TpPlace, dst: TpPlace,
                     peer: KvBuffers | None = None,
                     stage: bool = False) -> tuple[BufferSlice, ...]:  # fmt: skip
    """The buffers of ``own`` that the pair ``src -> dst`` exchanges, in the destination's
    buffer order, with each page's slice on this side. A source passes the destination's
    description as ``peer`` (it orders and checks the tensors); a destination passes None."""
    if own_is_source:
        if peer is None:
            raise InvalidInput("the source side needs the destination's buffers to plan")
        pairs = _matched(own, peer, stage)
        order = {buffer.key: index for index, buffer in enumerate(peer.buffers)}
    else:
        pairs = [(buffer, buffer) for buffer in own.buffers]
        order = {buffer.key: index for index, buffer in enumerate(own.buffers)}
    place = src if own_is_source else dst
    found = []
    for src_buffer, dst_buffer in pairs:
        index = order[dst_buffer.key]
        mine = src_buffer if own_is_source else dst_buffer
        shared = shared_heads(mine.total_heads, src, dst)
        if shared is None:
            continue
        head_bytes = own.head_bytes(mine, place)
        if peer is not None:
            theirs = peer.head_bytes(dst_buffer, dst)
            if theirs != head_bytes:
                raise InvalidInput(
                    f"{mine.describe()}: a head is {head_bytes} bytes here but {theirs} on the "
                    "destination; both engines must run the same model and dtype"
                )
        src_heads, dst_heads = mine.heads(src), mine.heads(dst)
        whole = shared == src_heads == dst_heads
        cut = page_slice(mine.item_len, mine.order, own.page_size, head_bytes, mine.heads(place),
                         shared, whole)  # fmt: skip
        group = (mine.total_heads, head_bytes, mine.order.value)
        found.append(BufferSlice(index, mine.addr, mine.item_len, cut, group))
    return tuple(found)


def destination_slices(dst: KvBuffers, src: TpPlace, dst_tp: TpPlace) -> tuple[BufferSlice, ...]:
    """What the writer at ``src`` fills in each page of the destination's buffers."""
    return exchanged_slices(dst, False, src, dst_tp)


def writer_page_bytes(slices: Sequence[BufferSlice]) -> int:
    """Bytes one page of a writer's slices takes in a staging region."""
    return sum(s.slice.pieces * s.slice.nbytes for s in slices)


def staging_groups(slices: Sequence[BufferSlice]) -> tuple[tuple[BufferSlice, ...], ...]:
    """A page's slices in staging order: groups of one geometry in order of first appearance,
    buffers in destination order inside each (both sides derive the same order)."""
    groups: dict[tuple[int, int, str], list[BufferSlice]] = {}
    for found in slices:
        groups.setdefault(found.group, []).append(found)
    return tuple(tuple(group) for group in groups.values())


def state_kv_buffers(component: StateBuffers) -> KvBuffers:
    """A model-state component as tensors the KV planner moves: an item is a page of
    ``tokens`` token-major rows, split over TP by each buffer's total heads."""
    return KvBuffers(component.tokens, tuple(
        KvBuffer(addr, component.num_items * length, length, index, KvRole.STATE, heads)
        for index, (addr, length, heads) in enumerate(
            zip(component.addrs, component.item_lens, component.heads_per_buffer, strict=True))
    ))  # fmt: skip
