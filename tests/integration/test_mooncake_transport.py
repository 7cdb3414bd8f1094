"""Real Mooncake Transfer Engine over TCP on loopback: two processes, and two engines in one;
and why it has no receiver-side fence."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import NamedTuple

import anyio
import numpy as np
import pytest
from anyio.abc import Process
from anyio.streams.buffered import BufferedByteReceiveStream

import pdflow.transport.mooncake as mooncake_module
from pdflow import loop_idle
from pdflow.transport import (
    FenceUnavailableError,
    InvalidWriteError,
    MooncakeConfig,
    MooncakeTransport,
    TransportClosedError,
    TransportError,
)

pytestmark = [pytest.mark.anyio, pytest.mark.integration, pytest.mark.timeout(90)]

RECEIVER_SCRIPT = Path(__file__).with_name("mooncake_receiver.py")
REMOTE_SIZE = 32 << 20


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Op(NamedTuple):
    src_addr: int
    dst_addr: int
    length: int


class LocalBuffer:
    """A ctypes buffer with a deterministic, position-dependent byte pattern."""

    def __init__(self, size: int, seed: int = 1) -> None:
        pattern = hashlib.sha256(seed.to_bytes(4, "little")).digest() * 8  # 256 bytes
        self.size = size
        self.raw = ctypes.create_string_buffer(pattern * (size // len(pattern)), size)
        self.addr = ctypes.addressof(self.raw)

    def sha256(self, offset: int, length: int) -> str:
        return hashlib.sha256(ctypes.string_at(self.addr + offset, length)).hexdigest()

    def read(self, offset: int, length: int) -> bytes:
        return ctypes.string_at(self.addr + offset, length)


class RemoteReceiver:
    """The receiver subprocess and its registered buffer."""

    def __init__(self, process: Process, reader: BufferedByteReceiveStream) -> None:
        self.process = process
        self._reader = reader
        self.session_id = ""
        self.addr = 0

    async def read_reply(self) -> dict[str, object]:
        with anyio.fail_after(30):
            line = await self._reader.receive_until(b"\n", 1 << 16)
        reply: dict[str, object] = json.loads(line)
        return reply

    async def command(self, text: str) -> dict[str, object]:
        assert self.process.stdin is not None
        await self.process.stdin.send(f"{text}\n".encode())
        return await self.read_reply()

    async def sha256(self, offset: int, length: int) -> object:
        return (await self.command(f"sha256 {offset} {length}"))["sha256"]


@asynccontextmanager
async def remote_peer(size: int, fill: int = 0) -> AsyncIterator[RemoteReceiver]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = await anyio.open_process(
        [sys.executable, str(RECEIVER_SCRIPT), "--size", str(size), "--fill", str(fill)], env=env
    )
    assert process.stdout is not None
    remote = RemoteReceiver(process, BufferedByteReceiveStream(process.stdout))
    try:
        hello = await remote.read_reply()
        remote.session_id = str(hello["session_id"])
        remote.addr = int(str(hello["addr"]))
        yield remote
    finally:
        if process.returncode is None:
            process.kill()
        with anyio.fail_after(10):
            await process.wait()


@pytest.fixture
async def receiver() -> AsyncIterator[RemoteReceiver]:
    async with remote_peer(REMOTE_SIZE) as remote:
        yield remote


@pytest.fixture
async def sender() -> AsyncIterator[tuple[MooncakeTransport, LocalBuffer]]:
    local = LocalBuffer(REMOTE_SIZE)
    async with MooncakeTransport.open(MooncakeConfig(host="127.0.0.1", protocol="tcp")) as sender:
        sender.register_buffer(local.addr, local.size)
        yield sender, local


async def test_two_processes_scattered_writes_land_exactly(
    receiver: RemoteReceiver, sender: tuple[MooncakeTransport, LocalBuffer]
) -> None:
    transport, local = sender
    assert transport.session_id.startswith("127.0.0.1:")
    assert receiver.session_id.startswith("127.0.0.1:")
    page = 4096
    # 300 pages in reverse order (non-contiguous), then one 8 MiB op at the buffer's far end.
    ops = [Op(local.addr + i * page, receiver.addr + (299 - i) * page, page) for i in range(300)]
    big = 8 << 20
    ops.append(Op(local.addr + (16 << 20), receiver.addr + REMOTE_SIZE - big, big))
    with anyio.fail_after(60):
        outcome = await transport.batch_write(receiver.session_id, ops)
    assert outcome.ok, outcome.error
    assert (outcome.nops, outcome.nbytes) == (301, 300 * page + big)
    assert outcome.seconds is not None and outcome.seconds > 0
    for i in (0, 1, 150, 299):
        assert await receiver.sha256((299 - i) * page, page) == local.sha256(i * page, page)
    assert await receiver.sha256(REMOTE_SIZE - big, big) == local.sha256(16 << 20, big)
    untouched = REMOTE_SIZE - big - 300 * page
    assert await receiver.sha256(300 * page, untouched) == hashlib.sha256(
        bytes(untouched)
    ).hexdigest()
    await transport.aclose()


async def test_two_processes_unregistered_remote_range_fails_cleanly(
    receiver: RemoteReceiver, sender: tuple[MooncakeTransport, LocalBuffer]
) -> None:
    transport, local = sender
    beyond = Op(local.addr, receiver.addr + REMOTE_SIZE - 100, 4096)
    with anyio.fail_after(30):
        outcome = await transport.batch_write(receiver.session_id, [beyond])
    assert not outcome.ok
    assert outcome.error is not None and "not registered there" in outcome.error
    assert receiver.process.returncode is None, "the receiver must survive a bad write"
    with anyio.fail_after(30):
        retry = await transport.batch_write(
            receiver.session_id, [Op(local.addr, receiver.addr, 4096)]
        )
    assert retry.ok, retry.error
    assert await receiver.sha256(0, 4096) == local.sha256(0, 4096)
    assert await receiver.command("exit") == {"bye": True}
    await transport.aclose()


async def test_two_processes_killed_peer_fails_without_hanging(
    receiver: RemoteReceiver, sender: tuple[MooncakeTransport, LocalBuffer]
) -> None:
    transport, local = sender
    first = await transport.batch_write(receiver.session_id, [Op(local.addr, receiver.addr, 64)])
    assert first.ok, first.error
    receiver.process.send_signal(signal.SIGKILL)
    await receiver.process.wait()
    with anyio.fail_after(30):
        outcome = await transport.batch_write(
            receiver.session_id, [Op(local.addr, receiver.addr, 1 << 20)]
        )
        await transport.close_session(receiver.session_id)
    assert not outcome.ok and outcome.error is not None
    await transport.aclose()


def landed_bytes(memory: ctypes.Array[ctypes.c_char]) -> int:
    """Bytes that are no longer the zero canary."""
    return int(np.count_nonzero(np.frombuffer(memory, dtype=np.uint8)))


class WriteTarget(NamedTuple):
    receiving: MooncakeTransport
    writer: RemoteReceiver
    memory: ctypes.Array[ctypes.c_char]
    addr: int


@asynccontextmanager
async def write_target(size: int) -> AsyncIterator[WriteTarget]:
    """An engine in this process with ``size`` zeroed bytes registered, and a writer process
    (its own engine) to write into them."""
    memory = ctypes.create_string_buffer(size)
    addr = ctypes.addressof(memory)
    config = MooncakeConfig(host="127.0.0.1", protocol="tcp")
    async with MooncakeTransport.open(config) as receiving, remote_peer(size, 0xAB) as writer:
        receiving.register_buffer(addr, size)
        yield WriteTarget(receiving, writer, memory, addr)


async def pause_mid_write(target: WriteTarget, session_id: str, size: int) -> None:
    """The writer starts one ``size``-byte write to ``session_id`` and is paused (SIGSTOP) as
    soon as its first byte has landed."""
    writer, addr = target.writer, target.addr
    assert writer.process.stdin is not None
    await writer.process.stdin.send(f"write {session_id} {addr} {size}\n".encode())
    with anyio.fail_after(30):
        while ctypes.string_at(addr, 1) == b"\0":
            await anyio.sleep(0.0002)
    writer.process.send_signal(signal.SIGSTOP)


async def test_two_processes_an_accepted_write_lands_after_the_receiver_unregisters() -> None:
    """Why MooncakeTransport.fence_is_real is False: over TCP the receiver checks a request's
    destination once, when its header arrives, so a writer paused mid-request still lands the
    rest when it resumes, into memory the receiver unregistered while it was paused."""
    size = 256 << 20
    async with write_target(size) as target:
        receiving, writer, memory, addr = target
        assert not receiving.fence_is_real
        with pytest.raises(FenceUnavailableError, match="drain ACK"):
            await receiving.fence(writer.session_id)
        await pause_mid_write(target, receiving.session_id, size)
        receiving.unregister_buffer(addr)
        await anyio.sleep(0.3)  # what was already in the socket buffers is read meanwhile
        at_pause = landed_bytes(memory)
        await anyio.sleep(0.3)
        assert landed_bytes(memory) == at_pause, "a paused writer moved bytes"
        assert at_pause < size, "the write finished before the writer could be paused"
        writer.process.send_signal(signal.SIGCONT)
        result = await writer.read_reply()
        assert result["ok"] is True, result
        assert landed_bytes(memory) == size, "the rest of the accepted write landed late"
        # A request whose header arrives after the unregister is refused and lands nothing.
        ctypes.memset(addr, 0, 4096)
        refused = await writer.command(f"write {receiving.session_id} {addr} 4096")
        assert refused["ok"] is False, refused
        assert landed_bytes(memory) == size - 4096
        print(f"late bytes landed after unregister: {size - at_pause} of {size}")


@pytest.fixture
async def engine_pair() -> AsyncIterator[tuple[MooncakeTransport, MooncakeTransport]]:
    config = MooncakeConfig(host="127.0.0.1", protocol="tcp")
    async with MooncakeTransport.open(config) as first, MooncakeTransport.open(config) as second:
        yield first, second


def registered_buffers(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport], size: int, seed: int
) -> tuple[LocalBuffer, LocalBuffer]:
    """A ``size``-byte source registered in the pair's first (sending) engine and a destination
    in its second, each with its own pattern (``seed`` and ``seed + 1``)."""
    sender, receiver = engine_pair
    src, dst = LocalBuffer(size, seed=seed), LocalBuffer(size, seed=seed + 1)
    sender.register_buffer(src.addr, src.size)
    receiver.register_buffer(dst.addr, dst.size)
    return src, dst


async def test_one_process_batch_beyond_engine_queue_succeeds(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    # 4096 ops exceed the TCP transport's per-peer queue as one engine batch; the window must
    # keep the transport under it.
    sender, receiver = engine_pair
    count, page = 4096, 4096
    src, dst = registered_buffers(engine_pair, count * page, seed=2)
    ops = [Op(src.addr + i * page, dst.addr + i * page, page) for i in range(count)]
    with anyio.fail_after(60):
        outcome = await sender.batch_write(receiver.session_id, ops)
    assert outcome.ok, outcome.error
    assert (outcome.nops, outcome.nbytes) == (count, count * page)
    assert dst.sha256(0, dst.size) == src.sha256(0, src.size)


class PollRecorder:
    """The real engine, recording which ops `transfer_check_status` is asked about: for each
    check, whether an earlier op to the same peer was still unsettled."""

    def __init__(self, engine: object) -> None:
        self._engine = engine
        self.unsettled: dict[str, list[int]] = {}  # per peer, in submission order
        self.peer_of: dict[int, str] = {}
        self.checks = 0
        self.checks_behind_an_unsettled_op = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    def transfer_submit_write(self, peer: str, src: int, dst: int, length: int) -> int:
        handle: int = self._engine.transfer_submit_write(peer, src, dst, length)  # type: ignore[attr-defined]
        self.unsettled.setdefault(peer, []).append(handle)
        self.peer_of[handle] = peer
        return handle

    def transfer_check_status(self, handle: int) -> int:
        queue = self.unsettled[self.peer_of[handle]]
        self.checks += 1
        self.checks_behind_an_unsettled_op += queue[0] != handle
        status: int = self._engine.transfer_check_status(handle)  # type: ignore[attr-defined]
        if status in (1, -1):  # settled: the engine frees the id, which a later op may reuse
            queue.remove(handle)
            del self.peer_of[handle]
        return status


class DescendingRoom:
    """A 64 MiB room as the decode's free list hands it out (1,024 ops of 64 KiB, pages
    descending), with the sender's engine wrapped in a PollRecorder."""

    count, page = 1024, 64 << 10

    def __init__(self, engine_pair: tuple[MooncakeTransport, MooncakeTransport], seed: int) -> None:
        sender, _ = engine_pair
        count, page = self.count, self.page
        self.src, self.dst = registered_buffers(engine_pair, count * page, seed=seed)
        self.ops = [
            Op(self.src.addr + i * page, self.dst.addr + (count - 1 - i) * page, page)
            for i in range(count)
        ]
        self.recorder = PollRecorder(sender._engine)
        sender._engine = self.recorder

    def assert_landed(self) -> None:
        count, page = self.count, self.page
        for i in range(count):
            assert self.dst.sha256((count - 1 - i) * page, page) == self.src.sha256(i * page, page)


