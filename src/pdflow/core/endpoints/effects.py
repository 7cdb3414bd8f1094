"""The shell contract: every output an endpoint role can produce, the effects interface a shell
implements, and the one dispatcher that turns each output into an effect.

Both shells carry out endpoint outputs through :func:`carry_out_prefill` and
:func:`carry_out_decode`: the real nodes (``pdflow.io``) and the simulator (``pdflow.sim``), so
the model checker runs the dispatch that production runs. A shell picks the effects' return
type: the nodes return None for an effect done at once, else an awaitable (awaited before the
step's next output, under the endpoint's lock: a send waiting for room, a fence lifted), the
simulator returns None. Each ``match`` ends in ``assert_never``: an output added to a role's
union without a case here fails ``mypy --strict``.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, assert_never

from pdflow.core.endpoints.endpoint_io import (
    CloseSession,
    Dropped,
    IncarnationSuperseded,
    NeedTopology,
    ReadmitWriter,
    RoomRemoved,
    StagingPlaced,
)
from pdflow.core.protocol.messages import AnyMessage, PeerId
from pdflow.core.protocol.outputs import (
    ArmFence,
    Output,
    SendMessage,
    StartTransfer,
    StatusChanged,
    StoreAux,
    VerifyChecksums,
)
from pdflow.core.resources.page_ledger import PagesFreed, PagesQuarantined
from pdflow.core.resources.staging_ring import (
    StagingAssigned,
    StagingDeferred,
    StagingOversized,
    StagingReady,
    WatermarkAdvanced,
)
from pdflow.core.rooms.prefill_complete import OwnerRefused

R = TypeVar("R", covariant=True)

CommonOutput = SendMessage | StatusChanged | RoomRemoved | Dropped
"""What both roles output."""

PrefillOutput = CommonOutput | StartTransfer | OwnerRefused
"""Everything a PrefillEndpoint step can output."""

DecodeOutput = (
    CommonOutput
    | NeedTopology
    | CloseSession
    | ReadmitWriter
    | IncarnationSuperseded
    | VerifyChecksums
    | StoreAux
    | StagingPlaced
    | PagesFreed
    | PagesQuarantined
    | ArmFence
    | StagingAssigned
    | StagingOversized
    | StagingReady
    | StagingDeferred
    | WatermarkAdvanced
)
"""Everything a DecodeEndpoint step can output (its rooms', ledger's and staging ring's)."""


class EndpointEffects(Protocol[R]):
    """What a shell does for either role."""

    def send(self, to: PeerId, message: AnyMessage, msg_id: str | None) -> R:
        """Put the message on the wire to ``to`` (``msg_id`` only orders traces)."""
        ...

    def report_status(self, change: StatusChanged) -> R:
        """Tell the engine the room's KVPoll changed."""
        ...

    def forget_room(self, removed: RoomRemoved) -> R:
        """The endpoint forgot the room: drop what the shell kept for it."""
        ...

    def count_drop(self, dropped: Dropped) -> R:
        """The endpoint refused a message or input and changed nothing: count it."""
        ...

    def record_only(self, output: Output) -> R:
        """An output that records what the endpoint already did in the same step (the trace
        keeps it); the shell has nothing to do."""
        ...


class PrefillEffects(EndpointEffects[R], Protocol[R]):
    def start_transfer(self, start: StartTransfer) -> R:
        """Write the pages; answer with a TransferCompleted for the same room, generation and
        seq once the transport is done with them."""
        ...


class DecodeEffects(EndpointEffects[R], Protocol[R]):
    def fetch_topology(self, bootstrap: str) -> R:
        """Ask the registry behind ``bootstrap``; answer TopologyKnown or TopologyFailed."""
        ...

    def close_session(self, request: CloseSession) -> R:
        """Fence this dead writer (close its transport session), then answer SessionClosed.

        A shell that cannot fence it never answers: its pages wait for its drain ACK."""
        ...

    def readmit_writer(self, readmit: ReadmitWriter) -> R:
        """Lift the fence for the writes this writer starts from now on (it was wrongly
        declared dead and drained what it owed); writes it started before stay refused. Done
        before the step's later outputs, which may let it write."""
        ...

    def note_superseded(self, superseded: IncarnationSuperseded) -> R:
        """Count and log that another incarnation replaced this one (never readmitted)."""
        ...

    def verify_checksums(self, request: VerifyChecksums) -> R:
        """Recompute what each writer wrote into the room's pages; answer ChecksumChecked."""
        ...

    def store_aux(self, aux: StoreAux) -> R:
        """Write the room's aux row into the engine's aux slot; done before the Success status
        of the same step is reported, so the engine reads it once it sees Success."""
        ...

    def note_staging(self, placed: StagingPlaced) -> R:
        """Remember the room's staging region (scattered into its pages before verifying)."""
        ...

    def release_pages(self, freed: PagesFreed) -> R:
        """Hand the pages back to the engine: nobody can write them any more."""
        ...

    def hold_pages(self, held: PagesQuarantined) -> R:
        """Tell the engine these pages stay quarantined until the writers listed are cleared."""
        ...


def carry_out_prefill(effects: PrefillEffects[R], output: Output, msg_id: str | None) -> R:
    """The one dispatcher of prefill outputs."""
    if not isinstance(output, PrefillOutput):
        raise TypeError(f"{type(output).__name__} is not a prefill endpoint output")
    match output:
        case SendMessage() | StatusChanged() | RoomRemoved() | Dropped():
            return _carry_out_common(effects, output, msg_id)
        case StartTransfer():
            return effects.start_transfer(output)
        case OwnerRefused():
            # The endpoint failed the refused sender in the same step.
            return effects.record_only(output)
        case _:
            assert_never(output)


def carry_out_decode(effects: DecodeEffects[R], output: Output, msg_id: str | None) -> R:
    """The one dispatcher of decode outputs."""
    if not isinstance(output, DecodeOutput):
        raise TypeError(f"{type(output).__name__} is not a decode endpoint output")
    match output:
        case SendMessage() | StatusChanged() | RoomRemoved() | Dropped():
            return _carry_out_common(effects, output, msg_id)
        case NeedTopology():
            return effects.fetch_topology(output.bootstrap)
        case CloseSession():
            return effects.close_session(output)
        case ReadmitWriter():
            return effects.readmit_writer(output)
        case IncarnationSuperseded():
            return effects.note_superseded(output)
        case VerifyChecksums():
            return effects.verify_checksums(output)
        case StoreAux():
            return effects.store_aux(output)
        case StagingPlaced():
            return effects.note_staging(output)
        case PagesFreed():
            return effects.release_pages(output)
        case PagesQuarantined():
            return effects.hold_pages(output)
        case (
            ArmFence()
            | StagingAssigned()
            | StagingOversized()
            | StagingReady()
            | StagingDeferred()
            | WatermarkAdvanced()
        ):
            # The ledger took the fence, and the endpoint acted on its staging ring, in the
            # same step.
            return effects.record_only(output)
        case _:
            assert_never(output)


def _carry_out_common(effects: EndpointEffects[R], output: CommonOutput, msg_id: str | None) -> R:
    match output:
        case SendMessage():
            return effects.send(output.to, output.message, msg_id)
        case StatusChanged():
            return effects.report_status(output)
        case RoomRemoved():
            return effects.forget_room(output)
        case Dropped():
            return effects.count_drop(output)
        case _:
            assert_never(output)
