"""The pure-Python checksum definition and mismatch reporting (no torch needed)."""

import pytest

from pdflow.core.dataplane.checksum import (
    CHECKSUM_MODULUS,
    Checksum,
    checksum_bytes,
    checksum_ranges,
    compare_checksums,
    fold,
)
from pdflow.core.framework.errors import InvalidInput


def by_definition(data: bytes) -> Checksum:
    return Checksum(
        sum(data) % CHECKSUM_MODULUS,
        sum((i + 1) * b for i, b in enumerate(data)) % CHECKSUM_MODULUS,
        len(data),
    )


def test_matches_the_definition_across_piece_boundaries() -> None:
    data = bytes((i * 37 + 11) % 256 for i in range(70_000))
    assert checksum_bytes(data) == by_definition(data)
    assert checksum_bytes(b"") == Checksum()


def test_concatenation_folds_in_order() -> None:
    parts = [b"abc", b"", b"defgh", b"\xff" * 1000]
    assert fold(checksum_bytes(p) for p in parts) == checksum_bytes(b"".join(parts))


def test_order_matters() -> None:
    assert checksum_bytes(b"\x01\x02") != checksum_bytes(b"\x02\x01")
    assert checksum_bytes(b"ab" + b"cd") != checksum_bytes(b"cd" + b"ab")


def test_ranges_read_through_the_reader() -> None:
    memory = bytes(range(200))

    def read(addr: int, length: int) -> bytes:
        return memory[addr : addr + length]

    assert checksum_ranges(read, [(10, 5), (100, 20)]) == checksum_bytes(
        memory[10:15] + memory[100:120]
    )
    with pytest.raises(InvalidInput, match="reader returned 0 bytes"):
        checksum_ranges(read, [(300, 4)])


def test_mismatch_reasons() -> None:
    sent = checksum_bytes(b"kv-bytes")
    assert compare_checksums(sent, checksum_bytes(b"kv-bytes")) is None
    corrupted = compare_checksums(sent, checksum_bytes(b"kv-bytez"))
    assert corrupted is not None and "corrupted or overwritten" in corrupted.reason
    short = compare_checksums(sent, checksum_bytes(b"kv"))
    assert short is not None and "checked different ranges" in short.reason


def test_rejects_out_of_range_fields() -> None:
    with pytest.raises(InvalidInput, match="plain"):
        Checksum(plain=CHECKSUM_MODULUS)
