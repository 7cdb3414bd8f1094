"""read_aux_row / write_aux_row over several aux buffers of different item sizes."""

from __future__ import annotations

import ctypes

import pytest

from pdflow.core.dataplane.layout import AuxBuffer
from pdflow.core.framework.errors import InvalidInput
from pdflow.io.kv_buffers import read_aux_row, write_aux_row

ITEM_LENS = (64, 512, 8, 128)
ROWS = 5


def _buffers() -> tuple[list[ctypes.Array[ctypes.c_uint8]], AuxBuffer]:
    memory = [(ctypes.c_uint8 * (length * ROWS))() for length in ITEM_LENS]
    aux = AuxBuffer(tuple(ctypes.addressof(m) for m in memory), ITEM_LENS, ROWS)
    return memory, aux


def test_a_row_lands_in_its_item_of_every_buffer_and_nowhere_else() -> None:
    memory, aux = _buffers()
    row = bytes(i % 251 + 1 for i in range(aux.row_bytes))
    write_aux_row(aux, 3, row)
    offset = 0
    for buffer, length in zip(memory, ITEM_LENS, strict=True):
        raw = bytes(buffer)
        assert raw[3 * length : 4 * length] == row[offset : offset + length]
        assert raw[: 3 * length] == bytes(3 * length)  # the rows before are untouched
        assert raw[4 * length :] == bytes(length)  # and the row after
        offset += length
    assert read_aux_row(aux, 3) == row
    assert read_aux_row(aux, 2) == bytes(aux.row_bytes)


def test_reads_see_what_the_engine_wrote_since() -> None:
    memory, aux = _buffers()
    assert read_aux_row(aux, 0) == bytes(aux.row_bytes)  # the views are made here
    memory[1][0] = 7  # the engine writes its buffer directly
    assert read_aux_row(aux, 0)[ITEM_LENS[0]] == 7
    write_aux_row(aux, 4, bytes([9]) * aux.row_bytes)
    assert memory[3][4 * ITEM_LENS[3]] == 9


def test_a_row_of_the_wrong_size_or_outside_the_buffers_is_refused() -> None:
    memory, aux = _buffers()
    with pytest.raises(InvalidInput, match="holds"):
        write_aux_row(aux, 0, bytes(aux.row_bytes - 1))
    with pytest.raises(InvalidInput, match="outside"):
        write_aux_row(aux, ROWS, bytes(aux.row_bytes))
    with pytest.raises(InvalidInput, match="outside"):
        read_aux_row(aux, -1)
    assert all(bytes(buffer) == bytes(len(buffer)) for buffer in memory)
