"""The ZMQ control channel on loopback: delivery, bad frames dropped and counted, send limits."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import anyio
import anyio.lowlevel
import anyio.to_thread
import pytest
import zmq
import zmq.asyncio

from pdflow.core.protocol.messages import Abort, PeerId, RoomMetadata
from pdflow.io.codec import MAGIC, ControlMessage, MsgpackCodec, wire_frames
from pdflow.io.control import RECEIVE_HWM, YIELD_EVERY, ControlChannel, Deliver, PushSocket
from tests.ports import free_port

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

DECODE = PeerId("127.0.0.1:5001", "d", 0)
PREFILL = PeerId("127.0.0.1:6001", "p", 0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"




class Receiving:
    """A receiving channel serving ``deliver``, a sending channel and a raw PUSH at it."""

    def __init__(self, receiver: ControlChannel, sender: ControlChannel,
                 raw: zmq.asyncio.Socket, drops: Counter[str]) -> None:  # fmt: skip
        self.receiver, self.sender, self.raw, self.drops = receiver, sender, raw, drops

    async def send(self, room: int, msg_id: str | None = None) -> None:
        await self.sender.send(self.receiver.address, Abort(room, 0, DECODE, PREFILL), msg_id)


@asynccontextmanager
async def receiving(codec: MsgpackCodec, deliver: Deliver,
                    done: anyio.Event) -> AsyncIterator[Receiving]:  # fmt: skip
    """Serve until the body returns and ``done`` is set (at most 5 s), then release it all."""
    context = zmq.asyncio.Context()
    drops: Counter[str] = Counter()
    receiver = ControlChannel.open(context, codec, on_drop=lambda reason: drops.update([reason]))
    sender = ControlChannel.open(context, MsgpackCodec())
    raw = context.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{receiver.address}")
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(receiver.receive_forever, deliver)
            yield Receiving(receiver, sender, raw, drops)
            with anyio.fail_after(5):
                await done.wait()
            tasks.cancel_scope.cancel()
    finally:
        raw.close(linger=0)
        sender.close()
        receiver.close()
        context.term()


@asynccontextmanager
async def queued_burst(
    burst: int, receiver_setup: Callable[[ControlChannel], None] = lambda _: None
) -> AsyncIterator[tuple[ControlChannel, zmq.asyncio.Socket, MsgpackCodec]]:
    """A receiving channel (not yet served) with ``burst`` frames already queued at its PULL,
    the raw PUSH that sent them and its codec; everything released on exit."""
    context = zmq.asyncio.Context()
    receiver = ControlChannel.open(context, MsgpackCodec())
    receiver_setup(receiver)
    raw = context.socket(zmq.PUSH)
    raw.connect(f"tcp://{receiver.address}")
    codec = MsgpackCodec()
    try:
        for room in range(burst):  # all queued at the receiver before it starts receiving
            await raw.send_multipart(codec.encode(Abort(room, 0, DECODE, PREFILL), None))
        await anyio.sleep(0.5)
        yield receiver, raw, codec
    finally:
        raw.close(linger=0)
        receiver.close()
        context.term()


async def test_messages_arrive_in_order_and_bad_frames_are_counted() -> None:
    received: list[tuple[ControlMessage, str | None]] = []
    done = anyio.Event()

    async def deliver(message: ControlMessage, msg_id: str | None) -> None:
        received.append((message, msg_id))
        if len(received) == 3:
            done.set()

    async with receiving(MsgpackCodec(max_message_bytes=4096), deliver, done) as channels:
        await channels.send(1, "a:0:0")
        for frames in (
            [b"garbage"],
            wire_frames(b"\x80", version=2),
            wire_frames(b"\xc1"),
            [MAGIC, b"1", b"x" * 3000, b"x" * 3000],  # each frame under the limit, not all
        ):
            await channels.raw.send_multipart(frames)
        await channels.send(2)
        await channels.send(3)
    assert [m.room for m, _ in received] == [1, 2, 3]  # type: ignore[union-attr]
    assert received[0][1] == "a:0:0"
    assert channels.drops == Counter(malformed=1, bad_version=1, undecodable=1, oversized=1)
    assert channels.receiver.dropped == 4


async def test_a_send_that_cannot_be_queued_times_out_and_is_counted() -> None:
    context = zmq.asyncio.Context()
    failed: list[str] = []
    sender = ControlChannel.open(context, MsgpackCodec(), send_timeout_s=0.2, send_hwm=1,
                                 on_send_failed=failed.append)  # fmt: skip
    nobody = f"127.0.0.1:{free_port()}"
    try:
        results = [await sender.send(nobody, Abort(n, 0, DECODE, PREFILL), None) for n in range(4)]
        assert results[0] is True
        assert False in results
        assert failed and set(failed) == {nobody}
        assert sender.peers == (nobody,)
        sender.forget(nobody)
        assert not sender.peers
    finally:
        sender.close()
        context.term()


def test_binding_a_taken_port_says_so() -> None:
    context = zmq.asyncio.Context()
    first = ControlChannel.open(context, MsgpackCodec())
    port = int(first.address.rsplit(":", 1)[1])
    try:
        with pytest.raises(OSError, match="cannot bind the control socket"):
            ControlChannel.open(context, MsgpackCodec(), port=port)
    finally:
        first.close()
        context.term()


class _BrokenCodec(MsgpackCodec):
    """A codec with a bug: it raises something other than FrameError for one frame."""

    def decode(self, frames: list[bytes]) -> tuple[ControlMessage, str | None]:
        if frames == [b"boom"]:
            raise KeyError("a codec bug")
        return super().decode(frames)


async def test_no_codec_or_handler_failure_ends_the_receive_loop() -> None:
    received: list[int] = []
    done = anyio.Event()

    async def deliver(message: ControlMessage, msg_id: str | None) -> None:
        assert isinstance(message, Abort)
        if message.room == 1:
            raise RuntimeError("a handler bug")
        received.append(message.room)
        done.set()

    async with receiving(_BrokenCodec(), deliver, done) as channels:
        await channels.raw.send_multipart([b"boom"])
        await channels.send(1)
        await channels.send(2)
    assert received == [2]
    assert channels.drops == Counter(codec_error=1, handler_error=1)


async def test_a_send_that_cannot_be_attempted_is_refused_counted_and_leaks_no_socket() -> None:
    context = zmq.asyncio.Context()
    refused: Counter[str] = Counter()
    sender = ControlChannel.open(context, MsgpackCodec(max_message_bytes=256),
                                 on_refused=lambda reason: refused.update([reason]))  # fmt: skip
    big = Abort(1, 0, DECODE, PREFILL, reason="x" * 1000)
    try:
        assert not await sender.send("127.0.0.1:notaport", Abort(1, 0, DECODE, PREFILL), None)
        assert not await sender.send("ipc:///tmp/pdflow-x", Abort(1, 0, DECODE, PREFILL), None)
        assert not await sender.send(f"127.0.0.1:{free_port()}", big, None)
        assert sender.peers == ()
    finally:
        sender.close()
    with anyio.fail_after(5):  # term() waits for every socket: a leaked one hangs it
        await anyio.to_thread.run_sync(context.term)
    assert refused == Counter(connect_failed=1, bad_address=1, oversized=1)


async def test_a_send_that_finds_zmqs_socket_cap_reached_is_refused_and_counted() -> None:
    """ZMQ frees a closed socket's slot only later, in its reaper thread, so a burst of new
    peers can reach the context's cap although the pool closed a socket for each; the send is
    refused (the step that sent it carries out its other outputs), not raised."""
    context = zmq.asyncio.Context()
    context.set(zmq.MAX_SOCKETS, 2)  # the channel's PULL and one PUSH
    refused: Counter[str] = Counter()
    sender = ControlChannel.open(context, MsgpackCodec(),
                                 on_refused=lambda reason: refused.update([reason]))  # fmt: skip
    first, second = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    try:
        assert await sender.send(first, Abort(1, 0, DECODE, PREFILL), None)
        assert not await sender.send(second, Abort(2, 0, DECODE, PREFILL), None)
        assert sender.peers == (first,)
    finally:
        sender.close()
    with anyio.fail_after(5):
        await anyio.to_thread.run_sync(context.term)
    assert refused == Counter(connect_failed=1)


async def test_a_burst_of_queued_frames_lets_other_tasks_run_between_its_frames() -> None:
    """Frames already queued are received and handled without yielding (the endpoint lock is
    taken without a checkpoint), so the loop itself must yield every YIELD_EVERY frames: a
    timer or another channel's task must not wait for the whole burst."""
    burst = 20 * YIELD_EVERY
    handled: list[int] = []
    done = anyio.Event()
    ticks_during_burst: list[int] = []
    ticks = 0

    async def deliver(message: ControlMessage, msg_id: str | None) -> None:
        handled.append(message.room)  # type: ignore[union-attr]
        if len(handled) == 1:
            ticks_during_burst.append(ticks)
        if len(handled) == burst:
            ticks_during_burst.append(ticks)
            done.set()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await anyio.lowlevel.checkpoint()

    async with queued_burst(burst) as (receiver, _raw, _codec):
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(receiver.receive_forever, deliver)
                tasks.start_soon(ticker)
                await done.wait()
                tasks.cancel_scope.cancel()
    assert handled == list(range(burst))
    first, last = ticks_during_burst
    assert last - first >= burst // YIELD_EVERY - 2, f"the ticker ran {last - first} times"


