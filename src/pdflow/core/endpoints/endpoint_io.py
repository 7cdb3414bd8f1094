"""Inputs and outputs of the endpoints (one endpoint per rank, hosting many rooms).

Endpoint inputs wrap everything that can happen to a rank: an engine API call, a control
message off the wire, a transport completion, a heartbeat result, a timer. They are what the
trace records and what replay feeds back.
"""

from __future__ import annotations

import msgspec

from pdflow.core.dataplane.buffers import KvBuffers
from pdflow.core.dataplane.layout import StateBuffers
from pdflow.core.protocol.inputs import (
    AbortRequested,
    InitTransfer,
    Input,
    PrefillCompleted,
    PublishPages,
    SendChunk,
    TransferCompleted,
)
from pdflow.core.protocol.messages import AnyMessage, PeerId
from pdflow.core.protocol.outputs import Output
from pdflow.core.protocol.policy import AllocationPolicy, Timeouts
from pdflow.core.resources.page_ledger import SessionClosed, SessionRetired


class EndpointInput(msgspec.Struct, frozen=True, gc=False, tag_field="type"):
    """Base of every endpoint input."""


class OpenRoom(EndpointInput, frozen=True, tag="OpenRoom"):
    """The engine starts a request on this rank. A room id already open is refused."""

    room: int
    generation: int


EngineCall = InitTransfer | SendChunk | AbortRequested | PrefillCompleted


class RoomCall(EndpointInput, frozen=True, tag="RoomCall"):
    """An engine call addressed to one open room (InitTransfer, SendChunk, AbortRequested...)."""

    room: int
    call: EngineCall


class ClearRoom(EndpointInput, frozen=True, tag="ClearRoom"):
    """The engine is done with a terminal room. A failed room still draining is removed later."""

    room: int


class Received(EndpointInput, frozen=True, tag="Received"):
    """A control message arrived from a peer. ``msg_id`` names the sending trace record's output
    (``"<endpoint>:<seq>:<index>"``) when the sender put it on the wire; it only orders traces."""

    message: AnyMessage
    msg_id: str | None = None


class TimerFired(EndpointInput, frozen=True, tag="TimerFired"):
    """Time has passed; every deadline at or before ``now`` fires."""


# ---- decode-only ------------------------------------------------------------------------------
class RegisteredPrefillRank(msgspec.Struct, frozen=True, gc=False):
    """One prefill rank as the bootstrap registry describes it."""

    dp: int
    cp: int
    tp: int
    pp: int
    peer: PeerId
    health: str | None = None
    """The rank's process's own health endpoint (``host:port``), probed by the heartbeat;
    None (SGLang): only the registry's ``/health`` is known."""


class PrefillInfo(msgspec.Struct, frozen=True, gc=False):
    """A prefill instance's topology, as fetched from its bootstrap registry."""

    bootstrap: str
    tp_size: int
    cp_size: int
    pp_size: int
    dp_size: int
    page_size: int
    kv_cache_dtype: str
    policy: AllocationPolicy
    ranks: tuple[RegisteredPrefillRank, ...]
    is_mla: bool = False
    follow_bootstrap_room: bool = True
    checksum: bool | None = None
    """Whether the prefill registered as sending KV checksums; None: it did not say (SGLang)."""
    staging_slot_bytes: int = 0
    """The staging slot every rank of the prefill holds (bytes): a small room larger than it,
    or any small room of a prefill that declared none (0), is written directly."""


class OpenReceiver(EndpointInput, frozen=True, tag="OpenReceiver"):
    """The engine starts receiving a room from the prefill instance behind ``bootstrap``."""

    room: int
    generation: int
    bootstrap: str
    prefill_dp_rank: int | None = None


class TopologyKnown(EndpointInput, frozen=True, tag="TopologyKnown"):
    info: PrefillInfo


class TopologyFailed(EndpointInput, frozen=True, tag="TopologyFailed"):
    bootstrap: str
    reason: str


class HeartbeatResult(EndpointInput, frozen=True, tag="HeartbeatResult"):
    """One /health probe of a prefill instance: ok, and the incarnation it reported if any.

    ``health`` is the instance's own health address that was probed; None: the registry's
    ``/health`` at ``bootstrap`` (all the decode knows of an SGLang prefill)."""

    bootstrap: str
    ok: bool
    incarnation: str | None = None
    health: str | None = None


class ChecksumChecked(Input, frozen=True, tag="ChecksumChecked"):
    """The shell recomputed a room's checksums (an input of the endpoint and of its room slot)."""

    room: int
    generation: int
    ok: bool
    reason: str = ""


# ---- endpoint outputs --------------------------------------------------------------------------
class Dropped(Output, frozen=True, tag="dropped"):
    """A message or input was refused and counted; nothing changed."""

    kind: str
    reason: str


class NeedTopology(Output, frozen=True, tag="need_topology"):
    """Fetch the topology of the prefill instance behind this bootstrap address."""

    bootstrap: str


class CloseSession(Output, frozen=True, tag="close_session"):
    """Fence this dead writer on the receiving side, then report SessionClosed; where the
    transport's fence is not real, report nothing (its pages wait for the drain ACK)."""

    peer: PeerId
    session_id: str | None = None
    """The writer's transport session, as its KvArgsAccepted named it (None: never heard)."""


class SessionRotated(EndpointInput, frozen=True, tag="SessionRotated"):
    """Decode: the shell opened a new transport engine (same memory registered) under
    ``session``. Rooms opened from now on, and rooms not yet published, use it; the layout is
    announced again, with it, to every prefill rank before its next message. The previous
    session stays until the shell retires it (SessionRetired), once no live room uses it."""

    session: str


