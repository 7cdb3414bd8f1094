"""Canary bytes in a decode rank's free pages, to catch a write landing in a released page.

The engine fills every page it holds as free (never handed out, or given back by
PagesReleased) with CANARY; a page whose bytes differ later was written after its release.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

from pdflow.core.dataplane.layout import KvLayout

CANARY = 0xC3


class Canaries:
    def __init__(self, layout: KvLayout) -> None:
        self.layout = layout

    def _slices(self, page: int) -> Iterable[int]:
        return (self.layout.page_addr(b, page) for b in range(len(self.layout.buffer_addrs)))

    def fill(self, pages: Iterable[int]) -> None:
        for page in pages:
            for addr in self._slices(page):
                ctypes.memset(addr, CANARY, self.layout.item_len)

    def damaged(self, pages: Iterable[int]) -> list[int]:
        """The pages among ``pages`` with any byte that is not the canary."""
        intact = bytes([CANARY]) * self.layout.item_len
        return sorted(
            page for page in pages
            if any(ctypes.string_at(addr, self.layout.item_len) != intact
                   for addr in self._slices(page))
        )  # fmt: skip