async def test_queued_frames_are_taken_without_an_awaited_receive_each() -> None:
    """A frame already at the PULL is taken through its synchronous shadow: pyzmq's awaited
    receive (a Future, a reader and its callback per frame) is used only to wait for one."""
    burst = 4 * YIELD_EVERY
    handled: list[int] = []
    done = anyio.Event()

    async def deliver(message: ControlMessage, msg_id: str | None) -> None:
        handled.append(message.room)  # type: ignore[union-attr]
        if len(handled) == burst + 1:
            done.set()

    awaited = 0

    def count_awaited_receives(receiver: ControlChannel) -> None:
        awaited_receive = receiver._pull.recv_multipart

        def counting_receive() -> Awaitable[list[bytes]]:
            nonlocal awaited
            awaited += 1
            return awaited_receive()

        receiver._pull.recv_multipart = counting_receive  # type: ignore[method-assign,assignment]

    async with queued_burst(burst, count_awaited_receives) as (receiver, raw, codec):
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(receiver.receive_forever, deliver)
                while len(handled) < burst:
                    await anyio.sleep(0.01)
                # The queue is empty now: the next frame is waited for, and still arrives.
                await raw.send_multipart(codec.encode(Abort(burst, 0, DECODE, PREFILL), None))
                await done.wait()
                tasks.cancel_scope.cancel()
    assert handled == list(range(burst + 1))
    assert awaited <= 2, f"{awaited} awaited receives for {burst + 1} frames"


