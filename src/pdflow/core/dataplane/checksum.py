"""End-to-end KV checksum: the definition and a pure-Python reference.

For a byte stream ``x_0 .. x_{n-1}`` (the concatenation of an ordered list of byte ranges) with
``P = 2**31 - 1``::

    plain    = (sum of x_i)            mod P
    weighted = (sum of (i + 1) * x_i)  mod P
    length   = n

``weighted`` makes the sum order-dependent: moving a byte changes it unless the shift is a
multiple of P (2 GiB). The checksum of a concatenation follows from its parts
(:meth:`Checksum.then`), so any backend may split the stream into blocks, reduce each block in
parallel and fold the blocks in order; all backends (this module, numpy, torch, Triton) must give
identical values.

Usage: the prefill checksums the source ranges of what it sent for a room, in plan order; the
decode, after Success, checksums the matching destination ranges in the same order and calls
:func:`compare_checksums`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable

import msgspec

from pdflow.core.framework.errors import InvalidInput

CHECKSUM_MODULUS = 2**31 - 1

ROOM_FOLD_MODULUS = 1 << 64
"""A room's digest is the sum of its transfers' digests modulo this (order-independent, so
completions may arrive in any order); the sender reports the fold, the decode recomputes it."""
# Pure-Python pieces stay small so the position weights stay cheap machine-size integers.
_PIECE_BYTES = 1 << 16


class Checksum(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Checksum of a byte stream; ``Checksum()`` is the empty stream."""

    plain: int = 0
    weighted: int = 0
    length: int = 0

    def __post_init__(self) -> None:
        for name in ("plain", "weighted"):
            value = getattr(self, name)
            if not 0 <= value < CHECKSUM_MODULUS:
                raise InvalidInput(f"Checksum.{name} must lie in [0, 2**31 - 1), got {value}")
        if self.length < 0:
            raise InvalidInput(f"Checksum.length must be >= 0, got {self.length}")

    def then(self, later: Checksum) -> Checksum:
        """Checksum of this stream followed by ``later``."""
        return Checksum(
            plain=(self.plain + later.plain) % CHECKSUM_MODULUS,
            weighted=(self.weighted + later.weighted + self.length * later.plain)
            % CHECKSUM_MODULUS,
            length=self.length + later.length,
        )

    @property
    def hex(self) -> str:
        return f"{self.plain:08x}{self.weighted:08x}/{self.length}"


def from_block_sums(plain_sum: int, weighted_sum: int, length: int) -> Checksum:
    """Build a checksum from unreduced sums computed over one stream with weights 1..length."""
    return Checksum(plain_sum % CHECKSUM_MODULUS, weighted_sum % CHECKSUM_MODULUS, length)


def fold(parts: Iterable[Checksum]) -> Checksum:
    """Checksum of the concatenation of streams, given theirs in order."""
    total = Checksum()
    for part in parts:
        total = total.then(part)
    return total


def checksum_bytes(data: bytes | bytearray | memoryview) -> Checksum:
    """Reference checksum of one byte string (pure Python, no dependencies)."""
    view = memoryview(data).cast("B")
    parts = []
    for start in range(0, len(view), _PIECE_BYTES):
        piece = view[start : start + _PIECE_BYTES]
        weighted = sum(map(operator.mul, piece, range(1, len(piece) + 1)))
        parts.append(from_block_sums(sum(piece), weighted, len(piece)))
    return fold(parts)


ByteRange = tuple[int, int]
"""``(address, length)`` of bytes in some address space."""


def checksum_ranges(read: Callable[[int, int], bytes], ranges: Iterable[ByteRange]) -> Checksum:
    """Checksum of ordered ranges; ``read(addr, length)`` fetches bytes, so this stays pure."""
    parts = []
    for addr, length in ranges:
        if length < 0:
            raise InvalidInput(f"byte range at {addr:#x} has negative length {length}")
        data = read(addr, length)
        if len(data) != length:
            raise InvalidInput(
                f"reader returned {len(data)} bytes for the {length}-byte range at {addr:#x}"
            )
        parts.append(checksum_bytes(data))
    return fold(parts)


class ChecksumMismatch(msgspec.Struct, frozen=True):
    """Why a received room's bytes do not match what the prefill sent."""

    expected: Checksum
    actual: Checksum

    @property
    def reason(self) -> str:
        if self.expected.length != self.actual.length:
            return (
                f"KV checksum covers {self.actual.length} received bytes but the prefill sent "
                f"{self.expected.length}: the decode checked different ranges than were written"
            )
        return (
            f"KV checksum mismatch over {self.expected.length} bytes: sent {self.expected.hex}, "
            f"received {self.actual.hex}; the pages were corrupted or overwritten in flight"
        )


def compare_checksums(expected: Checksum, actual: Checksum) -> ChecksumMismatch | None:
    """``None`` when the received bytes match, else the mismatch and its reason."""
    return None if expected == actual else ChecksumMismatch(expected, actual)
