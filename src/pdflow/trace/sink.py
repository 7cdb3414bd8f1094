"""A size-bounded JSON-lines file: where the trace recorder writes its lines.

When the next line would pass ``max_bytes`` the file is rotated (``trace.jsonl`` becomes
``trace.jsonl.1``, ``.1`` becomes ``.2``, ... up to ``backups``; the oldest is deleted) and the
endpoint headers are written again at the top of the new file, so every file names its endpoints.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO


class RotatingLineFile:
    def __init__(self, path: Path, *, max_bytes: int, backups: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        if backups < 0:
            raise ValueError(f"backups must be >= 0, got {backups}")
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups
        self.rotations = 0
        self._preamble: list[bytes] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO = path.open("wb")
        self._size = 0

    def add_preamble(self, line: bytes) -> None:
        """A line repeated at the top of every rotated file (the endpoint headers)."""
        self._preamble.append(line)
        self._write(line)

    def msg(self, line: bytes) -> None:
        """Write one encoded line (the recorder calls this once per step)."""
        if self._size + len(line) + 1 > self.max_bytes and self._size > self._preamble_size():
            self._rotate()
        self._write(line)

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def _write(self, line: bytes) -> None:
        self._file.write(line + b"\n")  # one buffered write per line, not two
        self._size += len(line) + 1

    def _preamble_size(self) -> int:
        return sum(len(line) + 1 for line in self._preamble)

    def _rotate(self) -> None:
        self._file.close()
        if self.backups == 0:
            self.path.unlink(missing_ok=True)
        else:
            oldest = self._backup(self.backups)
            oldest.unlink(missing_ok=True)
            for index in range(self.backups - 1, 0, -1):
                if self._backup(index).exists():
                    os.replace(self._backup(index), self._backup(index + 1))
            os.replace(self.path, self._backup(1))
        self._file = self.path.open("wb")
        self._size = 0
        self.rotations += 1
        for line in self._preamble:
            self._write(line)

    def _backup(self, index: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{index}")