async def test_a_message_is_not_queued_at_once_while_an_earlier_one_waits_for_room() -> None:
    """The synchronous shadow queues a message at once only while no earlier send to that peer
    waits for room (SNDHWM): otherwise the later message would overtake it."""
    context = zmq.asyncio.Context()
    pull = context.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    push = PushSocket(sock)
    frames = MsgpackCodec().encode(Abort(1, 0, DECODE, PREFILL), None)
    try:
        push.waiting = 1  # an earlier message of this peer waits for room
        assert not push.queue_now(frames)
        push.waiting = 0
        assert push.queue_now(frames)
        with anyio.fail_after(5):
            assert await pull.recv_multipart() == frames
        assert not await pull.poll(200)  # the refused one was never queued
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        context.term()


async def test_a_cancelled_receive_loop_leaves_no_reader_behind() -> None:
    """The loop waits on the PULL's ZMQ_FD through its own reader; once it stops, the event loop
    must not keep that descriptor (closed with the socket, its number is reused)."""
    context = zmq.asyncio.Context()
    receiver = ControlChannel.open(context, MsgpackCodec())
    fd = int(receiver._pull.getsockopt(zmq.FD))
    loop = asyncio.get_running_loop()

    async def deliver(message: ControlMessage, msg_id: str | None) -> None:
        pass

    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(receiver.receive_forever, deliver)
            await anyio.sleep(0.1)
            assert loop.remove_reader(fd) is True  # it was waiting there; taken away here
            loop.add_reader(fd, lambda: None)  # (put one back for the loop to remove)
            tasks.cancel_scope.cancel()
        assert loop.remove_reader(fd) is False
    finally:
        receiver.close()
        context.term()


def counting_sender(
    context: zmq.asyncio.Context,
) -> tuple[ControlChannel, list[str], list[str]]:
    """A channel with a one-message queue per peer and a 0.2 s send timeout, and the lists its
    refusals and timed-out sends are counted in."""
    refused: list[str] = []
    failed: list[str] = []
    sender = ControlChannel.open(context, MsgpackCodec(), send_timeout_s=0.2, send_hwm=1,
                                 on_refused=refused.append,
                                 on_send_failed=failed.append)  # fmt: skip
    return sender, refused, failed


async def test_send_soon_answers_at_once_and_hands_back_only_a_wait_for_room() -> None:
    """A node's step sends through ``send_soon``: a message queued (or refused) at once is
    answered with a bool and no coroutine; only a full queue hands back what to await, and
    while that send waits, a later one waits behind it (never queued ahead of it)."""
    context = zmq.asyncio.Context()
    sender, refused, failed = counting_sender(context)
    nobody = f"127.0.0.1:{free_port()}"
    try:
        assert sender.send_soon(nobody, Abort(1, 0, DECODE, PREFILL), None) is True
        assert sender.send_soon("no-port-here", Abort(1, 0, DECODE, PREFILL), None) is False
        assert refused == ["connect_failed"]
        waits = []
        for room in range(2, 8):
            sent = sender.send_soon(nobody, Abort(room, 0, DECODE, PREFILL), None)
            if not isinstance(sent, bool):
                waits.append(sent)
                break
        assert waits, "a full queue never handed back a wait"
        assert await waits[0] is False  # nobody reads: the bounded wait runs out, counted
        assert failed == [nobody]
    finally:
        sender.close()
        context.term()