async def test_one_process_polls_each_peer_in_submission_order(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    # A 64 MiB room as the decode's free list hands it out (1,024 ops of 64 KiB, pages
    # descending): the worker checks only a peer's oldest unsettled op, never the ones queued
    # behind it (each check is a GIL release), and still sees every op settled.
    sender, receiver = engine_pair
    room = DescendingRoom(engine_pair, seed=3)
    count, ops, recorder = room.count, room.ops, room.recorder
    with anyio.fail_after(60):
        outcome = await sender.batch_write(receiver.session_id, ops)
    assert outcome.ok, outcome.error
    assert (outcome.nops, outcome.nbytes) == (count, count * room.page)
    assert recorder.unsettled == {receiver.session_id: []}, "an op was never seen settled"
    assert recorder.checks >= count
    assert recorder.checks_behind_an_unsettled_op == 0, (
        f"{recorder.checks_behind_an_unsettled_op} of {recorder.checks} checks asked about an "
        "op queued behind one still on the wire"
    )
    room.assert_landed()


async def test_one_process_pauses_after_every_sweep_while_the_peer_has_work_queued(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    # While many ops are on the wire the engine's connections have work queued, so the worker
    # pauses the longer pause after each sweep instead of polling again at once for the op
    # just behind the one that settled; near the end it goes back to the short pause.
    sender, receiver = engine_pair
    room = DescendingRoom(engine_pair, seed=5)
    count, ops, recorder = room.count, room.ops, room.recorder
    pauses: list[tuple[int, float]] = []  # (ops unsettled, pause asked for)

    def recorded_sleep(seconds: float) -> None:
        pauses.append((len(recorder.unsettled.get(receiver.session_id, [])), seconds))
        time.sleep(seconds)

    clock = SimpleNamespace(perf_counter=time.perf_counter, sleep=recorded_sleep)
    monkeypatch.setattr(mooncake_module, "time", clock)
    with anyio.fail_after(60):
        outcome = await sender.batch_write(receiver.session_id, ops)
    assert outcome.ok, outcome.error
    busy = [seconds for unsettled, seconds in pauses if unsettled >= mooncake_module._BUSY_OPS]
    assert busy, "no pause while the window was full"
    assert set(busy) == {mooncake_module._BUSY_PAUSE_S}, sorted(set(busy))
    assert {s for u, s in pauses if u < mooncake_module._BUSY_OPS} <= {
        mooncake_module._POLL_PAUSE_S
    }
    # A check settles an op or ends a sweep; below the busy mark (only at the end) a sweep
    # that settled something runs again at once, so at most that many sweeps are unpaused.
    assert recorder.checks <= count + len(pauses) + mooncake_module._BUSY_OPS
    room.assert_landed()


class SubmitThreads:
    """The real engine, recording the thread of each submit and of each status check, and which
    ops were seen settled."""

    def __init__(self, engine: object) -> None:
        self._engine = engine
        self.submitted_on: list[str] = []
        self.checked_on: set[str] = set()
        self.unsettled: set[int] = set()

    def __getattr__(self, name: str) -> object:
        return getattr(self._engine, name)

    def transfer_submit_write(self, peer: str, src: int, dst: int, length: int) -> int:
        handle: int = self._engine.transfer_submit_write(peer, src, dst, length)  # type: ignore[attr-defined]
        self.submitted_on.append(threading.current_thread().name)
        self.unsettled.add(handle)
        return handle

    def transfer_check_status(self, handle: int) -> int:
        self.checked_on.add(threading.current_thread().name)
        status: int = self._engine.transfer_check_status(handle)  # type: ignore[attr-defined]
        if status in (1, -1):
            self.unsettled.discard(handle)
        return status


def recorded_sender(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport], size: int, seed: int
) -> tuple[MooncakeTransport, MooncakeTransport, LocalBuffer, LocalBuffer, SubmitThreads]:
    """The pair, its registered buffers (as `registered_buffers`) and the sender's engine
    swapped for a `SubmitThreads` recorder of it."""
    sender, receiver = engine_pair
    src, dst = registered_buffers(engine_pair, size, seed=seed)
    recorder = SubmitThreads(sender._engine)
    sender._engine = recorder
    return sender, receiver, src, dst, recorder


async def test_one_process_a_jobs_first_ops_are_submitted_before_the_thread_hop(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 1 MiB room (4 ops) goes on the wire from the event loop's own thread; of a 64 MiB
    # room of 1,024 ops the loop submits the first _LOOP_SUBMIT_OPS and the worker the rest.
    # (The loop's polling time is lifted: a first write also opens the connections, which
    # may take longer than that time; the next test covers a write that outlasts it.)
    monkeypatch.setattr(mooncake_module, "_LOOP_POLL_S", 60.0)
    count, page = 1024, 64 << 10
    sender, receiver, src, dst, recorder = recorded_sender(engine_pair, count * page, seed=9)
    loop_thread = threading.current_thread().name
    small = [Op(src.addr + i * (256 << 10), dst.addr + i * (256 << 10), 256 << 10)
             for i in range(4)]  # fmt: skip
    with anyio.fail_after(60):
        outcome = await sender.batch_write(receiver.session_id, small)
    assert outcome.ok, outcome.error
    assert recorder.submitted_on == [loop_thread] * 4
    # ... and is polled from there too: no worker thread on a small room's path.
    assert recorder.checked_on == {loop_thread}
    assert dst.sha256(0, 1 << 20) == src.sha256(0, 1 << 20)
    recorder.submitted_on.clear()
    recorder.checked_on.clear()
    large = [Op(src.addr + i * page, dst.addr + i * page, page) for i in range(count)]
    with anyio.fail_after(60):
        outcome = await sender.batch_write(receiver.session_id, large)
    assert outcome.ok, outcome.error
    first = mooncake_module._LOOP_SUBMIT_OPS
    assert recorder.submitted_on[:first] == [loop_thread] * first
    assert loop_thread not in recorder.submitted_on[first:]
    assert loop_thread not in recorder.checked_on
    assert len(recorder.submitted_on) == count
    assert not recorder.unsettled, "an op was never seen settled"
    assert dst.sha256(0, dst.size) == src.sha256(0, src.size)


async def test_one_process_a_write_handed_to_a_worker_is_the_loops_idle_point(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Work kept for the loop's idle point (the nodes' trace batches) runs while a worker
    # thread has the write, its op on the wire; a write the loop polls itself is no idle
    # point, so the work waits (here for its 60 s delay, past the test).
    monkeypatch.setattr(mooncake_module, "_LOOP_POLL_S", 60.0)
    size = 64 << 20
    sender, receiver, src, dst, recorder = recorded_sender(engine_pair, size, seed=14)
    on_the_wire: list[int] = []
    small = [Op(src.addr, dst.addr, 1 << 20)]
    with anyio.fail_after(60):
        loop_idle.defer(lambda: on_the_wire.append(len(recorder.unsettled)), 60.0)
        assert (await sender.batch_write(receiver.session_id, small)).ok
        assert on_the_wire == [], "a loop-polled write ran the loop's idle work"
        assert (await sender.batch_write(receiver.session_id, [Op(src.addr, dst.addr, size)])).ok
    assert on_the_wire == [1], "the idle work did not run with the write on the wire"
    assert dst.sha256(0, size) == src.sha256(0, size)


async def test_one_process_a_cancelled_write_returns_once_its_loop_submitted_ops_settled(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    size = 64 << 20
    sender, receiver, src, dst, recorder = recorded_sender(engine_pair, size, seed=10)
    unsettled_on_return: list[int] = []

    async def write() -> None:
        try:
            await sender.batch_write(receiver.session_id, [Op(src.addr, dst.addr, size)])
        finally:
            unsettled_on_return.append(len(recorder.unsettled))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            await anyio.wait_all_tasks_blocked()  # the op is on the wire, the caller waiting
            assert recorder.submitted_on == [threading.current_thread().name]
            tg.cancel_scope.cancel()
    assert unsettled_on_return == [0], "batch_write returned with its op still on the wire"
    assert dst.sha256(0, size) == src.sha256(0, size)


async def test_one_process_a_cancelled_small_write_returns_once_its_loop_polled_ops_settled(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 1 MiB write is polled on the loop between yields: a cancel landing at one of those
    # yields must still wait for every op to settle.
    monkeypatch.setattr(mooncake_module, "_LOOP_POLL_S", 60.0)
    size, count = 1 << 20, 4
    sender, receiver, src, dst, recorder = recorded_sender(engine_pair, size, seed=12)
    quarter = size // count
    ops = [Op(src.addr + i * quarter, dst.addr + i * quarter, quarter) for i in range(count)]
    unsettled_at_cancel: list[int] = []
    unsettled_on_return: list[int] = []

    async def write() -> None:
        try:
            await sender.batch_write(receiver.session_id, ops)
        finally:
            unsettled_on_return.append(len(recorder.unsettled))

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            while not recorder.submitted_on:
                await anyio.sleep(0)
            unsettled_at_cancel.append(len(recorder.unsettled))
            tg.cancel_scope.cancel()
    assert unsettled_at_cancel[0] > 0, "the ops landed before the cancel: nothing was tested"
    assert recorder.checked_on == {threading.current_thread().name}
    assert unsettled_on_return == [0], "batch_write returned with an op still on the wire"
    assert dst.sha256(0, size) == src.sha256(0, size)


async def test_one_process_a_small_write_past_the_loop_poll_deadline_goes_to_a_worker(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once the loop's polling time is up, the ops still on the wire are the worker's to see
    # settled; the outcome still counts every op.
    size, count = 1 << 20, 4
    sender, receiver, src, dst, recorder = recorded_sender(engine_pair, size, seed=13)
    monkeypatch.setattr(mooncake_module, "_LOOP_POLL_S", 0.0)
    quarter = size // count
    ops = [Op(src.addr + i * quarter, dst.addr + i * quarter, quarter) for i in range(count)]
    with anyio.fail_after(60):
        outcome = await sender.batch_write(receiver.session_id, ops)
    assert outcome.ok, outcome.error
    assert (outcome.nops, outcome.nbytes) == (count, size)
    assert threading.current_thread().name not in recorder.checked_on
    assert not recorder.unsettled, "an op was never seen settled"
    assert dst.sha256(0, size) == src.sha256(0, size)


async def test_one_process_partial_failure_settles_before_returning(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    sender, receiver = engine_pair
    size = 16 << 20
    src, dst = registered_buffers(engine_pair, size, seed=4)
    half = size // 2
    ops = [
        Op(src.addr, dst.addr, half),
        Op(src.addr, dst.addr + size - 10, 4096),  # crosses the end of the registered buffer
        Op(src.addr + half, dst.addr + half, half),
    ]
    with anyio.fail_after(60):
        outcome = await sender.batch_write(receiver.session_id, ops)
    assert not outcome.ok
    assert outcome.error is not None and "first failed op 1" in outcome.error
    # The window submits all three ops before polling, so both valid halves land and are
    # counted, and the rejected op writes nothing.
    assert (outcome.nops, outcome.nbytes) == (2, size)
    assert dst.sha256(0, size) == src.sha256(0, size)
    snapshot = dst.sha256(0, size)
    await anyio.sleep(0.3)
    assert dst.sha256(0, size) == snapshot, "bytes landed after batch_write returned"


async def test_one_process_a_submit_that_raises_fails_its_op_and_the_submitted_ones_settle(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The binding raises (not refuses) on an address it cannot convert: batch_write raised
    with the ops before it still on the wire, so a fence through close_session was void."""
    sender, receiver = engine_pair
    size = 16 << 20
    src, dst = registered_buffers(engine_pair, size, seed=6)
    half = size // 2
    engine = sender._engine
    submitted: list[int] = []

    class RaisesOnSecondSubmit:
        def __getattr__(self, name: str) -> object:
            return getattr(engine, name)

        def transfer_submit_write(self, peer: str, src_addr: int, dst_addr: int,
                                  length: int) -> int:  # fmt: skip
            submitted.append(dst_addr)
            if len(submitted) == 2:
                raise TypeError("incompatible function arguments")
            return int(engine.transfer_submit_write(peer, src_addr, dst_addr, length))

    monkeypatch.setattr(sender, "_engine", RaisesOnSecondSubmit())
    ops = [Op(src.addr, dst.addr, half), Op(src.addr + half, dst.addr + half, half)]
    with anyio.fail_after(60):
        outcome = await sender.batch_write(receiver.session_id, ops)
    assert not outcome.ok and outcome.error is not None and "first failed op 1" in outcome.error
    assert (outcome.nops, outcome.nbytes) == (1, half), "the first op was awaited and landed"
    assert dst.sha256(0, half) == src.sha256(0, half)
    with pytest.raises(InvalidWriteError, match="past the 64-bit address space"):
        await sender.batch_write(receiver.session_id, [Op(src.addr, (1 << 64) - 4096, 8192)])
    assert len(submitted) == 2, "a destination past the address space is refused before submit"


async def test_one_process_close_session_fences_concurrent_writes(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    sender, receiver = engine_pair
    chunk, writers = 8 << 20, 4
    src, dst = registered_buffers(engine_pair, chunk * writers, seed=6)
    results: list[bool] = []

    async def write(index: int) -> None:
        op = Op(src.addr + index * chunk, dst.addr + index * chunk, chunk)
        results.append((await sender.batch_write(receiver.session_id, [op])).ok)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for index in range(writers):
                tg.start_soon(write, index)
            await anyio.wait_all_tasks_blocked()  # every writer is inside the engine now
            await sender.close_session(receiver.session_id)
            fenced = dst.sha256(0, dst.size)
            during = await sender.batch_write(receiver.session_id, [Op(src.addr, dst.addr, 8)])
    assert results == [True] * writers, "writes issued before the close must complete"
    assert fenced == src.sha256(0, src.size), "close_session returned before writes settled"
    assert during.ok, "after close_session returns, a new write opens a fresh session"


async def test_one_process_rejects_misuse_with_clear_errors(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    sender, receiver = engine_pair
    local = LocalBuffer(4096)
    with pytest.raises(InvalidWriteError, match="register_buffer"):
        await sender.batch_write(receiver.session_id, [Op(local.addr, local.addr, 16)])
    with pytest.raises(TransportError, match="unsupported Mooncake protocol"):
        MooncakeTransport.open(MooncakeConfig(protocol="carrier-pigeon"))
    await sender.aclose()
    with pytest.raises(TransportClosedError):
        sender.register_buffer(local.addr, 4096)


async def _concurrent_rooms(sender: MooncakeTransport, receiver: MooncakeTransport,
                            src: LocalBuffer, dst: LocalBuffer, rooms: int, page: int,
                            ops_per_room: int, bad: int) -> dict[int, bool]:  # fmt: skip
    """``rooms`` rooms' writes at once, a room a page in ``ops_per_room`` ops; room ``bad``
    writes past the end of the destination. Each room's outcome."""
    outcomes: dict[int, bool] = {}
    piece = page // ops_per_room

    async def write(room: int) -> None:
        dst_base = dst.addr + dst.size - 10 if room == bad else dst.addr + room * page
        ops = [Op(src.addr + room * page + i * piece, dst_base + i * piece, piece)
               for i in range(ops_per_room)]  # fmt: skip
        outcomes[room] = (await sender.batch_write(receiver.session_id, ops)).ok

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            for room in range(rooms):
                tg.start_soon(write, room)
    for room in range(rooms):
        if room != bad:
            assert dst.sha256(room * page, page) == src.sha256(room * page, page)
    return outcomes


async def test_one_process_concurrent_small_writes_share_one_poller_and_fail_alone(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 64 rooms' one-op writes at once: each is submitted when it is made and all of them are
    # polled by one task at a time (a poller per call spun the loop once per call), every
    # byte lands and the one bad call fails without the others.
    monkeypatch.setattr(mooncake_module, "_LOOP_POLL_S", 60.0)  # none goes to a worker
    sender, receiver = engine_pair
    rooms, page, bad = 64, 4096, 17
    src, dst = registered_buffers(engine_pair, rooms * page, seed=8)
    polling, most_polling, polled_calls = 0, 0, 0
    real_poll, real_write = MooncakeTransport._poll_until_finished, MooncakeTransport._write_polled

    async def counted_poll(self: MooncakeTransport, mine: object) -> None:
        nonlocal polling, most_polling
        polling += 1
        most_polling = max(most_polling, polling)
        try:
            await real_poll(self, mine)  # type: ignore[arg-type]
        finally:
            polling -= 1

    async def counted_write(self: MooncakeTransport, *args: object) -> object:
        nonlocal polled_calls
        polled_calls += 1
        return await real_write(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(MooncakeTransport, "_poll_until_finished", counted_poll)
    monkeypatch.setattr(MooncakeTransport, "_write_polled", counted_write)
    outcomes = await _concurrent_rooms(sender, receiver, src, dst, rooms, page, 1, bad)
    assert outcomes == {room: room != bad for room in range(rooms)}
    assert polled_calls == rooms
    assert most_polling == 1, f"{most_polling} tasks polled at once"


async def test_one_process_polled_calls_are_checked_in_submission_order(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 64 rooms' one-op writes of 64 KiB at once, polled from the loop: a sweep checks a peer's
    # calls only up to the first one still on the wire (each check is a GIL release), and
    # still sees every op settled.
    monkeypatch.setattr(mooncake_module, "_LOOP_POLL_S", 60.0)  # none goes to a worker
    sender, receiver = engine_pair
    rooms, page = 64, 64 << 10
    src, dst = registered_buffers(engine_pair, rooms * page, seed=11)
    recorder = PollRecorder(sender._engine)
    sender._engine = recorder
    outcomes = await _concurrent_rooms(sender, receiver, src, dst, rooms, page, 1, bad=-1)
    assert outcomes == {room: True for room in range(rooms)}
    assert recorder.unsettled == {receiver.session_id: []}, "an op was never seen settled"
    assert recorder.checks >= rooms
    assert recorder.checks_behind_an_unsettled_op == 0, (
        f"{recorder.checks_behind_an_unsettled_op} of {recorder.checks} checks asked about an "
        "op queued behind one still on the wire"
    )


async def test_one_process_small_writes_past_the_polled_ops_cap_go_to_worker_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With a window of 8 ops, 64 one-op writes at once: no more than 8 are ever polled from
    # the loop, the rest go to worker jobs, and every byte lands.
    config = MooncakeConfig(host="127.0.0.1", protocol="tcp", max_outstanding_ops=8)
    monkeypatch.setattr(mooncake_module, "_LOOP_POLL_S", 60.0)
    most_polled, jobs = 0, 0
    real_poll, real_settle = MooncakeTransport._poll_until_finished, MooncakeTransport._settle

    async def watched_poll(self: MooncakeTransport, mine: object) -> None:
        nonlocal most_polled
        most_polled = max(most_polled, self._polled_ops)
        await real_poll(self, mine)  # type: ignore[arg-type]

    async def counted_settle(self: MooncakeTransport, job: mooncake_module._WriteJob) -> object:
        nonlocal jobs, most_polled
        jobs += 1
        most_polled = max(most_polled, self._polled_ops)
        return await real_settle(self, job)

    monkeypatch.setattr(MooncakeTransport, "_poll_until_finished", watched_poll)
    monkeypatch.setattr(MooncakeTransport, "_settle", counted_settle)
    async with MooncakeTransport.open(config) as sender, MooncakeTransport.open(config) as receiver:
        rooms, page = 64, 4096
        src, dst = registered_buffers((sender, receiver), rooms * page, seed=9)
        outcomes = await _concurrent_rooms(sender, receiver, src, dst, rooms, page, 1, bad=-1)
    assert outcomes == {room: True for room in range(rooms)}
    assert 0 < most_polled <= 8, f"{most_polled} ops polled from the loop at once"
    assert jobs > 0, "no write went to a worker job past the cap"


async def test_one_process_concurrent_writes_of_many_ops_share_worker_jobs_and_fail_alone(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    # 64 rooms' writes of 16 ops each (more than a polled call takes) at once through 2
    # workers: they are coalesced into far fewer jobs (counted, not timed), every byte lands,
    # and the one bad call fails without the others.
    sender, receiver = engine_pair
    rooms, page, bad = 64, 4096, 17
    src, dst = registered_buffers(engine_pair, rooms * page, seed=8)
    jobs: list[int] = []
    real = MooncakeTransport._settle

    async def counted(self: MooncakeTransport, job: mooncake_module._WriteJob) -> object:
        jobs.append(len(job.calls))
        return await real(self, job)

    monkeypatch.setattr(MooncakeTransport, "_settle", counted)
    outcomes = await _concurrent_rooms(sender, receiver, src, dst, rooms, page, 16, bad)
    assert outcomes == {room: room != bad for room in range(rooms)}
    assert sum(jobs) == rooms
    assert len(jobs) < rooms // 4, f"{len(jobs)} worker jobs for {rooms} concurrent writes"


async def test_two_processes_rotation_cuts_an_accepted_write_and_serves_through_the_new_engine(
) -> None:
    """Fence by engine rotation: two engines in one process with the same memory registered in
    both; destroying the old one (retire) cuts a paused writer's accepted request, so nothing
    more of it lands after SIGCONT (the writer is told it failed), while the new engine, in the
    same process and over the same memory, takes new writes."""
    size = 256 << 20
    async with write_target(size) as target:
        receiving, writer, memory, addr = target
        assert receiving.can_rotate and not receiving.fence_is_real
        old = receiving.session_id
        await pause_mid_write(target, old, size)
        new = await receiving.rotate()
        assert new != old and receiving.session_id == new
        assert receiving.retiring_sessions == (old,)
        with anyio.fail_after(30):
            await receiving.retire(old)
        assert receiving.retiring_sessions == ()
        at_retire = landed_bytes(memory)
        assert 0 < at_retire < size, "the write finished before the writer could be paused"
        writer.process.send_signal(signal.SIGCONT)
        result = await writer.read_reply()
        assert result["ok"] is False, result
        await anyio.sleep(0.3)  # anything the writer still pushes has had time to land
        late = landed_bytes(memory) - at_retire
        assert late == 0, f"{late} bytes of the cut write landed after retire"
        # The same memory, registered in the new engine: a new write lands through it.
        ctypes.memset(addr, 0, size)
        through_new = await writer.command(f"write {new} {addr} 4096")
        assert through_new["ok"] is True, through_new
        assert landed_bytes(memory) == 4096
        through_old = await writer.command(f"write {old} {addr + 8192} 4096")
        assert through_old["ok"] is False, through_old
        assert landed_bytes(memory) == 4096
        with pytest.raises(TransportError, match="not an earlier session"):
            await receiving.retire(old)
        print(f"cut write: {at_retire} of {size} bytes landed before retire, {late} after")


async def test_one_process_two_engines_share_the_same_registered_memory(
    engine_pair: tuple[MooncakeTransport, MooncakeTransport],
) -> None:
    # Before the old engine is retired, writes through either engine land in the one buffer.
    sender, receiver = engine_pair
    page = 4096
    src, dst = registered_buffers(engine_pair, 4 * page, seed=10)
    old = receiver.session_id
    new = await receiver.rotate()
    first = await sender.batch_write(old, [Op(src.addr, dst.addr, page)])
    second = await sender.batch_write(new, [Op(src.addr + page, dst.addr + page, page)])
    assert first.ok and second.ok, (first.error, second.error)
    assert dst.sha256(0, 2 * page) == src.sha256(0, 2 * page)
    await receiver.retire(old)
    refused = await sender.batch_write(old, [Op(src.addr, dst.addr + 2 * page, page)])
    assert not refused.ok
    third = await sender.batch_write(new, [Op(src.addr + 3 * page, dst.addr + 3 * page, page)])
    assert third.ok, third.error
    assert dst.sha256(3 * page, page) == src.sha256(3 * page, page)
    assert dst.sha256(2 * page, page) != src.sha256(0, page)
