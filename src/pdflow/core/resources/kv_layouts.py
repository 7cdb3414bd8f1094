"""The KV layout exchange: each decode rank tells each prefill rank where its KV lives.

A decode rank announces its layout (:class:`KvArgs`) to a prefill rank before its first other
message to it, on the same channel; the prefill rank keeps it and answers with its transport
session (:class:`KvArgsAccepted`), which the decode needs to fence that writer if it dies. Both
sides are table machines, one per peer:

- :class:`LayoutAnnouncement` (decode side, one per prefill rank life): UNANNOUNCED ->
  ANNOUNCED on first contact (emits the KvArgs; repeated before each message until answered,
  since a lost announcement would silence the rank) -> ACCEPTED when the answer arrives. An
  answer from a prefill rank never announced to is refused. Forgotten when the prefill
  instance is lost (its PeerIds never come back: a restart draws a new incarnation). When the
  decode rotates its transport session (fence by engine rotation), every announcement goes
  STALE (LayoutChanged) and is said again, with the new session, before the next message.
- :class:`DecodeLayout` (prefill side, one per decode rank): ABSENT -> KNOWN on an
  announcement (emits the answer); a later life of the same decode rank replaces it, and an
  earlier life's (lives ordered by ``KvArgs.started_at``) is dropped as ``stale_incarnation``:
  a late or replayed KvArgs of a dead life must not replace the live life's layout, whose
  messages would then be refused while it never announces again. A layout encoding to more
  than ``max_layout_bytes`` is dropped (``layout_too_large``), and at most ``limit`` are kept:
  past it, the least recently heard from is evicted (back to ABSENT). So the layouts take at
  most ``limit x max_layout_bytes`` (encoded).

Specified as ``[machines.LayoutAnnouncement]`` and ``[machines.DecodeLayout]`` in
spec/machines/kv_layouts.toml.
"""

from __future__ import annotations

import enum
from collections import OrderedDict

import msgspec

from pdflow.core.endpoints.endpoint_io import Dropped
from pdflow.core.framework.table import Fired, Table, TableMachine, row
from pdflow.core.protocol.inputs import Input
from pdflow.core.protocol.messages import KvArgs, KvArgsAccepted, PeerId, peer_order
from pdflow.core.protocol.outputs import Output, SendMessage


# ---- decode side -------------------------------------------------------------------------------
class AnnouncementState(enum.Enum):
    UNANNOUNCED = "UNANNOUNCED"
    ANNOUNCED = "ANNOUNCED"
    ACCEPTED = "ACCEPTED"
    STALE = "STALE"


class Contact(Input, frozen=True, tag="Contact"):
    """The decode endpoint is about to send its first message to this prefill rank."""

    announcement: KvArgs


class AcceptArrived(Input, frozen=True, tag="AcceptArrived"):
    accepted: KvArgsAccepted


class LayoutChanged(Input, frozen=True, tag="LayoutChanged"):
    """The decode rank's announcement changed (a new transport session): say it again."""


class PeerLost(Input, frozen=True, tag="PeerLost"):
    """The prefill instance of this rank was declared lost."""


_A = AnnouncementState


class LayoutAnnouncement(TableMachine[AnnouncementState]):
    table: Table[AnnouncementState]

    def __init__(self, prefill: PeerId) -> None:
        self.prefill = prefill
        self.key = prefill.rank
        self.state = ANNOUNCEMENT_TABLE.initial
        self.session_id: str | None = None

    def _act_announce(self, inp: Contact, now: float) -> list[Output]:
        return [SendMessage(self.prefill, inp.announcement)]

    def _act_record_session(self, inp: AcceptArrived, now: float) -> list[Output]:
        self.session_id = inp.accepted.session_id
        return []


_LA = LayoutAnnouncement
ANNOUNCEMENT_TABLE: Table[AnnouncementState] = Table(
    machine="LayoutAnnouncement",
    states=AnnouncementState,
    initial=AnnouncementState.UNANNOUNCED,
    inputs=(Contact, AcceptArrived, PeerLost, LayoutChanged),
    remote_inputs=(AcceptArrived,),
    rows=[
        row(
            _A.UNANNOUNCED, Contact, _A.ANNOUNCED, emits=["send.kv_args"], action=_LA._act_announce
        ),
        # No answer yet: the announcement may have been lost with its socket; say it again.
        row(_A.ANNOUNCED, Contact, _A.ANNOUNCED, emits=["send.kv_args"], action=_LA._act_announce),
        row(_A.ANNOUNCED, AcceptArrived, _A.ACCEPTED, action=_LA._act_record_session),
        row(_A.ANNOUNCED, PeerLost, _A.UNANNOUNCED),
        row(_A.ACCEPTED, AcceptArrived, _A.ACCEPTED, action=_LA._act_record_session),
        row(_A.ACCEPTED, PeerLost, _A.UNANNOUNCED),
        row(_A.ANNOUNCED, LayoutChanged, _A.STALE),
        row(_A.ACCEPTED, LayoutChanged, _A.STALE),
        # The prefill rank holds an older announcement: the next message is preceded by the new.
        row(_A.STALE, Contact, _A.ANNOUNCED, emits=["send.kv_args"], action=_LA._act_announce),
        row(_A.STALE, AcceptArrived, _A.STALE, action=_LA._act_record_session),
        row(_A.STALE, PeerLost, _A.UNANNOUNCED),
        row(_A.STALE, LayoutChanged, _A.STALE),
    ],
    keyed_by_room=False,
)
LayoutAnnouncement.table = ANNOUNCEMENT_TABLE


