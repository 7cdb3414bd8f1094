"""Wire messages of the control plane: frozen, tagged msgspec Structs.

Every message names the room *and* its generation, so a late message from an earlier use of a
room id can be told apart from the current one; prefill-originated messages also carry the
sender's incarnation, so a message from a process that has since restarted is recognisable.
Handshake messages carry the protocol version.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

import msgspec

from pdflow.core.dataplane.buffers import KvBuffers
from pdflow.core.dataplane.layout import StateBuffers
from pdflow.core.framework.kvpoll import KVPoll

PROTOCOL_VERSION = 1

WIRE_INT_MAX = 2**63 - 1
"""Every room id, generation, page index, state index, aux row, offset and count a room message
carries is in ``[0, WIRE_INT_MAX]``: a non-negative signed 64-bit integer. SGLang keeps room
ids in its aux buffer as uint64, but as int64 on NPUs (its own warm-up rooms stay below 2**63);
its page indices are int32/int64 tensor indices; and a Mooncake write adds its offsets to 64-bit
addresses. The negative half is never valid: the prefill's room-id records keep -2**63 for "no
generation"."""

WireInt = Annotated[int, msgspec.Meta(ge=0, le=WIRE_INT_MAX)]
"""A room message's integer field: decoding refuses one outside the range (the codec drops the
frame as undecodable, naming the field)."""
WireCount = Annotated[int, msgspec.Meta(ge=1, le=WIRE_INT_MAX)]
"""A count that is at least one (how many decode ranks must send their metadata)."""
Unsigned = Annotated[int, msgspec.Meta(ge=0)]
"""A room's KV digest (a fold modulo 2**64, dataplane/checksum.py) or a memory address a
Mooncake write targets: an unsigned 64-bit integer. MessagePack carries none past 2**64 - 1, and
msgspec takes no bound past int64's, so only the sign is checked."""


def wire_int_refusal(what: str, values: int | Iterable[int]) -> str | None:
    """Why ``what`` (one integer or several) is not in the wire range; None when it is. The
    engine-facing checks use it, so a value the engine passes is refused with the same range a
    peer's message is decoded with."""
    if isinstance(values, int):
        if 0 <= values <= WIRE_INT_MAX:
            return None
        return f"{what} {values} is outside [0, 2**63 - 1]"
    items = values if isinstance(values, tuple) else tuple(values)
    # min and max scan in C: a room's page list is checked on every chunk and publish.
    if not items or (min(items) >= 0 and max(items) <= WIRE_INT_MAX):
        return None
    outside = next(value for value in items if not 0 <= value <= WIRE_INT_MAX)
    return f"{what} {outside} is outside [0, 2**63 - 1]"


def generation_refusal(generation: int) -> str | None:
    """Why ``generation`` is not one the protocol allows; None when it is."""
    return wire_int_refusal("generation", generation)


class PeerId(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """One rank of one process life: its control address and the incarnation drawn at start-up."""

    address: str
    incarnation: str
    rank: WireInt = 0


def peer_order(peer: PeerId) -> tuple[str, str, int]:
    """A total order on peers, so fan-outs and reports never depend on set iteration."""
    return (peer.address, peer.incarnation, peer.rank)


class Message(msgspec.Struct, frozen=True, gc=False, tag_field="type", forbid_unknown_fields=True):
    """Base of every control message."""
    # gc=False (inherited): instances hold only scalars, tuples and other untracked Structs, so
    # they can never be in a cycle; tests/unit/test_gc_untracked.py enforces it per class.


class RoomMetadata(Message, frozen=True, tag="room_metadata"):
    """Decode -> prefill: where this room's KV must land (the SGLang "TransferInfo")."""

    room: WireInt
    generation: WireInt
    decode: PeerId
    prefill: PeerId
    session_id: str
    dst_pages: tuple[WireInt, ...]
    aux_index: WireInt | None
    required_dst_info_num: WireCount
    decode_prefix_len: WireInt = 0
    is_dummy: bool = False
    staging_offset: WireInt | None = None
    state_indices: tuple[tuple[WireInt, ...], ...] = ()
    """The decode's model-state indices per state component (empty for a dummy)."""
    version: int = PROTOCOL_VERSION


class BootstrapRequest(Message, frozen=True, tag="bootstrap"):
    """Decode -> prefill (prefill_complete policy): tell me when your prefill has finished."""

    room: WireInt
    generation: WireInt
    decode: PeerId
    prefill: PeerId
    version: int = PROTOCOL_VERSION


class StatusReport(Message, frozen=True, tag="status"):
    """Prefill -> decode: ready (WaitingForInput), Success or Failed for one room."""

    room: WireInt
    generation: WireInt
    status: KVPoll
    prefill: PeerId
    decode: PeerId
    reason: str = ""
    checksum: Unsigned | None = None
    aux: bytes | None = None
    """With Success: the room's aux row (first token, logprobs, ...), for the decode's aux slot."""


class Abort(Message, frozen=True, tag="abort"):
    """Decode -> prefill: stop writing this room and ACK once every write has drained."""

    room: WireInt
    generation: WireInt
    decode: PeerId
    prefill: PeerId
    reason: str = ""


class AbortAck(Message, frozen=True, tag="abort_ack"):
    """Prefill -> decode: no write of this rank into this room can still land."""

    room: WireInt
    generation: WireInt
    prefill: PeerId
    decode: PeerId


class KvArgs(Message, frozen=True, tag="kv_args"):
    """Decode -> prefill, once per (decode rank, prefill rank life), before any other message to
    it on the same channel: where this decode rank's KV lives and which heads it holds (SGLang's
    "register KV args" frame)."""

    decode: PeerId
    prefill: PeerId
    session_id: str
    layout: KvBuffers
    """Every KV buffer of this decode rank (``RankKv.kv_buffers``)."""
    tp_size: WireCount
    tp_rank: WireInt
    total_kv_heads: WireCount
    staging_addr: Unsigned | None = None
    """Base of this decode rank's staging ring (heterogeneous TP), if it has one."""
    state: tuple[StateBuffers, ...] = ()
    """This decode rank's model-state components, in the order state indices name them."""
    started_at: float | None = None
    """When this decode process started (wall-clock seconds, read by its shell): orders the
    lives of one decode rank, so a prefill never lets an earlier life's late KvArgs replace a
    later life's layout. None: unordered (older than any life that says when it started)."""


class KvArgsAccepted(Message, frozen=True, tag="kv_args_accepted"):
    """Prefill -> decode: the layout is registered; this is the writer's transport session
    (the decode fences it there if the writer dies)."""

    prefill: PeerId
    decode: PeerId
    session_id: str


RoomMessage = RoomMetadata | BootstrapRequest | StatusReport | Abort | AbortAck
"""The messages about one room (each names the room and its generation)."""

AnyMessage = RoomMessage | KvArgs | KvArgsAccepted
