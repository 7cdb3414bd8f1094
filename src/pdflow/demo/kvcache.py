"""Paged KV cache of the demo model, its page allocator, and head re-sharding between TP layouts.

Byte layout (what the data plane's layout descriptor describes)
----------------------------------------------------------------
One cache is one tensor-parallel shard: rank ``tp_rank`` of ``tp_size`` holds the KV heads
``[tp_rank * n_kv_heads / tp_size, (tp_rank + 1) * n_kv_heads / tp_size)``. All of its memory
is ONE contiguous float32 allocation, made once, so every address below stays valid for the
cache's lifetime and can be registered with a transfer engine (as one region or per buffer):

    storage[layer][kind][page][slot][head_local][dim]      kind 0 = K, 1 = V

so per layer comes the K buffer then the V buffer, and each buffer is page-major:

    buffer(layer, kind) base  = storage base + (2 * layer + kind) * buffer_nbytes
    page p of that buffer     = base + p * bytes_per_page
    bytes_per_page            = page_size * n_kv_heads_local * head_dim * 4
    buffer_nbytes             = num_pages * bytes_per_page

Inside a page, token slot ``s`` (token ``t`` of a sequence lives in page ``pages[t // page_size]``
at slot ``t % page_size``) is ``n_kv_heads_local * head_dim`` floats, head-major. K is stored
after RoPE. Going from TP=2 to TP=1 is therefore not a page copy: within every token slot,
rank 0's heads land in the first half and rank 1's in the second half (see ``reshard_pages``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

BYTES_PER_ELEMENT = 4  # float32: the demo needs bit-exact, deterministic arithmetic
DTYPE = torch.float32
K_INDEX, V_INDEX = 0, 1


class OutOfPagesError(RuntimeError):
    """The allocator cannot hand out the pages asked for; nothing was allocated."""


class PageAllocator:
    """Free list over ``[0, num_pages)``; hands out the lowest free pages first."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() yields lowest first
        self._allocated: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_allocated(self, page: int) -> bool:
        return page in self._allocated

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` pages at once: either all of them or, on error, none."""
        if count < 0:
            raise ValueError(f"page count must be >= 0, got {count}")
        if count > len(self._free):
            raise OutOfPagesError(
                f"need {count} pages but only {len(self._free)} of {self.num_pages} are free; "
                "free finished sequences' pages or build the cache with more num_pages"
            )
        pages = [self._free.pop() for _ in range(count)]
        self._allocated.update(pages)
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Return pages; all must be currently allocated and distinct, else nothing changes."""
        if len(set(pages)) != len(pages):
            raise ValueError(f"pages to free contain duplicates: {list(pages)}")
        not_allocated = [page for page in pages if page not in self._allocated]
        if not_allocated:
            raise ValueError(f"pages {not_allocated} are not allocated (double free or foreign)")
        self._allocated.difference_update(pages)
        # Keep the free list sorted descending so allocation order stays deterministic.
        self._free = sorted([*self._free, *pages], reverse=True)


@dataclass(frozen=True)
class KVGeometry:
    """Shape of the full (unsharded) KV of a model: what every TP shard is cut from."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    page_size: int = 16

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_kv_heads", "head_dim", "page_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.page_size)


class PagedKVCache:
    """KV pages of one TP shard (see the module docstring for the byte layout)."""

    def __init__(
        self, geometry: KVGeometry, num_pages: int, *, tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        if tp_size <= 0 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got rank {tp_rank} of {tp_size}")
        if geometry.n_kv_heads % tp_size:
            raise ValueError(
                f"{geometry.n_kv_heads} KV heads cannot be split evenly over tp_size {tp_size}"
            )
        self.geometry = geometry
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.heads_local = geometry.n_kv_heads // tp_size
        self.head_start = tp_rank * self.heads_local
        self.allocator = PageAllocator(num_pages)
        self._storage = torch.zeros(
            (
                geometry.n_layers,
                2,
                num_pages,
                geometry.page_size,
                self.heads_local,
                geometry.head_dim,
            ),
            dtype=DTYPE,
        )

    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    @property
    def head_range(self) -> range:
        """Global KV head indices this shard holds."""
        return range(self.head_start, self.head_start + self.heads_local)

    @property
    def bytes_per_page(self) -> int:
        return self.page_size * self.heads_local * self.geometry.head_dim * BYTES_PER_ELEMENT

    @property
    def buffer_nbytes(self) -> int:
        return self.num_pages * self.bytes_per_page

    @property
    def base_ptr(self) -> int:
        """Address of the single allocation holding every buffer."""
        return int(self._storage.data_ptr())

    @property
    def total_nbytes(self) -> int:
        return 2 * self.geometry.n_layers * self.buffer_nbytes

    def buffer(self, layer: int, kind: int) -> torch.Tensor:
        """``[num_pages, page_size, heads_local, head_dim]`` view; kind is K_INDEX or V_INDEX."""
        return self._storage[layer, kind]

    def buffers(self) -> list[torch.Tensor]:
        """All buffers in address order: layer 0 K, layer 0 V, layer 1 K, ..."""
        return [
            self.buffer(layer, kind)
            for layer in range(self.geometry.n_layers)
            for kind in (K_INDEX, V_INDEX)
        ]

    def data_ptrs(self) -> list[int]:
        """Base address of each buffer, in the order of ``buffers()``."""
        return [int(buffer.data_ptr()) for buffer in self.buffers()]

    def check_pages(self, pages: Sequence[int], num_tokens: int) -> None:
        """Raise unless ``pages`` are distinct, in range and enough for ``num_tokens`` tokens."""
        needed = self.geometry.pages_for(num_tokens)
        if len(pages) < needed:
            raise ValueError(
                f"{num_tokens} tokens need {needed} pages of {self.page_size}, got {len(pages)}"
            )
        out_of_range = [page for page in pages if not 0 <= page < self.num_pages]
        if out_of_range:
            raise ValueError(f"pages {out_of_range} outside [0, {self.num_pages})")
        if len(set(pages)) != len(pages):
            raise ValueError(f"page table contains duplicates: {list(pages)}")


def token_slots(
    pages: Sequence[int], start: int, count: int, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page index, slot) of tokens ``[start, start + count)`` of a sequence with page table."""
    positions = torch.arange(start, start + count)
    page_table = torch.tensor(list(pages), dtype=torch.long)
    return page_table[positions // page_size], positions % page_size


def check_tp_group(caches: Sequence[PagedKVCache]) -> None:
    """Raise unless ``caches`` are ranks 0..t-1 of one TP group over the same geometry."""
    if not caches:
        raise ValueError("need at least one cache")
    tp_size = caches[0].tp_size
    geometry = caches[0].geometry
    ranks = [cache.tp_rank for cache in caches]
    if ranks != list(range(tp_size)) or any(cache.tp_size != tp_size for cache in caches):
        raise ValueError(
            f"caches must be ranks 0..{tp_size - 1} of tp_size {tp_size} in order, got ranks "
            f"{ranks} of sizes {[cache.tp_size for cache in caches]}"
        )
    if any(cache.geometry != geometry for cache in caches):
        raise ValueError("caches of one TP group must share the same KV geometry")


class PagedSequenceKV:
    """One sequence's KV spread over the shards of a TP group, each with its own page table.

    Writes split the KV heads over the shards; reads gather them back in global head order,
    which is exactly the full K/V: this is how a TP instance lays out KV while the arithmetic
    stays that of the unsharded model.
    """

    def __init__(
        self,
        caches: Sequence[PagedKVCache],
        pages_per_rank: Sequence[Sequence[int]],
        capacity_tokens: int,
    ) -> None:
        check_tp_group(caches)
        if len(pages_per_rank) != len(caches):
            raise ValueError(f"{len(caches)} caches but {len(pages_per_rank)} page tables")
        for cache, pages in zip(caches, pages_per_rank, strict=True):
            cache.check_pages(pages, capacity_tokens)
        self._caches = list(caches)
        self._pages = [list(pages) for pages in pages_per_rank]
        self.capacity_tokens = capacity_tokens

    def write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``[n, n_kv_heads, head_dim]`` K and V for tokens ``[start, start + n)``."""
        count = keys.shape[0]
        if start + count > self.capacity_tokens:
            raise ValueError(
                f"tokens up to {start + count} exceed the {self.capacity_tokens} the pages hold"
            )
        for cache, pages in zip(self._caches, self._pages, strict=True):
            page_index, slot = token_slots(pages, start, count, cache.page_size)
            heads = slice(cache.head_start, cache.head_start + cache.heads_local)
            cache.buffer(layer, K_INDEX)[page_index, slot] = keys[:, heads]
            cache.buffer(layer, V_INDEX)[page_index, slot] = values[:, heads]

    def read(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[length, n_kv_heads, head_dim]`` of tokens ``[0, length)``."""
        if length > self.capacity_tokens:
            raise ValueError(f"{length} tokens exceed the {self.capacity_tokens} the pages hold")
        key_parts, value_parts = [], []
        for cache, pages in zip(self._caches, self._pages, strict=True):
            page_index, slot = token_slots(pages, 0, length, cache.page_size)
            key_parts.append(cache.buffer(layer, K_INDEX)[page_index, slot])
            value_parts.append(cache.buffer(layer, V_INDEX)[page_index, slot])
        return torch.cat(key_parts, dim=1), torch.cat(value_parts, dim=1)


def reshard_pages(
    sources: Sequence[PagedKVCache],
    source_pages: Sequence[Sequence[int]],
    destinations: Sequence[PagedKVCache],
    destination_pages: Sequence[Sequence[int]],
) -> None:
    """Copy whole pages from one TP layout into another, re-assembling heads per token slot.

    Page ``i`` of every source rank's table becomes page ``i`` of every destination rank's
    table; each destination takes the heads it owns from whichever source ranks hold them.
    This is the plain-torch reference of what heterogeneous-TP staging must produce.
    """
    check_tp_group(sources)
    check_tp_group(destinations)
    if sources[0].geometry != destinations[0].geometry:
        raise ValueError(
            f"source geometry {sources[0].geometry} != destination {destinations[0].geometry}"
        )
    if len(source_pages) != len(sources) or len(destination_pages) != len(destinations):
        raise ValueError("need exactly one page table per source and per destination cache")
    tables = [*source_pages, *destination_pages]
    num_pages = len(tables[0])
    if any(len(table) != num_pages for table in tables):
        raise ValueError(f"all page tables must have equal length, got {[len(t) for t in tables]}")
    tokens = num_pages * sources[0].page_size
    for cache, pages in zip([*sources, *destinations], tables, strict=True):
        cache.check_pages(pages, tokens)
    for destination, to_pages in zip(destinations, destination_pages, strict=True):
        to_index = torch.tensor(list(to_pages), dtype=torch.long)
        for source, from_pages in zip(sources, source_pages, strict=True):
            low = max(source.head_start, destination.head_start)
            high = min(
                source.head_start + source.heads_local,
                destination.head_start + destination.heads_local,
            )
            if low >= high:
                continue
            from_index = torch.tensor(list(from_pages), dtype=torch.long)
            from_heads = slice(low - source.head_start, high - source.head_start)
            to_heads = slice(low - destination.head_start, high - destination.head_start)
            for layer in range(sources[0].geometry.n_layers):
                for kind in (K_INDEX, V_INDEX):
                    destination.buffer(layer, kind)[to_index, :, to_heads] = source.buffer(
                        layer, kind
                    )[from_index][:, :, from_heads]
