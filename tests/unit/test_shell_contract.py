"""The shell contract: one dispatcher per role, proven complete by mypy, shared by both shells."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
from mypy import api as mypy_api

from pdflow.core.endpoints import effects as contract
from pdflow.core.endpoints.decode_endpoint import DecodeEndpoint
from pdflow.core.endpoints.effects import (
    DecodeOutput,
    PrefillOutput,
    carry_out_decode,
    carry_out_prefill,
)
from pdflow.core.endpoints.endpoint_io import (
    ChecksumChecked,
    ClearRoom,
    CloseSession,
    DecodeEndpointConfig,
    Dropped,
    IncarnationSuperseded,
    NeedTopology,
    OpenReceiver,
    ReadmitWriter,
    Received,
    RoomCall,
    RoomRemoved,
    StagingPlaced,
    TopologyKnown,
)
from pdflow.core.framework.errors import LocalProtocolError
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.inputs import AbortRequested, PublishPages
from pdflow.core.protocol.messages import Abort, AnyMessage, PeerId, StatusReport
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
from pdflow.sim.effects import DecodeSimEffects
from pdflow.sim.faults import draw_plan
from pdflow.sim.world import World
from tests.unit.test_endpoint_scenarios import BOOT, DECODE, PREFILL_A, TIMEOUTS, info

REPO = Path(__file__).resolve().parents[2]
PEER = PeerId("10.0.0.1:7000", "p", 0)


class EffectNames:
    """Effects whose result is the name of the effect chosen (R = str)."""

    def send(self, to: PeerId, message: AnyMessage, msg_id: str | None) -> str:
        return "send"

    def report_status(self, change: StatusChanged) -> str:
        return "report_status"

    def forget_room(self, removed: RoomRemoved) -> str:
        return "forget_room"

    def count_drop(self, dropped: Dropped) -> str:
        return "count_drop"

    def record_only(self, output: Output) -> str:
        return "record_only"

    def start_transfer(self, start: StartTransfer) -> str:
        return "start_transfer"

    def fetch_topology(self, bootstrap: str) -> str:
        return "fetch_topology"

    def close_session(self, request: CloseSession) -> str:
        return "close_session"

    def readmit_writer(self, readmit: ReadmitWriter) -> str:
        return "readmit_writer"

    def note_superseded(self, superseded: IncarnationSuperseded) -> str:
        return "note_superseded"

    def verify_checksums(self, request: VerifyChecksums) -> str:
        return "verify_checksums"

    def store_aux(self, aux: StoreAux) -> str:
        return "store_aux"

    def note_staging(self, placed: StagingPlaced) -> str:
        return "note_staging"

    def release_pages(self, freed: PagesFreed) -> str:
        return "release_pages"

    def hold_pages(self, held: PagesQuarantined) -> str:
        return "hold_pages"


COMMON: dict[Output, str] = {
    SendMessage(PEER, Abort(1, 1, PEER, PEER)): "send",
    StatusChanged(1, 1, KVPoll.Failed): "report_status",
    RoomRemoved(1, 1): "forget_room",
    Dropped("stale_generation", "room 1"): "count_drop",
}
PREFILL_EFFECTS: dict[Output, str] = {
    **COMMON,
    StartTransfer(1, 1, 0, PEER, "s", (1,), (2,), True, None, None): "start_transfer",
    OwnerRefused(1, 1, "taken"): "record_only",
}
DECODE_EFFECTS: dict[Output, str] = {
    **COMMON,
    NeedTopology(BOOT): "fetch_topology",
    CloseSession(PEER): "close_session",
    ReadmitWriter(PEER): "readmit_writer",
    IncarnationSuperseded(BOOT, "p-old"): "note_superseded",
    VerifyChecksums(1, 1, ((PEER, 5),)): "verify_checksums",
    StoreAux(1, 1, 2, b"row"): "store_aux",
    StagingPlaced(1, 1, 0, 64): "note_staging",
    PagesFreed(1, 1, (3,)): "release_pages",
    PagesQuarantined(1, 1, (3,), (PEER,)): "hold_pages",
    ArmFence(1, 1, (PEER,)): "record_only",
    StagingAssigned(1, 1, 0, 0, 64): "record_only",
    StagingOversized(1, 1, 99, 64, "too big"): "record_only",
    StagingReady(1, 1, 0, 0): "record_only",
    StagingDeferred(1, 1, 0, 1, 0, 0): "record_only",
    WatermarkAdvanced(1, 0): "record_only",
}


def test_every_prefill_output_reaches_its_effect() -> None:
    assert {type(o) for o in PREFILL_EFFECTS} == set(get_args(PrefillOutput))
    for output, effect in PREFILL_EFFECTS.items():
        assert carry_out_prefill(EffectNames(), output, "p:1:0") == effect, output


def test_every_decode_output_reaches_its_effect() -> None:
    assert {type(o) for o in DECODE_EFFECTS} == set(get_args(DecodeOutput))
    for output, effect in DECODE_EFFECTS.items():
        assert carry_out_decode(EffectNames(), output, "d:1:0") == effect, output


def test_an_output_outside_a_roles_contract_is_refused() -> None:
    with pytest.raises(TypeError, match="StartTransfer is not a decode endpoint output"):
        carry_out_decode(EffectNames(), StartTransfer(1, 1, 0, PEER, "s", (), (), True, None,
                                                      None), None)  # fmt: skip
    with pytest.raises(TypeError, match="PagesFreed is not a prefill endpoint output"):
        carry_out_prefill(EffectNames(), PagesFreed(1, 1, (3,)), None)


def _mypy(source: str, tmp_path: Path, name: str) -> tuple[int, str]:
    probe = tmp_path / f"{name}.py"
    probe.write_text(source)
    out, err, status = mypy_api.run([
        "--strict", "--config-file", str(REPO / "pyproject.toml"),
        "--cache-dir", str(tmp_path / "mypy-cache"), str(probe),
    ])  # fmt: skip
    return status, out + err


def test_an_output_added_without_a_dispatch_case_fails_mypy(tmp_path: Path) -> None:
    source = Path(contract.__file__).read_text()
    status, report = _mypy(source, tmp_path, "contract_as_is")
    assert status == 0, report
    widened = source.replace(
        "DecodeOutput = (\n",
        'class Unhandled(Output, frozen=True, tag="unhandled"):\n    pass\n\n\n'
        "DecodeOutput = (\n    Unhandled\n    | ",
    )
    assert widened != source
    status, report = _mypy(widened, tmp_path, "contract_widened")
    assert status == 1 and 'incompatible type "Unhandled"; expected "Never"' in report, report


def test_a_checksum_answer_for_a_cleared_room_ends_the_hold_on_its_pages() -> None:
    """Both shells answer every VerifyChecksums; the room may fail and be cleared meanwhile,
    and its pages wait for that answer (the staged scatter writes them until then)."""
    config = DecodeEndpointConfig(me=DECODE, num_pages=8, timeouts=TIMEOUTS, verify_checksums=True)
    d = DecodeEndpoint(config)
    d.handle(OpenReceiver(1, 1, BOOT), 0.0)
    d.handle(TopologyKnown(info(PREFILL_A)), 0.0)
    d.handle(PublishPages(1, (0, 1), aux_index=None), 0.0)
    report = StatusReport(1, 1, KVPoll.Success, PREFILL_A, DECODE, checksum=5)
    assert any(isinstance(o, VerifyChecksums) for o in d.handle(Received(report), 1.0).outputs)
    d.handle(RoomCall(1, AbortRequested("engine gave up")), 2.0)
    cleared = d.handle(ClearRoom(1), 2.0)
    assert not any(isinstance(o, PagesFreed) for o in cleared.outputs)
    before = d.snapshot()
    step = d.handle(ChecksumChecked(1, 1, True), 3.0)
    assert [o.pages for o in step.outputs if isinstance(o, PagesFreed)] == [(0, 1)]
    assert d.snapshot().rooms == before.rooms and d.ledger.allocatable == 8
    # A second answer is a shell bug (each VerifyChecksums is answered once): refused, no change.
    after = d.snapshot()
    with pytest.raises(LocalProtocolError, match="ChecksumChecked"):
        d.handle(ChecksumChecked(1, 1, True), 3.1)
    assert d.snapshot() == after


def test_the_world_fences_a_writer_when_that_work_runs_not_when_asked() -> None:
    """As in the node: writes of a dead writer may still land until the fence runs."""
    world = World(draw_plan(4), record=False)
    decode = world.decode[0]
    writer = world.prefill_peer(0)
    carry_out_decode(DecodeSimEffects(world, decode), CloseSession(writer), "d:1:0")
    assert (decode.rank, writer) not in world.transport.fenced
    [index] = [i for i, e in enumerate(world.local_events) if e.kind == "fence"]
    steps = world.steps
    world.run_local_event(index)
    assert (decode.rank, writer) in world.transport.fenced
    assert world.steps == steps + 1  # and then the endpoint was told: SessionClosed
