"""In-process transport: bounds checks on both sides, injected failures, close fencing, the
receiver-side fence."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import NamedTuple

import anyio
import msgspec
import pytest

from pdflow.transport import (
    FenceUnavailableError,
    InProcessFabric,
    InProcessTransport,
    InvalidWriteError,
    RegistrationError,
    TransportClosedError,
    WriteOpLike,
)

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class Op(NamedTuple):
    src_addr: int
    dst_addr: int
    length: int


class StructOp(msgspec.Struct, frozen=True):
    src_addr: int
    dst_addr: int
    length: int


class Pair(NamedTuple):
    fabric: InProcessFabric
    sender: InProcessTransport
    receiver: InProcessTransport
    src: ctypes.Array[ctypes.c_char]
    dst: ctypes.Array[ctypes.c_char]

    @property
    def src_addr(self) -> int:
        return ctypes.addressof(self.src)

    @property
    def dst_addr(self) -> int:
        return ctypes.addressof(self.dst)


SIZE = 64 * 1024


@pytest.fixture
def pair() -> Iterator[Pair]:
    fabric = InProcessFabric()
    sender, receiver = fabric.create_transport(), fabric.create_transport()
    src = ctypes.create_string_buffer(bytes(range(256)) * (SIZE // 256), SIZE)
    dst = ctypes.create_string_buffer(SIZE)
    sender.register_buffer(ctypes.addressof(src), SIZE)
    receiver.register_buffer(ctypes.addressof(dst), SIZE)
    yield Pair(fabric, sender, receiver, src, dst)


async def test_write_lands_bytes_and_reports_them(pair: Pair) -> None:
    ops: list[WriteOpLike] = [
        Op(pair.src_addr, pair.dst_addr + 4096, 4096),
        StructOp(src_addr=pair.src_addr + 8192, dst_addr=pair.dst_addr, length=100),
    ]
    outcome = await pair.sender.batch_write(pair.receiver.session_id, ops)
    assert outcome.ok, outcome.error
    assert (outcome.nbytes, outcome.nops) == (4196, 2)
    assert outcome.seconds is not None and outcome.seconds >= 0
    assert pair.dst.raw[4096:8192] == pair.src.raw[:4096]
    assert pair.dst.raw[:100] == pair.src.raw[8192:8292]
    assert pair.dst.raw[100:4096] == bytes(3996)


@pytest.mark.parametrize(
    ("offset", "length"),
    [(SIZE - 10, 11), (SIZE, 1), (-1, 2), (10 * SIZE, 4096)],
    ids=["straddles-end", "just-past-end", "starts-before", "far-away"],
)
async def test_write_outside_peer_buffers_fails_whole_batch(
    pair: Pair, offset: int, length: int
) -> None:
    ops = [Op(pair.src_addr, pair.dst_addr, 16), Op(pair.src_addr, pair.dst_addr + offset, length)]
    outcome = await pair.sender.batch_write(pair.receiver.session_id, ops)
    assert not outcome.ok
    assert (outcome.nbytes, outcome.nops) == (0, 0)
    assert outcome.error is not None and "op 1: destination" in outcome.error
    assert pair.dst.raw == bytes(SIZE), "a rejected batch must not write its valid ops either"


async def test_write_to_unknown_peer_fails_cleanly(pair: Pair) -> None:
    outcome = await pair.sender.batch_write("inproc:999", [Op(pair.src_addr, pair.dst_addr, 8)])
    assert not outcome.ok
    assert outcome.error is not None and "inproc:999" in outcome.error


async def test_unregistered_source_is_rejected_before_any_write(pair: Pair) -> None:
    stray = ctypes.create_string_buffer(64)
    with pytest.raises(InvalidWriteError, match=r"op 0: source .* register_buffer"):
        await pair.sender.batch_write(
            pair.receiver.session_id, [Op(ctypes.addressof(stray), pair.dst_addr, 64)]
        )
    with pytest.raises(InvalidWriteError, match="op 0: source"):
        await pair.sender.batch_write(
            pair.receiver.session_id, [Op(pair.src_addr + SIZE - 8, pair.dst_addr, 16)]
        )
    assert pair.dst.raw == bytes(SIZE)


@pytest.mark.parametrize(
    "bad",
    [{"length": 0}, {"length": -5}, {"length": 1.5}, {"dst_addr": True}, {"src_addr": None}],
)
async def test_malformed_ops_raise_invalid_write(pair: Pair, bad: dict[str, object]) -> None:
    fields: dict[str, object] = {"src_addr": pair.src_addr, "dst_addr": pair.dst_addr, "length": 8}
    fields.update(bad)
    op = Op(**fields)  # type: ignore[arg-type]
    with pytest.raises(InvalidWriteError, match="op 0"):
        await pair.sender.batch_write(pair.receiver.session_id, [op])
    assert pair.dst.raw == bytes(SIZE)


async def test_empty_batch_succeeds_with_nothing_moved(pair: Pair) -> None:
    outcome = await pair.sender.batch_write(pair.receiver.session_id, [])
    assert outcome.ok and (outcome.nbytes, outcome.nops) == (0, 0)


async def test_registration_rejects_overlap_and_unknown_addresses(pair: Pair) -> None:
    with pytest.raises(RegistrationError, match="overlaps"):
        pair.sender.register_buffer(pair.src_addr + 100, 10)
    with pytest.raises(RegistrationError, match="overlaps"):
        pair.sender.register_buffer(pair.src_addr - 10, 11)
    with pytest.raises(RegistrationError, match="positive"):
        pair.sender.register_buffer(pair.src_addr + SIZE, 0)
    with pytest.raises(RegistrationError, match="no buffer is registered"):
        pair.sender.unregister_buffer(pair.src_addr + 1)
    assert pair.sender.registered_buffers == [(pair.src_addr, SIZE)]
    pair.receiver.unregister_buffer(pair.dst_addr)
    outcome = await pair.sender.batch_write(
        pair.receiver.session_id, [Op(pair.src_addr, pair.dst_addr, 8)]
    )
    assert not outcome.ok, "an unregistered destination must refuse writes"


async def test_injected_failure_hits_next_write_only(pair: Pair) -> None:
    pair.fabric.fail_next_writes(pair.receiver.session_id, message="link down")
    ops = [Op(pair.src_addr, pair.dst_addr, 32)]
    failed = await pair.sender.batch_write(pair.receiver.session_id, ops)
    assert (failed.ok, failed.error, failed.nbytes) == (False, "link down", 0)
    assert pair.dst.raw[:32] == bytes(32)
    recovered = await pair.sender.batch_write(pair.receiver.session_id, ops)
    assert recovered.ok and pair.dst.raw[:32] == pair.src.raw[:32]


async def test_injected_partial_failure_lands_only_the_prefix(pair: Pair) -> None:
    pair.fabric.fail_next_writes(pair.receiver.session_id, count=2, land_ops=1)
    ops = [Op(pair.src_addr, pair.dst_addr, 8), Op(pair.src_addr + 8, pair.dst_addr + 8, 8)]
    for _ in range(2):
        outcome = await pair.sender.batch_write(pair.receiver.session_id, ops)
        assert (outcome.ok, outcome.nops, outcome.nbytes) == (False, 1, 8)
    assert pair.dst.raw[:16] == pair.src.raw[:8] + bytes(8)
    assert (await pair.sender.batch_write(pair.receiver.session_id, ops)).ok
    with pytest.raises(ValueError, match="count > 0"):
        pair.fabric.fail_next_writes(pair.receiver.session_id, count=0)


async def test_close_session_waits_for_in_flight_write(pair: Pair) -> None:
    hold = pair.fabric.hold_writes(pair.receiver.session_id)
    peer = pair.receiver.session_id
    events: list[str] = []

    async def write() -> None:
        outcome = await pair.sender.batch_write(peer, [Op(pair.src_addr, pair.dst_addr, 64)])
        events.append(f"write ok={outcome.ok}")

    async def close() -> None:
        await pair.sender.close_session(peer)
        events.append(f"closed landed={pair.dst.raw[:64] == pair.src.raw[:64]}")

    async with anyio.create_task_group() as tg:
        tg.start_soon(write)
        await hold.wait_for_writer()
        tg.start_soon(close)
        await anyio.wait_all_tasks_blocked()
        assert events == [], "close_session returned while a write was still in flight"
        during = await pair.sender.batch_write(peer, [Op(pair.src_addr, pair.dst_addr, 8)])
        assert not during.ok and during.error is not None and "being closed" in during.error
        with pytest.raises(RegistrationError, match="in flight"):
            pair.sender.unregister_buffer(pair.src_addr)
        hold.release()
    assert events == ["write ok=True", "closed landed=True"]
    pair.fabric.clear_hooks()
    reopened = await pair.sender.batch_write(peer, [Op(pair.src_addr, pair.dst_addr, 8)])
    assert reopened.ok, "a write after close_session opens a fresh session"


async def test_receiver_fence_refuses_a_write_already_in_flight(pair: Pair) -> None:
    hold = pair.fabric.hold_writes(pair.receiver.session_id)
    canary = b"\xc3" * 64
    ctypes.memmove(pair.dst_addr, canary, 64)
    outcomes = []

    async def write() -> None:
        op = Op(pair.src_addr, pair.dst_addr, 64)
        outcomes.append(await pair.sender.batch_write(pair.receiver.session_id, [op]))

    assert pair.receiver.fence_is_real
    async with anyio.create_task_group() as tg:
        tg.start_soon(write)
        await hold.wait_for_writer()
        await pair.receiver.fence(pair.sender.session_id)
        hold.release()
    assert pair.dst.raw[:64] == canary, "a fenced writer's write landed after the fence"
    assert not outcomes[0].ok and outcomes[0].error is not None
    assert "fenced" in outcomes[0].error and outcomes[0].nbytes == 0
    later = await pair.sender.batch_write(pair.receiver.session_id,
                                          [Op(pair.src_addr, pair.dst_addr, 8)])  # fmt: skip
    assert not later.ok and pair.dst.raw[:8] == canary[:8], "the fence is permanent"
    # Only that writer is fenced: the receiver still writes to it, and others write here.
    other = pair.fabric.create_transport()
    other.register_buffer(pair.src_addr, SIZE)
    assert (await other.batch_write(pair.receiver.session_id,
                                    [Op(pair.src_addr, pair.dst_addr, 8)])).ok  # fmt: skip


async def test_lifted_fence_admits_only_writes_issued_after_it(pair: Pair) -> None:
    hold = pair.fabric.hold_writes(pair.receiver.session_id)
    canary = b"\xc3" * 64
    ctypes.memmove(pair.dst_addr, canary, 64)
    outcomes = []

    async def write(offset: int) -> None:
        op = Op(pair.src_addr + offset, pair.dst_addr + offset, 32)
        outcomes.append((offset, await pair.sender.batch_write(pair.receiver.session_id, [op])))

    async with anyio.create_task_group() as tg:
        tg.start_soon(write, 0)  # issued before the fence, still in flight after the lift
        await hold.wait_for_writer()
        await pair.receiver.fence(pair.sender.session_id)
        await pair.receiver.lift_fence(pair.sender.session_id)
        tg.start_soon(write, 32)  # issued after the lift
        await anyio.wait_all_tasks_blocked()
        hold.release()
    ok = {offset: outcome.ok for offset, outcome in outcomes}
    assert ok == {0: False, 32: True}
    assert pair.dst.raw[:32] == canary[:32], "a write issued before the fence landed"
    assert pair.dst.raw[32:64] == pair.src.raw[32:64]
    await pair.receiver.fence(pair.sender.session_id)  # fenced again: refused again
    again = await pair.sender.batch_write(pair.receiver.session_id,
                                          [Op(pair.src_addr, pair.dst_addr, 8)])  # fmt: skip
    assert not again.ok and pair.dst.raw[:8] == canary[:8]


async def test_fabric_without_receiver_fence_refuses_fence_calls() -> None:
    fabric = InProcessFabric(receiver_fence=False)
    receiver = fabric.create_transport()
    assert not receiver.fence_is_real
    with pytest.raises(FenceUnavailableError, match="quarantined until its drain ACK"):
        await receiver.fence("inproc:9")
    with pytest.raises(FenceUnavailableError):
        await receiver.lift_fence("inproc:9")


async def test_cancelled_write_leaves_nothing_in_flight(pair: Pair) -> None:
    hold = pair.fabric.hold_writes(pair.receiver.session_id)
    with anyio.move_on_after(0.05):
        await pair.sender.batch_write(
            pair.receiver.session_id, [Op(pair.src_addr, pair.dst_addr, 8)]
        )
    assert hold.waiting == 0
    with anyio.fail_after(1):
        await pair.sender.close_session(pair.receiver.session_id)
    assert pair.dst.raw[:8] == bytes(8), "a write cancelled before copying must not land"


async def test_close_session_without_writes_returns_at_once(pair: Pair) -> None:
    with anyio.fail_after(1):
        await pair.sender.close_session("inproc:never-seen")


async def test_aclose_fences_and_forbids_further_use(pair: Pair) -> None:
    async with pair.receiver:
        pass
    assert pair.fabric.engine(pair.receiver.session_id) is None
    outcome = await pair.sender.batch_write(
        pair.receiver.session_id, [Op(pair.src_addr, pair.dst_addr, 8)]
    )
    assert not outcome.ok and outcome.error is not None and "closed" in outcome.error
    with pytest.raises(TransportClosedError, match="create a new transport"):
        pair.receiver.register_buffer(pair.dst_addr, SIZE)
    with pytest.raises(TransportClosedError):
        await pair.receiver.batch_write(pair.sender.session_id, [])
    await pair.receiver.aclose()  # idempotent