class ReadmitWriter(Output, frozen=True, tag="readmit_writer"):
    """A writer wrongly declared dead answered again and owes no drain ACK: lift the receiver
    fence for the writes it issues from now on (those issued before stay refused)."""

    peer: PeerId
    session_id: str | None = None
    """The writer's transport session, as it was when the writer was fenced (None: unknown)."""


class IncarnationSuperseded(Output, frozen=True, tag="incarnation_superseded"):
    """Another incarnation replaced this one behind ``bootstrap``: it is never readmitted."""

    bootstrap: str
    incarnation: str


class StagingPlaced(Output, frozen=True, tag="staging_placed"):
    """Decode: the room's staging region (writers fill it back to back in rank order); the shell
    scatters it into the room's pages when asked to verify the room, then it is released."""

    room: int
    generation: int
    offset: int
    nbytes: int


class RoomRemoved(Output, frozen=True, tag="room_removed"):
    room: int
    generation: int


PrefillEndpointInput = OpenRoom | RoomCall | ClearRoom | Received | TransferCompleted | TimerFired


class PrefillEndpointConfig(msgspec.Struct, frozen=True, tag="prefill", tag_field="role"):
    me: PeerId
    policy: AllocationPolicy = AllocationPolicy.EARLY
    timeouts: Timeouts = Timeouts()
    max_pending_room_ids: int = 65_536
    """Room ids that may hold parked metadata or a cancel for a generation not opened yet; past
    it, metadata for a new room id is dropped and its ABORT is not ACKed (no ACK, no promise)."""
    max_finished_room_ids: int = 65_536
    """Room ids whose highest opened generation the rank remembers once it holds nothing else
    of them; past it the least recently opened is forgotten, and a late message for it reads as
    one for a generation not opened yet (parked metadata expires; an ABORT is ACKed and its
    cancel kept under max_pending_room_ids). Bounds the rank's memory under SGLang's random
    room ids, one per request."""
    max_ownerless_ready_rooms: int = 65_536
    """prefill_complete only: (room, generation) entries of the ready table no sender owns (a
    decode waiting before the engine opened the room, a failed room's tombstone), each held up to
    waiting_timeout + bootstrap_timeout. Past it the oldest tombstone is evicted (a later
    bootstrap for that failed room waits out its own timeout). Only when every entry is a
    waiting decode is a BootstrapRequest, or a cancel before the sender, that would add one
    dropped (``ready_table_full``): that decode waits until its waiting_timeout; and an owner
    closing its room unfinished keeps no tombstone (its waiting decode is told Failed then, a
    later bootstrap for it waits out its own timeout)."""
    max_parked_peers: int = 64
    """Decode peers whose metadata one parked generation keeps (more than any topology needs);
    past it, metadata from a new decode peer for that generation is dropped."""
    session_id: str = ""
    """This rank's transport session, named to each decode rank that announces its layout."""
    max_decode_layouts: int = 1024
    """Decode ranks whose KV layout this rank keeps; past it the least recently heard from is
    evicted."""
    max_layout_bytes: int = 64 << 10
    """The largest KV layout this rank keeps (its KvArgs, MessagePack-encoded); a larger one is
    dropped (``layout_too_large``), so the kept layouts take at most max_decode_layouts x this."""


class DecodeEndpointConfig(msgspec.Struct, frozen=True, tag="decode", tag_field="role"):
    me: PeerId
    tp_size: int = 1
    tp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    num_kv_heads: int = 8
    num_pages: int = 1024
    page_size: int = 16
    kv_cache_dtype: str = "auto"
    is_mla: bool = False
    session_id: str = ""
    policy: AllocationPolicy = AllocationPolicy.EARLY
    timeouts: Timeouts = Timeouts()
    heartbeat_max_failure: int = 2
    lost_instance_forget_s: float = 600.0
    """A prefill instance declared dead that no room refers to is given up this long after the
    verdict: no longer probed, never readmitted (as if superseded). Without it a prefill that
    died and was never replaced stayed lost, and probed, for ever."""
    verify_checksums: bool = False
    staging_capacity: int = 0
    """Bytes of the staging ring: heterogeneous TP (prefill TP > decode TP) needs it, small rooms
    use it when ``stage_rooms_up_to`` allows; 0 turns it off."""
    stage_rooms_up_to: int = 0
    """Small-room staging: a room of one writer whose pages take at most this many bytes is
    written as ONE bulk write into the staging ring (gathered by the prefill, scattered here)
    instead of one write per buffer and page run, when a ring region is free at once; it never
    waits for one (it is then written directly). 0 turns it off."""
    staging_page_bytes: int = 0
    """Bytes one destination page takes in the staging region (all layers, K and V)."""
    kv_layout: KvBuffers | None = None
    """Where this rank's KV lives, announced (KvArgs) to each prefill rank before any other
    message to it; None announces nothing (a core driven without a data plane)."""
    staging_addr: int | None = None
    """Base address of the staging ring, announced with the layout."""
    state: tuple[StateBuffers, ...] = ()
    """This rank's model-state components, announced with the layout (KvArgs)."""
    aux_row_bytes: int = 0
    """Bytes of one row of the engine's aux buffer; a Success carrying a row of another size
    fails the room (0: not checked)."""
    started_at: float | None = None
    """When this decode process started (wall clock, from the shell), announced with the layout
    (KvArgs.started_at) so prefill ranks keep this life's layout over an earlier life's."""


DecodeEndpointInput = (
    OpenReceiver
    | TopologyKnown
    | TopologyFailed
    | PublishPages
    | RoomCall
    | ClearRoom
    | Received
    | HeartbeatResult
    | SessionClosed
    | SessionRotated
    | SessionRetired
    | ChecksumChecked
    | TimerFired
)
AnyEndpointInput = PrefillEndpointInput | DecodeEndpointInput