class LayoutAnnouncements:
    """One decode rank's announcements, by prefill rank life (bounded by the prefill ranks of
    the instances it knows: a lost instance's are forgotten)."""

    def __init__(self) -> None:
        self._peers: dict[PeerId, LayoutAnnouncement] = {}

    def is_announced(self, prefill: PeerId) -> bool:
        return prefill in self._peers

    def is_accepted(self, prefill: PeerId) -> bool:
        machine = self._peers.get(prefill)
        return machine is not None and machine.state is AnnouncementState.ACCEPTED

    def session_of(self, prefill: PeerId) -> str | None:
        """The writer's transport session, once its KvArgsAccepted arrived."""
        machine = self._peers.get(prefill)
        return None if machine is None else machine.session_id

    def fire(self, prefill: PeerId, inp: Input, now: float) -> tuple[list[Output], Fired]:
        """Fire ``inp`` at the prefill rank's machine (a fresh one if it has none), keeping it
        only while it is announced. A refused input raises and changes nothing."""
        machine = self._peers.get(prefill) or LayoutAnnouncement(prefill)
        outputs, fired = machine.fire(inp, now)
        if machine.state is AnnouncementState.UNANNOUNCED:
            self._peers.pop(prefill, None)
        else:
            self._peers[prefill] = machine
        return outputs, fired

    def layout_changed(self, now: float) -> list[Fired]:
        """Every announced prefill rank holds an outdated layout: each goes STALE."""
        peers = sorted(self._peers, key=peer_order)
        return [self.fire(peer, LayoutChanged(), now)[1] for peer in peers]

    def __len__(self) -> int:
        return len(self._peers)


# ---- prefill side ------------------------------------------------------------------------------
class DecodeLayoutState(enum.Enum):
    ABSENT = "ABSENT"
    KNOWN = "KNOWN"


class LayoutAnnounced(Input, frozen=True, tag="LayoutAnnounced"):
    announcement: KvArgs


class LayoutEvicted(Input, frozen=True, tag="LayoutEvicted"):
    """More decode ranks announced than the prefill rank keeps: this one was heard from least
    recently."""


_D = DecodeLayoutState


class DecodeLayout(TableMachine[DecodeLayoutState]):
    table: Table[DecodeLayoutState]

    def __init__(self, me: PeerId, session_id: str, decode_rank: int, max_bytes: int) -> None:
        self.me = me
        self.session_id = session_id
        self.key = decode_rank
        self.max_bytes = max_bytes
        self.state = DECODE_LAYOUT_TABLE.initial
        self.announcement: KvArgs | None = None

    def _guard_too_large(self, inp: LayoutAnnounced, now: float) -> bool:
        return layout_bytes(inp.announcement) > self.max_bytes

    def _guard_older_life(self, inp: LayoutAnnounced, now: float) -> bool:
        kept = self.announcement
        return kept is not None and is_earlier_life(inp.announcement, kept)

    def _act_register(self, inp: LayoutAnnounced, now: float) -> list[Output]:
        # A later life of the same decode rank replaces the earlier one's layout.
        announcement = inp.announcement
        self.announcement = announcement
        accepted = KvArgsAccepted(self.me, announcement.decode, self.session_id)
        return [SendMessage(announcement.decode, accepted)]

    def _act_drop_too_large(self, inp: LayoutAnnounced, now: float) -> list[Output]:
        decode = inp.announcement.decode
        return [Dropped("layout_too_large",
                        f"KvArgs of {decode.address} rank {decode.rank} encodes to "
                        f"{layout_bytes(inp.announcement)} bytes, over max_layout_bytes "
                        f"{self.max_bytes}; raise it (control_max_layout_bytes) on every "
                        "node")]  # fmt: skip

    def _act_drop_earlier_life(self, inp: LayoutAnnounced, now: float) -> list[Output]:
        late, kept = inp.announcement, self.announcement
        kept_life = "?" if kept is None else f"{kept.decode.incarnation} ({kept.started_at!r})"
        return [Dropped("stale_incarnation",
                        f"KvArgs of {late.decode.address} rank {late.decode.rank} life "
                        f"{late.decode.incarnation} ({late.started_at!r}), which started no "
                        f"later than the kept life {kept_life}")]  # fmt: skip


