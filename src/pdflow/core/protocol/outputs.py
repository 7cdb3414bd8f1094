"""Effects the core asks the shell to carry out. Plain data; the shell never decides."""

from __future__ import annotations

import msgspec

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import AnyMessage, PeerId


class Output(msgspec.Struct, frozen=True, gc=False, tag_field="type"):
    """Base of every output."""
    # gc=False (inherited): instances hold only scalars, tuples and other untracked Structs, so
    # they can never be in a cycle; tests/unit/test_gc_untracked.py enforces it per class.


class SendMessage(Output, frozen=True, tag="send"):
    to: PeerId
    message: AnyMessage


class StartTransfer(Output, frozen=True, tag="start_transfer"):
    """Write ``src_pages`` of this prefill rank into ``dst_pages`` of one decode peer.

    ``seq`` identifies the transfer within its room; the shell answers with a
    ``TransferCompleted`` carrying the same ``seq``.
    """

    room: int
    generation: int
    seq: int
    peer: PeerId
    session_id: str
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    is_last: bool
    aux_index: int | None
    staging_offset: int | None
    page_start: int = 0
    """Index of the chunk's first page within the room (its place in a staging region)."""
    room_pages: int = 0
    """How many pages the decode published for the room."""
    src_state: tuple[tuple[int, ...], ...] = ()
    """Last chunk only: the prefill's model-state indices per component ..."""
    dst_state: tuple[tuple[int, ...], ...] = ()
    """... and where each lands on the decode (same counts)."""
    src_aux_index: int | None = None
    """Last chunk only: the engine's aux row the shell reads once the writes are done and hands
    back in ``TransferCompleted.aux``."""


class StatusChanged(Output, frozen=True, tag="status_changed"):
    room: int
    generation: int
    poll: KVPoll
    reason: str = ""


class ArmFence(Output, frozen=True, tag="arm_fence"):
    """Decode: hold this room's pages until every writer has ACKed its drain (or is dead and its
    transport session closed). Emitted before the matching ABORT messages."""

    room: int
    generation: int
    writers: tuple[PeerId, ...]


class VerifyChecksums(Output, frozen=True, tag="verify_checksums"):
    """Decode: recompute the checksum of what each prefill rank wrote and report back."""

    room: int
    generation: int
    expected: tuple[tuple[PeerId, int], ...]


class StoreAux(Output, frozen=True, tag="store_aux"):
    """Decode: write the room's aux row into the engine's aux slot ``aux_index`` (before the
    Success it precedes is reported)."""

    room: int
    generation: int
    aux_index: int
    data: bytes


_EMIT_NAMES: dict[type[msgspec.Struct], str] = {}
"""Each output (and sent message) type's spec name, worked out once per type: one step checks
every output it emits by name."""


_BY_MESSAGE = ""
"""What ``_EMIT_NAMES`` holds for a SendMessage type: the name is the sent message's."""


def emit_name(output: Output) -> str:
    """The name the spec uses for an output: ``send.<message tag>`` or the output's tag."""
    kind = type(output)
    name = _EMIT_NAMES.get(kind)
    if name is None:
        sends = issubclass(kind, SendMessage)
        name = _EMIT_NAMES[kind] = _BY_MESSAGE if sends else str(kind.__struct_config__.tag)
    if name != _BY_MESSAGE:
        return name
    sent = type(output.message)  # type: ignore[attr-defined]
    name = _EMIT_NAMES.get(sent)
    if name is None:
        name = _EMIT_NAMES[sent] = f"send.{sent.__struct_config__.tag}"
    return name
