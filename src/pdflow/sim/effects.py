"""The simulator's side of the shell contract (:mod:`pdflow.core.endpoints.effects`).

The World carries out every endpoint output through the same dispatcher as the real nodes;
these effects say what each one means in the simulated deployment: a message enters the
network, a write enters the fake transport, an answer that needs outside work (a topology
fetch, a session close, a checksum) becomes a local event the driver runs later, in any order,
and the fake engines react to status changes, freed pages and removed rooms.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdflow.core.endpoints.endpoint_io import (
    CloseSession,
    Dropped,
    IncarnationSuperseded,
    ReadmitWriter,
    RoomRemoved,
    StagingPlaced,
)
from pdflow.core.protocol.messages import AnyMessage, PeerId
from pdflow.core.protocol.outputs import (
    Output,
    StartTransfer,
    StatusChanged,
    StoreAux,
    VerifyChecksums,
)
from pdflow.core.resources.page_ledger import PagesFreed, PagesQuarantined
from pdflow.sim.engine import DecodeProcess, PrefillProcess
from pdflow.sim.network import Envelope
from pdflow.sim.transport import LocalCheck

if TYPE_CHECKING:
    from pdflow.sim.world import World


class SimEffects:
    """What the world does alike for both roles."""

    def __init__(self, world: World, process: PrefillProcess | DecodeProcess) -> None:
        self.world = world
        self.process = process

    def send(self, to: PeerId, message: AnyMessage, msg_id: str | None) -> None:
        self.world.network.send(Envelope(self.process.me.address, to, message, msg_id))

    def report_status(self, change: StatusChanged) -> None:
        self.world.status_changed(self.process, change)

    def forget_room(self, removed: RoomRemoved) -> None:
        self.world.room_removed(self.process, removed)

    def count_drop(self, dropped: Dropped) -> None:
        """The trace records the drop; the fake engines have nothing to do."""

    def record_only(self, output: Output) -> None:
        """Recorded in the trace with the step."""


class PrefillSimEffects(SimEffects):
    process: PrefillProcess

    def __init__(self, world: World, process: PrefillProcess) -> None:
        super().__init__(world, process)

    def start_transfer(self, start: StartTransfer) -> None:
        self.world.start_write(self.process, start)


class DecodeSimEffects(SimEffects):
    process: DecodeProcess

    def __init__(self, world: World, process: DecodeProcess) -> None:
        super().__init__(world, process)

    def fetch_topology(self, bootstrap: str) -> None:
        self.world.queue_local(self.process, "topology", bootstrap)

    def close_session(self, request: CloseSession) -> None:
        # The shell fences later (a local event), and reports SessionClosed only then: until
        # it runs, the writer's writes can still land. Without a receiver-side fence it
        # reports nothing: the writer's pages wait for its drain ACK.
        if self.world.shape.receiver_fence:
            self.world.queue_local(self.process, "fence", request.peer)

    def readmit_writer(self, readmit: ReadmitWriter) -> None:
        # At once, before the step's later outputs (the node awaits it the same way).
        if self.world.shape.receiver_fence:
            self.world.transport.lift_fence(self.process.rank, readmit.peer)

    def note_superseded(self, superseded: IncarnationSuperseded) -> None:
        """The endpoint counted it; the fake engines have nothing to do."""

    def verify_checksums(self, request: VerifyChecksums) -> None:
        # The shell starts on the pages the room holds now; on a staged decode its scatter
        # writes them when the local event runs, whatever the core did meanwhile.
        job = self.process.jobs.get(request.room)
        pages = () if job is None else job.pages[: job.request.num_pages]
        self.world.queue_local(self.process, "checksum", LocalCheck(request, pages))

    def store_aux(self, aux: StoreAux) -> None:
        job = self.process.jobs.get(aux.room)
        if job is not None and job.request.generation == aux.generation:
            job.aux = aux.data

    def note_staging(self, placed: StagingPlaced) -> None:
        """The fake transport writes pages directly; the world configures no staging ring."""

    def release_pages(self, freed: PagesFreed) -> None:
        self.world.pages_freed(self.process, freed)

    def hold_pages(self, held: PagesQuarantined) -> None:
        """The fake engine only reuses pages it got back through release_pages."""
