"""A table of registered, non-overlapping memory regions with containment look-ups."""

from __future__ import annotations

import bisect

from pdflow.transport.base import RegistrationError


class RegionTable:
    """Registered `[start, start+length)` regions, kept sorted so look-ups are O(log n)."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._lengths: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._starts)

    def regions(self) -> list[tuple[int, int]]:
        """All regions as (start, length), in address order."""
        return [(start, self._lengths[start]) for start in self._starts]

    def check_can_add(self, addr: int, length: int) -> None:
        """Raise `RegistrationError` unless `add(addr, length)` would succeed."""
        if addr <= 0 or length <= 0:
            raise RegistrationError(
                f"buffer must have a positive address and length, got addr={addr:#x} "
                f"length={length}"
            )
        index = bisect.bisect_left(self._starts, addr)
        if index > 0:
            before = self._starts[index - 1]
            if before + self._lengths[before] > addr:
                raise RegistrationError(
                    f"buffer [{addr:#x}, +{length}) overlaps the registered buffer at {before:#x}"
                )
        if index < len(self._starts) and self._starts[index] < addr + length:
            raise RegistrationError(
                f"buffer [{addr:#x}, +{length}) overlaps the registered buffer at "
                f"{self._starts[index]:#x}"
            )

    def add(self, addr: int, length: int) -> None:
        self.check_can_add(addr, length)
        bisect.insort(self._starts, addr)
        self._lengths[addr] = length

    def check_can_remove(self, addr: int) -> None:
        if addr not in self._lengths:
            raise RegistrationError(
                f"no buffer is registered at {addr:#x}; pass the address given to register_buffer"
            )

    def remove(self, addr: int) -> None:
        self.check_can_remove(addr)
        del self._lengths[addr]
        self._starts.remove(addr)

    def covers(self, addr: int, length: int) -> bool:
        """Whether `[addr, addr+length)` lies inside one registered region."""
        index = bisect.bisect_right(self._starts, addr) - 1
        if index < 0 or length <= 0:
            return False
        start = self._starts[index]
        return addr + length <= start + self._lengths[start]