async def test_a_peer_that_reads_nothing_holds_the_sender_for_one_timeout_not_one_per_message(
) -> None:
    """Each wait for room holds the sending rank's step (and every engine call of the rank):
    after one timeout, sends to a peer still not reading are refused at once until it reads."""
    context = zmq.asyncio.Context()
    sender, refused, failed = counting_sender(context)
    port = free_port()
    peer = f"127.0.0.1:{port}"
    pull = None
    try:
        results = [await sender.send(peer, Abort(n, 0, DECODE, PREFILL), None) for n in range(8)]
        assert results[0] is True and not any(results[1:])
        assert failed == [peer], "one timed-out wait, then refusals without waiting"
        assert refused == ["peer_stalled"] * (len(results) - 2)
        pull = context.socket(zmq.PULL)
        pull.bind(f"tcp://{peer}")  # the peer comes back and reads
        with anyio.fail_after(5):
            await pull.recv_multipart()  # the one message queued before the stall
            while not await sender.send(peer, Abort(99, 0, DECODE, PREFILL), None):
                await anyio.sleep(0.05)
            assert (await pull.recv_multipart())[-1]  # delivered: the stall is lifted
    finally:
        sender.close()
        if pull is not None:
            pull.close(linger=0)
        context.term()


async def test_zmq_cuts_a_frame_over_the_inbound_limit_before_buffering_it() -> None:
    """A frame at the codec's limit is read (and judged by pdflow); one byte more and ZMQ drops
    the connection as the frame's header arrives, so nothing of it is ever buffered."""
    codec = MsgpackCodec(max_message_bytes=4096)
    done = anyio.Event()

    async def deliver(message: ControlMessage, msg_id: str | None) -> None:
        pass

    async with receiving(codec, deliver, done) as channels:
        monitor = channels.receiver._pull.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            await channels.raw.send_multipart([b"x" * 4096])
            with anyio.fail_after(5):
                while channels.drops != Counter(malformed=1):  # read: at the limit
                    await anyio.sleep(0.01)
            await channels.raw.send_multipart([b"x" * 4097])
            with anyio.fail_after(5):
                event = await monitor.recv_multipart()
            assert int.from_bytes(event[0][:2], "little") == zmq.EVENT_DISCONNECTED
            assert channels.drops == Counter(malformed=1)  # never read, so never counted here
        finally:
            channels.receiver._pull.disable_monitor()
            monitor.close(linger=0)
        done.set()


async def test_a_connection_nobody_reads_queues_few_messages_and_loses_none() -> None:
    """While the receive loop is held up, ZMQ keeps at most RECEIVE_HWM messages of one
    connection (then the sender's own queue fills): 1 MiB frames here, so the receiver holds
    about RECEIVE_HWM MiB, not the 1,000 of ZMQ's default. Nothing is lost: once the loop
    serves again, every message the sender queued arrives."""
    codec = MsgpackCodec()
    pages = tuple(range(1 << 16, (1 << 16) + 209_000))  # 5 bytes each: just under 1 MiB
    frames = codec.encode(RoomMetadata(1, 0, DECODE, PREFILL, "s", pages, None, 1), None)
    assert len(frames[0]) > codec.max_message_bytes - (16 << 10)
    context = zmq.asyncio.Context()
    receiver = ControlChannel.open(context, codec)
    raw = zmq.Context()
    push = raw.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 1)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://{receiver.address}")
    queued = 0
    delivered = 0
    try:
        with anyio.move_on_after(4):  # (ZMQ's default queue would still be filling)
            refused_since = anyio.current_time()
            while anyio.current_time() - refused_since < 0.5:
                try:
                    push.send_multipart(frames, zmq.NOBLOCK)
                except zmq.Again:
                    await anyio.sleep(0.01)
                else:
                    queued += 1
                    refused_since = anyio.current_time()
        # Beyond the receiver's queue: the sender's one message, the one being read, and what
        # the kernel's socket buffers hold (about 10 MiB on loopback here).
        assert queued <= 2 * RECEIVE_HWM, f"{queued} messages of 1 MiB queued"
        done = anyio.Event()

        async def deliver(message: ControlMessage, msg_id: str | None) -> None:
            nonlocal delivered
            delivered += 1
            if delivered == queued:
                done.set()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(receiver.receive_forever, deliver)
            with anyio.fail_after(10):
                await done.wait()
            tasks.cancel_scope.cancel()
        assert receiver.dropped == 0
    finally:
        push.close(linger=0)
        raw.term()
        receiver.close()
        context.term()
