"""Wire messages of the control plane: frozen, tagged msgspec Structs.

Every message names the room *and* its generation, so a late message from an earlier use of a
room id can be told apart from the current one; prefill-originated messages also carry the
sender's incarnation, so a message from a process that has since restarted is recognisable.
Handshake messages carry the protocol version.
"""

from __future__ import annotations

import msgspec

from pdflow.core.dataplane.buffers import KvBuffers
from pdflow.core.dataplane.layout import StateBuffers
from pdflow.core.framework.kvpoll import KVPoll

PROTOCOL_VERSION = 1

MAX_GENERATION = 2**63 - 1
"""A generation is in ``[0, MAX_GENERATION]``: MessagePack's signed 64-bit range, less the
negative half, which the prefill's room-id records keep for "no generation" (-2**63)."""


def generation_refusal(generation: int) -> str | None:
    """Why ``generation`` is not one the protocol allows; None when it is."""
    if 0 <= generation <= MAX_GENERATION:
        return None
    return f"generation {generation} is outside [0, 2**63 - 1]"


class PeerId(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """One rank of one process life: its control address and the incarnation drawn at start-up."""

    address: str
    incarnation: str
    rank: int = 0


def peer_order(peer: PeerId) -> tuple[str, str, int]:
    """A total order on peers, so fan-outs and reports never depend on set iteration."""
    return (peer.address, peer.incarnation, peer.rank)


class Message(msgspec.Struct, frozen=True, gc=False, tag_field="type", forbid_unknown_fields=True):
    """Base of every control message."""
    # gc=False (inherited): instances hold only scalars, tuples and other untracked Structs, so
    # they can never be in a cycle; tests/unit/test_gc_untracked.py enforces it per class.


class RoomMetadata(Message, frozen=True, tag="room_metadata"):
    """Decode -> prefill: where this room's KV must land (the SGLang "TransferInfo")."""

    room: int
    generation: int
    decode: PeerId
    prefill: PeerId
    session_id: str
    dst_pages: tuple[int, ...]
    aux_index: int | None
    required_dst_info_num: int
    decode_prefix_len: int = 0
    is_dummy: bool = False
    staging_offset: int | None = None
    state_indices: tuple[tuple[int, ...], ...] = ()
    """The decode's model-state indices per state component (empty for a dummy)."""
    version: int = PROTOCOL_VERSION


class BootstrapRequest(Message, frozen=True, tag="bootstrap"):
    """Decode -> prefill (prefill_complete policy): tell me when your prefill has finished."""

    room: int
    generation: int
    decode: PeerId
    prefill: PeerId
    version: int = PROTOCOL_VERSION


class StatusReport(Message, frozen=True, tag="status"):
    """Prefill -> decode: ready (WaitingForInput), Success or Failed for one room."""

    room: int
    generation: int
    status: KVPoll
    prefill: PeerId
    decode: PeerId
    reason: str = ""
    checksum: int | None = None
    aux: bytes | None = None
    """With Success: the room's aux row (first token, logprobs, ...), for the decode's aux slot."""


class Abort(Message, frozen=True, tag="abort"):
    """Decode -> prefill: stop writing this room and ACK once every write has drained."""

    room: int
    generation: int
    decode: PeerId
    prefill: PeerId
    reason: str = ""


class AbortAck(Message, frozen=True, tag="abort_ack"):
    """Prefill -> decode: no write of this rank into this room can still land."""

    room: int
    generation: int
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
    tp_size: int
    tp_rank: int
    total_kv_heads: int
    staging_addr: int | None = None
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