_ENCODER = msgspec.msgpack.Encoder()


def layout_bytes(announcement: KvArgs) -> int:
    """What a KV layout weighs: its KvArgs' MessagePack encoding (as on the wire, less the
    frame header), the measure ``max_layout_bytes`` bounds."""
    return len(_ENCODER.encode(announcement))


def is_earlier_life(new: KvArgs, kept: KvArgs) -> bool:
    """Whether ``new`` comes from another life of the decode rank than ``kept`` that started no
    later. A life that gives no start time is earlier than one that does; two that give none
    are unordered, and the newcomer replaces (as before lives were ordered)."""
    if new.decode.incarnation == kept.decode.incarnation:
        return False
    if new.started_at is None:
        return kept.started_at is not None
    return kept.started_at is not None and new.started_at <= kept.started_at


_DL = DecodeLayout
DECODE_LAYOUT_TABLE: Table[DecodeLayoutState] = Table(
    machine="DecodeLayout",
    states=DecodeLayoutState,
    initial=DecodeLayoutState.ABSENT,
    inputs=(LayoutAnnounced, LayoutEvicted),
    remote_inputs=(LayoutAnnounced,),
    rows=[
        row(_D.ABSENT, LayoutAnnounced, _D.ABSENT, guard=_DL._guard_too_large, emits=["dropped"],
            action=_DL._act_drop_too_large),
        row(_D.ABSENT, LayoutAnnounced, _D.KNOWN, emits=["send.kv_args_accepted"],
            action=_DL._act_register),
        row(_D.KNOWN, LayoutAnnounced, _D.KNOWN, guard=_DL._guard_too_large, emits=["dropped"],
            action=_DL._act_drop_too_large),
        row(_D.KNOWN, LayoutAnnounced, _D.KNOWN, guard=_DL._guard_older_life, emits=["dropped"],
            action=_DL._act_drop_earlier_life),
        row(_D.KNOWN, LayoutAnnounced, _D.KNOWN, emits=["send.kv_args_accepted"],
            action=_DL._act_register),
        row(_D.KNOWN, LayoutEvicted, _D.ABSENT),
    ],
    keyed_by_room=False,
)  # fmt: skip
DecodeLayout.table = DECODE_LAYOUT_TABLE


def _decode_rank(peer: PeerId) -> tuple[str, int]:
    return (peer.address, peer.rank)


class DecodeLayouts:
    """The layouts decode ranks announced to one prefill rank: one per decode rank, each of at
    most ``max_layout_bytes``, at most ``limit``, the least recently heard from evicted first."""

    def __init__(self, me: PeerId, session_id: str, limit: int, max_layout_bytes: int) -> None:
        self.me = me
        self.session_id = session_id
        self.limit = limit
        self.max_layout_bytes = max_layout_bytes
        self._ranks: OrderedDict[tuple[str, int], DecodeLayout] = OrderedDict()

    def announce(self, announcement: KvArgs, now: float) -> tuple[list[Output], list[Fired]]:
        """Keep the announcement (evicting past the limit), or drop it: then the outputs hold
        the Dropped and nothing else changed, not even which rank was heard from last."""
        key = _decode_rank(announcement.decode)
        machine = self._ranks.get(key) or DecodeLayout(
            self.me, self.session_id, announcement.decode.rank, self.max_layout_bytes
        )
        outputs, fired = machine.fire(LayoutAnnounced(announcement), now)
        transitions = [fired]
        if any(isinstance(output, Dropped) for output in outputs):
            return outputs, transitions
        self._ranks[key] = machine
        self._ranks.move_to_end(key)
        while len(self._ranks) > self.limit:
            _, oldest = self._ranks.popitem(last=False)
            transitions.append(oldest.fire(LayoutEvicted(), now)[1])
        return outputs, transitions

    def heard_from(self, decode: PeerId) -> None:
        """A message from this decode rank arrived: it is the most recently heard from."""
        key = _decode_rank(decode)
        if key in self._ranks:
            self._ranks.move_to_end(key)

    def layout_of(self, decode: PeerId) -> KvArgs | None:
        """The layout this exact decode life announced (another incarnation: None)."""
        machine = self._ranks.get(_decode_rank(decode))
        announcement = None if machine is None else machine.announcement
        return announcement if announcement is not None and announcement.decode == decode else None

    def __len__(self) -> int:
        return len(self._ranks)
