"""A fake data plane that moves real bytes between per-rank page buffers.

Each prefill process life owns source pages: real buffers, each held by the room instance its
engine gave it to (filled with content derived from (room, generation, rank, page index)) and
given back when the endpoint says the room is removed; each decode rank owns destination pages.
A decode page is split in segments, one per prefill rank writing into it (heads or layers of the
KV). A write names its source pages at StartTransfer and reads them only when the driver lands
it, as a NIC reads registered memory while it moves the bytes: whole, partially (a failed
write), corrupted, or never (its target process died, or the decode fenced its writer). A write
that reads a source page its room instance no longer holds (freed, or handed to another room)
is recorded: the prefill side let go of memory a write still reads. The fence has the semantics
of a real receiver-side fence (pdflow.transport's ``fence``): once applied, no write of that
writer lands in that decode rank, even one already in flight; ``lift_fence`` admits again only
the writes started after it. Every landing is checked against the decode ledger *at landing
time*: a byte written into a page its room instance does not own is a use-after-free, recorded.
"""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

from pdflow.core.dataplane.checksum import ROOM_FOLD_MODULUS
from pdflow.core.protocol.messages import PeerId
from pdflow.core.protocol.outputs import VerifyChecksums

SEGMENT_BYTES = 16


def source_content(room: int, generation: int, writer_rank: int, page_index: int) -> bytes:
    """What prefill rank ``writer_rank`` holds for page ``page_index`` of a room instance."""
    key = f"{room}/{generation}/{writer_rank}/{page_index}".encode()
    return hashlib.blake2b(key, digest_size=SEGMENT_BYTES).digest()


def aux_content(room: int, generation: int) -> bytes:
    """The aux row a prefill engine holds for a room instance (the same on every rank)."""
    return hashlib.blake2b(f"aux/{room}/{generation}".encode(), digest_size=16).digest()


def segment_checksum(data: bytes | bytearray) -> int:
    return zlib.crc32(bytes(data))


def fold_checksums(values: list[int]) -> int:
    """The additive fold SenderRoom applies to the checksums of one peer's writes."""
    return sum(values) % ROOM_FOLD_MODULUS


@dataclass
class SourcePages:
    """One prefill process life's source pages: what each holds, and the room instance holding
    it (None: free). A dead life's pages stay as they were: nobody hands them out again."""

    content: list[bytes]
    holder: list[tuple[int, int] | None]

    @classmethod
    def empty(cls, pages: int) -> SourcePages:
        return cls([b""] * pages, [None] * pages)


@dataclass
class Write:
    wid: int
    writer_rank: int
    writer: PeerId
    target_rank: int
    target: PeerId
    room: int
    generation: int
    seq: int
    dst_pages: tuple[int, ...]
    segment: int
    src_pages: tuple[int, ...]
    aux: bytes | None = None
    """A last chunk's aux row, read from the engine's row when the write was issued."""
    moved: list[bytes] = field(default_factory=list)
    """The source bytes read so far, page by page, as the write landed."""
    landed: bool = False

    @property
    def checksum(self) -> int:
        """What the writer's checksum covers: the bytes it moved."""
        return fold_checksums([segment_checksum(d) for d in self.moved])


LOCAL_WRITE = -1
"""The write id of the decode shell's own work on a room's pages (the staged scatter)."""


@dataclass(frozen=True)
class LocalCheck:
    """A verification the decode shell started: the pages it scatters into and checks."""

    request: VerifyChecksums
    pages: tuple[int, ...]


@dataclass(frozen=True)
class UseAfterFree:
    write: int
    decode_rank: int
    page: int
    room: int
    generation: int
    owner: tuple[int, int] | None

    def describe(self) -> str:
        owner = "nobody (free)" if self.owner is None else f"room {self.owner[0]}/{self.owner[1]}"
        writer = "the local scatter" if self.write == LOCAL_WRITE else f"write {self.write}"
        return (
            f"{writer} of room {self.room}/{self.generation} landed in page "
            f"{self.page} of decode rank {self.decode_rank}, owned by {owner}"
        )


@dataclass(frozen=True)
class SourceReadAfterFree:
    write: int
    writer: PeerId
    page: int
    room: int
    generation: int
    holder: tuple[int, int] | None

    def describe(self) -> str:
        holder = "nobody (free)" if self.holder is None else (
            f"room {self.holder[0]}/{self.holder[1]}"
        )
        return (
            f"write {self.write} of room {self.room}/{self.generation} read source page "
            f"{self.page} of prefill {self.writer.address} (incarnation {self.writer.incarnation}) "
            f"while it was held by {holder}"
        )


OwnerLookup = Callable[[int, int], tuple[int, int] | None]
"""(decode rank, page) -> the (room, generation) owning it in the ledger, or None."""


