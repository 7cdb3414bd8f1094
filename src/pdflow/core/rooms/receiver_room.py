"""ReceiverRoom: one room on one decode rank, from topology resolution to a terminal poll.

Two timer budgets, never shared: the *waiting* budget covers waiting on the prefill (topology,
the ready signal under ``prefill_complete``, and staging-ring space for pages the engine
published that the endpoint must hold back: ``StagingWait``); the *transfer* budget starts when
the destination pages go out to the prefill. A failure after publishing arms the page fence
*before* the ABORT goes out, so no page is reused while a writer may still land.
See spec/protocol.toml ``[machines.ReceiverRoom]``.
"""

from __future__ import annotations

import enum
from typing import Any

from pdflow.core.framework.dispatch import remembered_kind
from pdflow.core.framework.errors import InvalidInput, RemoteProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.table import STATUS_CHANGED, Table, TableMachine, row
from pdflow.core.protocol.inputs import (
    AbortRequested,
    ChecksumResult,
    FailureArrived,
    Input,
    PeerDied,
    PeersResolved,
    PrefillTarget,
    PublishPages,
    ReadyArrived,
    ResolveFailed,
    StagingWait,
    SuccessArrived,
    Tick,
)
from pdflow.core.protocol.messages import Abort, BootstrapRequest, PeerId, RoomMetadata
from pdflow.core.protocol.outputs import (
    ArmFence,
    Output,
    SendMessage,
    StoreAux,
    VerifyChecksums,
)
from pdflow.core.protocol.policy import AllocationPolicy, Timeouts


class ReceiverState(enum.Enum):
    BOOTSTRAPPING = "BOOTSTRAPPING"
    AWAITING_READY = "AWAITING_READY"
    AWAITING_PAGES = "AWAITING_PAGES"
    TRANSFERRING = "TRANSFERRING"
    VERIFYING = "VERIFYING"
    SUCCESS = "SUCCESS"
    FAILED = "FAILED"


RECEIVER_POLL = {
    ReceiverState.BOOTSTRAPPING: KVPoll.Bootstrapping,
    ReceiverState.AWAITING_READY: KVPoll.Bootstrapping,
    ReceiverState.AWAITING_PAGES: KVPoll.WaitingForInput,
    ReceiverState.TRANSFERRING: KVPoll.Transferring,
    ReceiverState.VERIFYING: KVPoll.Transferring,
    ReceiverState.SUCCESS: KVPoll.Success,
    ReceiverState.FAILED: KVPoll.Failed,
}
_POLL_BY_NAME = {state.name: poll for state, poll in RECEIVER_POLL.items()}
# Members read on every step, bound once (a member read off its class is slow: kvpoll.py).
_WAITING_STATES = (
    ReceiverState.BOOTSTRAPPING,
    ReceiverState.AWAITING_READY,
    ReceiverState.AWAITING_PAGES,
)
_AWAITING_PAGES = ReceiverState.AWAITING_PAGES
_TRANSFERRING = ReceiverState.TRANSFERRING
_PREFILL_COMPLETE = AllocationPolicy.PREFILL_COMPLETE
_VALIDATED: frozenset[type] = frozenset(
    {PeersResolved, PublishPages, ReadyArrived, SuccessArrived, FailureArrived}
)
_VALIDATED_KIND: dict[type, type] = {}
"""Each input class seen by ``_validate``, mapped to the listed type it is an instance of."""

_R = ReceiverState
_CHANGED = STATUS_CHANGED
_ABORT = "send.abort"
_FENCE = "arm_fence"
_FAIL_FENCED = [_FENCE, _ABORT, _CHANGED]
_AUX = "store_aux"


