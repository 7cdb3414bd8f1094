"""Inputs to the room machines: API calls, received messages, transfer results, timers."""

from __future__ import annotations

import msgspec

from pdflow.core.protocol.messages import Abort, PeerId, RoomMetadata


class Input(msgspec.Struct, frozen=True, gc=False, tag_field="type"):
    """Base of every input. The spec names an input by its class name."""
    # gc=False (inherited): instances hold only scalars, tuples and other untracked Structs, so
    # they can never be in a cycle; tests/unit/test_gc_untracked.py enforces it per class.


# ---- shared by both sides -------------------------------------------------------------------
class Tick(Input, frozen=True, tag="Tick"):
    """A timer fired (or the shell is simply passing time)."""


class AbortRequested(Input, frozen=True, tag="AbortRequested"):
    """The local engine gives up on the room."""

    reason: str = "aborted by the engine"


# ---- sender (prefill) ---------------------------------------------------------------------------
class MetadataArrived(Input, frozen=True, tag="MetadataArrived"):
    metadata: RoomMetadata


class InitTransfer(Input, frozen=True, tag="InitTransfer"):
    """The engine admitted the room for sending: it will send ``num_pages`` pages.

    ``aux_index`` is the room's row in the engine's aux (metadata) buffer: the first output
    token and whatever else the decode needs before it may run the request. The shell reads it
    after the last chunk's writes and the row travels on the Success report (docs/architecture.md).
    """

    num_pages: int
    aux_index: int | None = None


class SendChunk(Input, frozen=True, tag="SendChunk"):
    """The next pages, in order. Chunks partition ``[0, num_pages)``; exactly one is last.

    ``state_indices`` (last chunk only): the request's indices into each of this rank's model
    state components, in their order (a Mamba slot, the sliding-window pages, a blob slot).
    """

    src_pages: tuple[int, ...]
    is_last: bool
    state_indices: tuple[tuple[int, ...], ...] = ()


class TransferCompleted(Input, frozen=True, tag="TransferCompleted"):
    """The transport finished the StartTransfer with this room, generation and ``seq``.

    The shell hands it to the prefill endpoint, which checks the generation and passes the
    same input to the room."""

    room: int
    generation: int
    seq: int
    ok: bool
    reason: str = ""
    checksum: int | None = None
    aux: bytes | None = None
    """For a last chunk that named a source aux row: that row's bytes, read after the writes."""


class AbortArrived(Input, frozen=True, tag="AbortArrived"):
    abort: Abort


class PrefillCompleted(Input, frozen=True, tag="PrefillCompleted"):
    """The engine finished computing the room's KV (starts the prefill_complete bootstrap clock)."""


# ---- receiver (decode) --------------------------------------------------------------------------
class PrefillTarget(msgspec.Struct, frozen=True, gc=False):
    """One prefill rank this decode rank exchanges with for a room."""

    peer: PeerId
    is_dummy: bool = False


class PeersResolved(Input, frozen=True, tag="PeersResolved"):
    """Topology resolved: the prefill ranks of this room and how many must report Success."""

    targets: tuple[PrefillTarget, ...]
    required_responses: int
    required_dst_info_num: int = 1


class ResolveFailed(Input, frozen=True, tag="ResolveFailed"):
    reason: str


class PublishPages(Input, frozen=True, tag="PublishPages"):
    """The engine reserved destination pages for a room (they must be free in the ledger).

    The engine hands it to the decode endpoint, which passes the same input to the room once
    the pages may be exposed. With staging on, the endpoint first places the room's staging
    region; if the ring is still busy there the publication waits (the room stays
    WaitingForInput) until it frees up.
    """

    room: int
    dst_pages: tuple[int, ...]
    aux_index: int | None
    decode_prefix_len: int = 0
    state_indices: tuple[tuple[int, ...], ...] = ()
    """Where the request's model state lands: indices into each of the decode's state
    components, in their order (the prefill sends the same number for each)."""


class ReadyArrived(Input, frozen=True, tag="ReadyArrived"):
    prefill: PeerId


class SuccessArrived(Input, frozen=True, tag="SuccessArrived"):
    prefill: PeerId
    checksum: int | None = None
    aux: bytes | None = None


class FailureArrived(Input, frozen=True, tag="FailureArrived"):
    prefill: PeerId
    reason: str = ""


class PeerDied(Input, frozen=True, tag="PeerDied"):
    """The heartbeat declared one of the room's prefill ranks dead."""

    peer: PeerId


class StagingWait(Input, frozen=True, tag="StagingWait"):
    """The endpoint holds the room's published pages until staging-ring space frees: the
    waiting budget bounds that wait."""


class ChecksumResult(Input, frozen=True, tag="ChecksumResult"):
    ok: bool
    reason: str = ""