@dataclass
class FakeTransport:
    segments: int
    decode_pages: int
    owner_of: OwnerLookup
    memory: dict[int, list[bytearray]] = field(default_factory=dict)
    sources: dict[PeerId, SourcePages] = field(default_factory=dict)
    """Each prefill process life's source pages, by the writer's identity."""
    live_targets: dict[int, PeerId] = field(default_factory=dict)
    fenced: dict[tuple[int, PeerId], int | None] = field(default_factory=dict)
    """(decode rank, writer) -> None while fenced, else the first write id allowed again."""
    writes: dict[int, Write] = field(default_factory=dict)
    violations: list[UseAfterFree] = field(default_factory=list)
    source_violations: list[SourceReadAfterFree] = field(default_factory=list)
    landed_bytes: int = 0
    pages_checked: int = 0
    """Decode pages a landing (or the local scatter) checked against the ledger."""
    sources_checked: int = 0
    """Source pages a landing write read and checked against their holder."""
    _next_wid: int = 0

    # ---- process lives ---------------------------------------------------------------------
    def decode_started(self, rank: int, me: PeerId) -> None:
        """A decode process (re)started: fresh memory; nothing of the old life survives."""
        self.memory[rank] = [
            bytearray(self.segments * SEGMENT_BYTES) for _ in range(self.decode_pages)
        ]
        self.live_targets[rank] = me

    def prefill_started(self, me: PeerId, pages: int) -> None:
        """A prefill process (re)started with ``pages`` free source pages of its own."""
        self.sources[me] = SourcePages.empty(pages)

    def fill_sources(self, writer: PeerId, pages: tuple[int, ...], room: int, generation: int,
                     rank: int) -> None:  # fmt: skip
        """The prefill engine computed a room instance's KV into these pages: they hold it."""
        source = self.sources[writer]
        for index, page in enumerate(pages):
            source.content[page] = source_content(room, generation, rank, index)
            source.holder[page] = (room, generation)

    def release_sources(self, writer: PeerId, pages: tuple[int, ...]) -> None:
        """The engine took these pages back (their bytes stay until another room fills them)."""
        source = self.sources[writer]
        for page in pages:
            source.holder[page] = None

    def fence(self, decode_rank: int, writer: PeerId) -> int:
        """The decode fenced ``writer`` on its receiving side: none of its writes, in flight
        now or started later, can land in that rank. Returns how many pending writes it doomed."""
        self.fenced[(decode_rank, writer)] = None
        doomed = [
            w.wid
            for w in self.writes.values()
            if w.target_rank == decode_rank and w.writer == writer and not w.landed
        ]
        return len(doomed)

    def lift_fence(self, decode_rank: int, writer: PeerId) -> None:
        """Writes ``writer`` starts from now on may land again; earlier ones stay refused."""
        if (decode_rank, writer) in self.fenced:
            self.fenced[(decode_rank, writer)] = self._next_wid

    def can_land(self, write: Write) -> bool:
        key = (write.target_rank, write.writer)
        allowed_from = self.fenced.get(key, 0)
        return (
            self.live_targets.get(write.target_rank) == write.target
            and allowed_from is not None
            and write.wid >= allowed_from
        )

    # ---- writes ----------------------------------------------------------------------------
    def next_write_id(self) -> int:
        self._next_wid += 1
        return self._next_wid - 1

    def add(self, write: Write) -> None:
        self.writes[write.wid] = write

    def land(self, write: Write, *, pages: int | None = None, corrupt: bool = False) -> bool:
        """Apply the write's bytes (the first ``pages`` only, if given). False: nothing landed."""
        if write.landed or not self.can_land(write):
            return False
        memory = self.memory[write.target_rank]
        count = len(write.dst_pages) if pages is None else pages
        start = write.segment * SEGMENT_BYTES
        pairs = zip(write.dst_pages, write.src_pages, strict=True)
        for index, (page, src_page) in enumerate(pairs):
            if index >= count:
                break
            data = self._read_source(write, src_page)
            write.moved.append(data)
            owner = self.owner_of(write.target_rank, page)
            self.pages_checked += 1
            if owner != (write.room, write.generation):
                self.violations.append(
                    UseAfterFree(
                        write.wid, write.target_rank, page, write.room, write.generation, owner
                    )
                )
            payload = bytes(b ^ 0xFF for b in data) if corrupt and index == 0 else data
            memory[page][start : start + SEGMENT_BYTES] = payload
            self.landed_bytes += len(payload)
        write.landed = pages is None
        return True

    def _read_source(self, write: Write, page: int) -> bytes:
        """The bytes a landing write reads from its writer's source page, now."""
        source = self.sources[write.writer]
        holder = source.holder[page]
        self.sources_checked += 1
        if holder != (write.room, write.generation):
            read = SourceReadAfterFree(
                write.wid, write.writer, page, write.room, write.generation, holder
            )
            self.source_violations.append(read)
        return source.content[page]

    def local_write(self, decode_rank: int, room: int, generation: int,
                    pages: tuple[int, ...]) -> None:  # fmt: skip
        """The decode's own verification touches the room's pages (a staged decode scatters
        into them first): each must still belong to the room."""
        for page in pages:
            owner = self.owner_of(decode_rank, page)
            self.pages_checked += 1
            if owner != (room, generation):
                self.violations.append(
                    UseAfterFree(LOCAL_WRITE, decode_rank, page, room, generation, owner)
                )

    def finish(self, write: Write) -> None:
        del self.writes[write.wid]

    def read_segment(self, decode_rank: int, page: int, segment: int) -> bytes:
        start = segment * SEGMENT_BYTES
        return bytes(self.memory[decode_rank][page][start : start + SEGMENT_BYTES])

    def checksum_of(self, decode_rank: int, pages: tuple[int, ...], segment: int) -> int:
        """What a checksum kernel would compute over one writer's segment of these pages."""
        return fold_checksums(
            [segment_checksum(self.read_segment(decode_rank, page, segment)) for page in pages]
        )