class ReceiverRoom(TableMachine[ReceiverState]):
    """One room on one decode rank. Drive it with :meth:`handle`."""

    table: Table[ReceiverState]

    def __init__(
        self,
        room: int,
        generation: int,
        me: PeerId,
        now: float,
        *,
        policy: AllocationPolicy = AllocationPolicy.EARLY,
        timeouts: Timeouts = Timeouts(),  # noqa: B008 - immutable
        verify_checksums: bool = False,
        require_checksums: bool = False,
        session_id: str = "",
        aux_row_bytes: int = 0,
    ) -> None:
        self.key = room
        self.generation = generation
        self.me = me
        self.policy = policy
        self.timeouts = timeouts
        # Verifying finishes the data (a staged room's scatter, then any checksums); requiring
        # them fails the room closed when a writer sent none (the decode's checksum setting).
        self.verify_checksums = verify_checksums or require_checksums
        self.require_checksums = require_checksums
        self.session_id = session_id
        """The decode rank's transport session, where the prefill writes."""
        self.staging_offset: int | None = None
        """The room's staging region, when the endpoint placed one before publishing."""
        self.state = RECEIVER_TABLE.initial
        self.targets: tuple[PrefillTarget, ...] = ()
        self.required_responses = 0
        self.required_dst_info_num = 1
        self.succeeded: dict[PeerId, int | None] = {}
        self.aux_row_bytes = aux_row_bytes
        """Size of the engine's aux rows (0: not checked)."""
        self.aux: bytes | None = None
        """The room's aux row: the first a writer's Success carried."""
        self.published: PublishPages | None = None
        self.reason = ""
        self.wait_deadline: float | None = now + timeouts.waiting_timeout
        self.waiting_for = "the prefill"
        self.transfer_deadline: float | None = None

    # ---- public API ----------------------------------------------------------------------------
    @property
    def poll(self) -> KVPoll:
        return _POLL_BY_NAME[self.state._name_]  # str keys: Enum hashing runs in Python

    @property
    def writers(self) -> tuple[PeerId, ...]:
        """Prefill ranks that may write into this room's pages (dummies never write)."""
        return tuple(t.peer for t in self.targets if not t.is_dummy)

    def timer_at(self) -> float | None:
        if self.state in _WAITING_STATES:
            return self.wait_deadline
        if self.state is _TRANSFERRING:
            return self.transfer_deadline
        return None

    # ---- validation ----------------------------------------------------------------------------
    def _validate(self, inp: Input, now: float) -> None:
        # Compared by type with ``is`` (framework/dispatch.py): most inputs match none.
        kind = _VALIDATED_KIND.get(type(inp))
        if kind is None:
            kind = remembered_kind(inp, _VALIDATED, _VALIDATED_KIND)
        given: Any = inp  # typed again in each branch: ``kind is X`` does not narrow ``inp``
        if kind is PeersResolved:
            resolved: PeersResolved = given
            if not resolved.targets:
                raise InvalidInput(f"room {self.key}: PeersResolved needs at least one target")
            writers = 0
            for target in resolved.targets:  # a loop: a generator cost more than the check
                writers += not target.is_dummy
            if not 1 <= resolved.required_responses <= max(writers, 1):
                raise InvalidInput(
                    f"room {self.key}: required_responses={resolved.required_responses} but "
                    f"{writers} non-dummy targets"
                )
        elif kind is PublishPages:
            published: PublishPages = given
            if published.room != self.key:
                raise InvalidInput(f"room {self.key}: pages published for room {published.room}")
            if self.state is _AWAITING_PAGES and (
                len(set(published.dst_pages)) != len(published.dst_pages)
            ):
                raise InvalidInput(f"room {self.key}: destination pages must be distinct")
        elif kind is ReadyArrived or kind is SuccessArrived or kind is FailureArrived:
            status: ReadyArrived | SuccessArrived | FailureArrived = given
            if self.targets and not self._is_target(status.prefill):
                raise RemoteProtocolError(
                    f"room {self.key}: status from {status.prefill.address}"
                    f"/{status.prefill.incarnation}, which is not a prefill rank of this room",
                    hint="a stale incarnation or a misrouted message; drop it",
                )

    # ---- guards --------------------------------------------------------------------------------
    def _guard_prefill_complete_policy(self, inp: Input, now: float) -> bool:
        return self.policy is _PREFILL_COMPLETE

    def _guard_wait_expired(self, inp: Input, now: float) -> bool:
        return self.wait_deadline is not None and now >= self.wait_deadline

    def _guard_transfer_expired(self, inp: Input, now: float) -> bool:
        return self.transfer_deadline is not None and now >= self.transfer_deadline

    def _is_target(self, peer: PeerId) -> bool:
        """``peer in {t.peer for t in self.targets}``, without building the set per status."""
        # A loop, not any(<generator>): ~0.25 vs ~1.5 us for one target.
        for target in self.targets:  # noqa: SIM110
            if target.peer == peer:
                return True
        return False

    def _is_writer(self, peer: PeerId) -> bool:
        """``peer in self.writers``, without building the tuple (asked several times a step)."""
        for target in self.targets:  # noqa: SIM110 (a loop, as in _is_target)
            if not target.is_dummy and target.peer == peer:
                return True
        return False

    def _completes(self, success: SuccessArrived) -> bool:
        if self._is_writer(success.prefill):
            distinct = len(self.succeeded) + (0 if success.prefill in self.succeeded else 1)
        else:
            distinct = len(self.succeeded)
        return distinct >= self.required_responses

    def _guard_completes_without_checksum(self, inp: SuccessArrived, now: float) -> bool:
        return self.require_checksums and self._completes(inp) and bool(self._unchecksummed(inp))

    def _guard_completes_without_aux(self, inp: SuccessArrived, now: float) -> bool:
        return self._completes(inp) and bool(self._aux_problem(inp))

    def _guard_completes_with_checksums(self, inp: SuccessArrived, now: float) -> bool:
        staged = self.staging_offset is not None
        return (self.verify_checksums or staged) and self._completes(inp)

    def _guard_completes(self, inp: SuccessArrived, now: float) -> bool:
        return self._completes(inp)

    def _guard_checksum_ok(self, inp: ChecksumResult, now: float) -> bool:
        return inp.ok

    # ---- actions -------------------------------------------------------------------------------
    def _act_resolve(self, inp: PeersResolved, now: float) -> list[Output]:
        resolved = inp
        self.targets = resolved.targets
        self.required_responses = resolved.required_responses
        self.required_dst_info_num = resolved.required_dst_info_num
        if self.policy is _PREFILL_COMPLETE:
            self.wait_deadline = now + self.timeouts.waiting_timeout
            return [
                SendMessage(
                    to=t.peer,
                    message=BootstrapRequest(
                        room=self.key, generation=self.generation, decode=self.me, prefill=t.peer
                    ),
                )
                for t in self.targets
            ]
        # Under the early policy the engine's wait for memory is admission's business: the
        # prefill has computed nothing yet, and its own bootstrap clock bounds the wait.
        self.wait_deadline = None
        return []

    def _act_restart_wait_clock(self, inp: Input, now: float) -> list[Output]:
        # The prefill holds finished KV for us now: a fresh budget to reserve pages.
        self.wait_deadline = now + self.timeouts.waiting_timeout
        return []

    def _act_start_staging_wait(self, inp: Input, now: float) -> list[Output]:
        # Space in the ring frees only when earlier rooms end, which may be never (a dead
        # writer's region is quarantined): the waiting budget bounds it, as every wait.
        if self.wait_deadline is None:
            self.wait_deadline = now + self.timeouts.waiting_timeout
        self.waiting_for = "staging-ring space (held by earlier rooms; see the quarantine report)"
        return []

    def _act_publish(self, inp: PublishPages, now: float) -> list[Output]:
        pages = inp
        self.published = pages
        self.transfer_deadline = now + self.timeouts.waiting_timeout
        outputs: list[Output] = []
        for target in self.targets:
            outputs.append(
                SendMessage(
                    to=target.peer,
                    message=RoomMetadata(
                        room=self.key,
                        generation=self.generation,
                        decode=self.me,
                        prefill=target.peer,
                        session_id=self.session_id,
                        dst_pages=() if target.is_dummy else pages.dst_pages,
                        aux_index=None if target.is_dummy else pages.aux_index,
                        required_dst_info_num=self.required_dst_info_num,
                        decode_prefix_len=pages.decode_prefix_len,
                        is_dummy=target.is_dummy,
                        staging_offset=None if target.is_dummy else self.staging_offset,
                        state_indices=() if target.is_dummy else pages.state_indices,
                    ),
                )
            )
        return outputs

    def _act_count_success(self, inp: SuccessArrived, now: float) -> list[Output]:
        success = inp
        if self._is_writer(success.prefill):
            self.succeeded.setdefault(success.prefill, success.checksum)
            if self.aux is None:
                self.aux = success.aux
        return []

    def _act_succeed(self, inp: SuccessArrived, now: float) -> list[Output]:
        self._act_count_success(inp, now)
        return self._act_store_aux(inp, now)

    def _act_store_aux(self, inp: Input, now: float) -> list[Output]:
        """The aux row goes into the engine's slot in the step that reports Success, before it."""
        published = self.published
        if published is None or published.aux_index is None or self.aux is None:
            return []
        return [StoreAux(self.key, self.generation, published.aux_index, self.aux)]

    def _act_fail_missing_aux(self, inp: SuccessArrived, now: float) -> list[Output]:
        problem = self._aux_problem(inp)
        self._act_count_success(inp, now)
        self.reason = f"aux row unusable: {problem}"
        return []

    def _act_verify(self, inp: SuccessArrived, now: float) -> list[Output]:
        self._act_count_success(inp, now)
        expected = tuple(
            (peer, checksum) for peer, checksum in self.succeeded.items() if checksum is not None
        )
        return [VerifyChecksums(self.key, self.generation, expected)]

    def _act_fail_unverified(self, inp: SuccessArrived, now: float) -> list[Output]:
        missing = self._unchecksummed(inp)
        self._act_count_success(inp, now)
        names = ", ".join(f"{p.address}#{p.rank}" for p in missing)
        self.reason = (
            f"KV checksum missing: this decode requires checksums but prefill {names} sent "
            "none; turn checksums on at the prefill (PDFLOW_CHECKSUM=1) or off at the decode"
        )
        return []

    def _act_fail(self, inp: Input, now: float) -> list[Output]:
        self.reason = _reason_of(inp)
        return []

    def _act_fail_and_abort(self, inp: Input, now: float) -> list[Output]:
        self.reason = _reason_of(inp)
        return self._aborts()

    def _act_fail_waiting_timeout(self, inp: Input, now: float) -> list[Output]:
        self.reason = (
            f"timed out after {self.timeouts.waiting_timeout:g}s waiting for {self.waiting_for} "
            f"in {self.state.name}"
        )
        return self._aborts() if self.state is not ReceiverState.BOOTSTRAPPING else []

    def _act_fail_fenced(self, inp: Input, now: float) -> list[Output]:
        self.reason = _reason_of(inp)
        return self._fence_then_abort()

    def _act_fail_transfer_timeout(self, inp: Input, now: float) -> list[Output]:
        self.reason = (
            f"timed out after {self.timeouts.waiting_timeout:g}s waiting for the transfer "
            f"({len(self.succeeded)} of {self.required_responses} prefill ranks done)"
        )
        return self._fence_then_abort()

    def _act_fail_checksum(self, inp: ChecksumResult, now: float) -> list[Output]:
        self.reason = f"KV checksum mismatch: {inp.reason}"
        return []

    # ---- helpers -------------------------------------------------------------------------------
    def _aux_problem(self, success: SuccessArrived) -> str:
        """Why the room's aux row (counting this report) cannot fill its slot; empty if it can."""
        published = self.published
        if published is None or published.aux_index is None:
            return ""
        aux = self.aux
        if aux is None and self._is_writer(success.prefill):
            aux = success.aux
        if aux is None:
            return (
                f"the decode published aux slot {published.aux_index} but no prefill rank sent "
                "an aux row (the prefill engine passes the room's aux_index to init_transfer "
                "and its shell reads that row after the last chunk)"
            )
        if self.aux_row_bytes and len(aux) != self.aux_row_bytes:
            return (
                f"the prefill sent a {len(aux)}-byte aux row but this decode's rows hold "
                f"{self.aux_row_bytes} bytes; both engines must use the same aux row format"
            )
        return ""

    def _unchecksummed(self, success: SuccessArrived) -> list[PeerId]:
        """Writers whose Success (counting this one) carried no checksum."""
        reported = dict(self.succeeded)
        if self._is_writer(success.prefill):
            reported.setdefault(success.prefill, success.checksum)
        return [peer for peer, checksum in reported.items() if checksum is None]

    def _fence_then_abort(self) -> list[Output]:
        # The fence is armed before any ABORT leaves, so an early ACK can never be missed.
        fence: list[Output] = [ArmFence(self.key, self.generation, self.writers)]
        return fence + self._aborts()

    def _aborts(self) -> list[Output]:
        return [
            SendMessage(
                to=t.peer,
                message=Abort(
                    room=self.key,
                    generation=self.generation,
                    decode=self.me,
                    prefill=t.peer,
                    reason=self.reason,
                ),
            )
            for t in self.targets
        ]


_M = ReceiverRoom
RECEIVER_TABLE: Table[ReceiverState] = Table(
    machine="ReceiverRoom",
    states=ReceiverState,
    initial=ReceiverState.BOOTSTRAPPING,
    inputs=(
        PeersResolved,
        ResolveFailed,
        ReadyArrived,
        PublishPages,
        SuccessArrived,
        FailureArrived,
        PeerDied,
        AbortRequested,
        ChecksumResult,
        StagingWait,
        Tick,
    ),
    remote_inputs=(ReadyArrived, SuccessArrived, FailureArrived),
    poll_of=RECEIVER_POLL.__getitem__,
    rows=[
        # -- BOOTSTRAPPING: resolving which prefill ranks hold this room --------------------------
        row(_R.BOOTSTRAPPING, PeersResolved, _R.AWAITING_READY,
            guard=_M._guard_prefill_complete_policy, emits=["send.bootstrap"],
            action=_M._act_resolve),
        row(_R.BOOTSTRAPPING, PeersResolved, _R.AWAITING_PAGES,
            emits=[_CHANGED], action=_M._act_resolve),
        row(_R.BOOTSTRAPPING, ResolveFailed, _R.FAILED, emits=[_CHANGED], action=_M._act_fail),
        row(_R.BOOTSTRAPPING, AbortRequested, _R.FAILED, emits=[_CHANGED], action=_M._act_fail),
        row(_R.BOOTSTRAPPING, Tick, _R.FAILED,
            guard=_M._guard_wait_expired, emits=[_CHANGED], action=_M._act_fail_waiting_timeout),
        # -- AWAITING_READY (prefill_complete): the prefill is computing -------------------------
        row(_R.AWAITING_READY, ReadyArrived, _R.AWAITING_PAGES,
            emits=[_CHANGED], action=_M._act_restart_wait_clock),
        row(_R.AWAITING_READY, FailureArrived, _R.FAILED, emits=[_CHANGED], action=_M._act_fail),
        row(_R.AWAITING_READY, PeerDied, _R.FAILED, emits=[_CHANGED], action=_M._act_fail),
        row(_R.AWAITING_READY, AbortRequested, _R.FAILED,
            emits=[_ABORT, _CHANGED], action=_M._act_fail_and_abort),
        row(_R.AWAITING_READY, Tick, _R.FAILED,
            guard=_M._guard_wait_expired, emits=[_ABORT, _CHANGED],
            action=_M._act_fail_waiting_timeout),
        # -- AWAITING_PAGES: the engine is reserving destination pages ---------------------------
        row(_R.AWAITING_PAGES, PublishPages, _R.TRANSFERRING,
            emits=["send.room_metadata", _CHANGED], action=_M._act_publish),
        row(_R.AWAITING_PAGES, ReadyArrived, _R.AWAITING_PAGES),
        row(_R.AWAITING_PAGES, StagingWait, _R.AWAITING_PAGES,
            action=_M._act_start_staging_wait),
        row(_R.AWAITING_PAGES, FailureArrived, _R.FAILED, emits=[_CHANGED], action=_M._act_fail),
        row(_R.AWAITING_PAGES, PeerDied, _R.FAILED, emits=[_CHANGED], action=_M._act_fail),
        row(_R.AWAITING_PAGES, AbortRequested, _R.FAILED,
            emits=[_ABORT, _CHANGED], action=_M._act_fail_and_abort),
        row(_R.AWAITING_PAGES, Tick, _R.FAILED,
            guard=_M._guard_wait_expired, emits=[_ABORT, _CHANGED],
            action=_M._act_fail_waiting_timeout),
        # -- TRANSFERRING: pages published, writers may be landing -------------------------------
        row(_R.TRANSFERRING, SuccessArrived, _R.FAILED,
            guard=_M._guard_completes_without_checksum, emits=[_CHANGED],
            action=_M._act_fail_unverified),
        row(_R.TRANSFERRING, SuccessArrived, _R.FAILED,
            guard=_M._guard_completes_without_aux, emits=[_CHANGED],
            action=_M._act_fail_missing_aux),
        row(_R.TRANSFERRING, SuccessArrived, _R.VERIFYING,
            guard=_M._guard_completes_with_checksums, emits=["verify_checksums"],
            action=_M._act_verify),
        row(_R.TRANSFERRING, SuccessArrived, _R.SUCCESS,
            guard=_M._guard_completes, emits=[_AUX, _CHANGED], action=_M._act_succeed),
        row(_R.TRANSFERRING, SuccessArrived, _R.TRANSFERRING, action=_M._act_count_success),
        row(_R.TRANSFERRING, ReadyArrived, _R.TRANSFERRING),
        row(_R.TRANSFERRING, FailureArrived, _R.FAILED, emits=_FAIL_FENCED,
            action=_M._act_fail_fenced),
        row(_R.TRANSFERRING, PeerDied, _R.FAILED, emits=_FAIL_FENCED, action=_M._act_fail_fenced),
        row(_R.TRANSFERRING, AbortRequested, _R.FAILED, emits=_FAIL_FENCED,
            action=_M._act_fail_fenced),
        row(_R.TRANSFERRING, Tick, _R.FAILED,
            guard=_M._guard_transfer_expired, emits=_FAIL_FENCED,
            action=_M._act_fail_transfer_timeout),
        # -- VERIFYING: every writer reported Success; checking what landed ----------------------
        row(_R.VERIFYING, ChecksumResult, _R.SUCCESS, guard=_M._guard_checksum_ok,
            emits=[_AUX, _CHANGED], action=_M._act_store_aux),
        row(_R.VERIFYING, ChecksumResult, _R.FAILED, emits=[_CHANGED],
            action=_M._act_fail_checksum),
        row(_R.VERIFYING, SuccessArrived, _R.VERIFYING),
        row(_R.VERIFYING, ReadyArrived, _R.VERIFYING),
        row(_R.VERIFYING, PeerDied, _R.VERIFYING),
        row(_R.VERIFYING, AbortRequested, _R.FAILED, emits=[_CHANGED], action=_M._act_fail),
        # -- SUCCESS and FAILED: terminal; late news changes nothing -----------------------------
        row(_R.SUCCESS, SuccessArrived, _R.SUCCESS),
        row(_R.SUCCESS, ReadyArrived, _R.SUCCESS),
        row(_R.SUCCESS, AbortRequested, _R.SUCCESS),
        row(_R.FAILED, ReadyArrived, _R.FAILED),
        row(_R.FAILED, SuccessArrived, _R.FAILED),
        row(_R.FAILED, FailureArrived, _R.FAILED),
        row(_R.FAILED, PublishPages, _R.FAILED),
        row(_R.FAILED, AbortRequested, _R.FAILED),
        row(_R.FAILED, ChecksumResult, _R.FAILED),
    ],
)  # fmt: skip
ReceiverRoom.table = RECEIVER_TABLE


def _reason_of(inp: Input) -> str:
    if isinstance(inp, (ResolveFailed, AbortRequested, FailureArrived, ChecksumResult)):
        return inp.reason or type(inp).__name__
    if isinstance(inp, PeerDied):
        peer = inp.peer
        return f"lost connection with prefill {peer.address} (incarnation {peer.incarnation})"
    return type(inp).__name__
