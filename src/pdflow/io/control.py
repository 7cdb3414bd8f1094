"""The ZMQ control channel of one endpoint: a PULL socket it binds, a cached PUSH per peer.

The PUSH sockets live in a :class:`~pdflow.io.limits.SocketPool` the node's channels share, so
their number is bounded per node: past the pool's limit the least recently used is closed.

Sending never blocks an endpoint for long: each PUSH has a bounded queue (SNDHWM) and a send
that cannot be queued within ``send_timeout_s`` is abandoned and counted; the core's timers cover
a lost message. A send the channel cannot even attempt (an address that is not ``host:port``
or ``tcp://``, a connect ZMQ refuses, a message over the codec's limit) is refused, counted by
reason and returns False; it never raises. Receiving decodes every frame list; one that is not
a valid message is counted by reason, logged and dropped, and the loop keeps serving.

What ZMQ buffers for one connection before pdflow reads it is bounded in ZMQ itself: a frame
over the codec's inbound limit (``max_inbound_frame_bytes``) is refused as its header arrives
(MAXMSGSIZE: ZMQ disconnects that sender, nothing is buffered or counted here; a pdflow sender
refuses such a message itself), and at most RECEIVE_HWM messages wait per connection. A message
of several frames, each under the limit, is dropped as ``oversized`` once read; ZMQ counts
messages, not frames, so such a message is held whole until then (docs/operations.md).

Requires anyio's asyncio backend (``zmq.asyncio``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import structlog
import zmq
import zmq.asyncio

from pdflow.io.codec import ControlMessage, FrameError, WireCodec
from pdflow.io.limits import SocketPool

DEFAULT_MAX_SOCKETS = 512
YIELD_EVERY = 32
"""Frames handled back to back before the receive loop yields to the event loop."""

RECEIVE_HWM = 32
"""Messages ZMQ queues per connection while the receive loop is held up (RCVHWM); past it, it
stops reading that connection and the sender's own queue (SNDHWM) fills instead. With frames of
at most ``max_inbound_frame_bytes`` this bounds what a connection holds: 32 MiB at a prefill
(1 MiB frames), 2 MiB at a decode (64 KiB). It is at least YIELD_EVERY, so a burst the loop
takes without yielding is already queued."""

log = structlog.get_logger("pdflow.control")

Deliver = Callable[[ControlMessage, str | None], Awaitable[None]]


SEND_REFUSALS = ("bad_address", "connect_failed", "oversized", "peer_stalled", "send_error")


class SendRefused(Exception):
    """A send the channel could not attempt; ``reason`` is one of SEND_REFUSALS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def zmq_url(address: str) -> str:
    """``host:port`` (SGLang's form, and PeerId.address) as a ZMQ TCP endpoint.

    Peers name these addresses, so only TCP is accepted: never ipc:// or inproc://."""
    if "://" not in address:
        return f"tcp://{address}"
    if address.startswith("tcp://"):
        return address
    raise SendRefused("bad_address", f"{address!r} is not host:port or tcp://host:port")


class PushSocket:
    """One peer's PUSH: the asyncio socket, for the bounded wait while the peer's queue is
    full, and its synchronous shadow, which queues a message at once without pyzmq's Future."""

    __slots__ = ("_now", "sock", "stalled", "waiting")

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock
        self._now: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)  # sock owns it
        self.waiting = 0
        """Sends waiting for room: while one is, later messages wait behind it, in order."""
        self.stalled = False
        """A send to this peer timed out and its queue has not taken a message since: the
        peer reads nothing, and a full queue refuses at once instead of waiting again (each
        wait holds the sending rank's step, and so every engine call of that rank)."""

    def queue_now(self, frames: list[bytes]) -> bool:
        """Queue the message now if nothing waits before it and the queue has room (SNDHWM);
        False when it was not queued. A ZMQError other than Again is raised."""
        if self.waiting:
            return False
        try:
            self._now.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        self.stalled = False
        return True

    def close(self, linger: int | None = None) -> None:
        self.sock.close(linger=linger)


def _holds_a_message(pull: zmq.Socket[bytes]) -> bool:
    """Whether a whole message waits at this PULL (ZMQ's POLLIN on a PULL)."""
    events = pull.get(zmq.EVENTS)
    return isinstance(events, int) and bool(events & zmq.POLLIN)


class ControlChannel:
    """Bind with :meth:`open`; serve with :meth:`receive_forever`; release with :meth:`close`."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        codec: WireCodec,
        pull: zmq.asyncio.Socket,
        address: str,
        pool: SocketPool[PushSocket],
        *,
        send_timeout_s: float,
        send_hwm: int,
        on_drop: Callable[[str], None],
        on_send_failed: Callable[[str], None],
        on_refused: Callable[[str], None],
    ) -> None:
        self.codec = codec
        self.address = address
        self._context = context
        self._pull = pull
        self._pool = pool
        self._send_timeout_s = send_timeout_s
        self._send_hwm = send_hwm
        self._on_drop = on_drop
        self._on_send_failed = on_send_failed
        self._on_refused = on_refused
        self.dropped = 0
        self._reader: tuple[asyncio.AbstractEventLoop, int] | None = None

    @classmethod
    def open(
        cls,
        context: zmq.asyncio.Context,
        codec: WireCodec,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        send_timeout_s: float = 1.0,
        send_hwm: int = 4096,
        on_drop: Callable[[str], None] = lambda reason: None,
        on_send_failed: Callable[[str], None] = lambda address: None,
        on_refused: Callable[[str], None] = lambda reason: None,
        pool: SocketPool[PushSocket] | None = None,
    ) -> ControlChannel:
        """Bind a PULL on ``host:port`` (0: any free port; read :attr:`address`). Without a
        shared ``pool`` the channel gets its own, of DEFAULT_MAX_SOCKETS."""
        pull = context.socket(zmq.PULL)
        pull.setsockopt(zmq.LINGER, 0)
        pull.setsockopt(zmq.MAXMSGSIZE, codec.max_inbound_frame_bytes)
        pull.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        try:
            if port:
                pull.bind(f"tcp://{host}:{port}")
            else:
                port = pull.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            pull.close(linger=0)
            raise OSError(f"cannot bind the control socket on {host}:{port}: {exc}") from exc
        pool = pool if pool is not None else SocketPool[PushSocket](DEFAULT_MAX_SOCKETS)
        return cls(context, codec, pull, f"{host}:{port}", pool, send_timeout_s=send_timeout_s,
                   send_hwm=send_hwm, on_drop=on_drop, on_send_failed=on_send_failed,
                   on_refused=on_refused)  # fmt: skip

    # ---- sending ---------------------------------------------------------------------------------
    def _socket_to(self, address: str) -> PushSocket:
        push = self._pool.get(id(self), address)
        if push is None:
            url = zmq_url(address)
            try:
                # ZMQ frees a closed socket's slot later, in its reaper thread: a burst of
                # new peers can find the context's cap (MAX_SOCKETS) reached although the
                # pool closed one for each (EMFILE). The message is then refused, not raised
                # into the step that sent it.
                sock = self._context.socket(zmq.PUSH)
            except zmq.ZMQError as exc:
                raise SendRefused("connect_failed", f"{address!r}: {exc}") from None
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, self._send_hwm)
                sock.setsockopt(zmq.SNDTIMEO, int(self._send_timeout_s * 1000))
                sock.setsockopt(zmq.RECONNECT_IVL, 100)
                sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
                sock.connect(url)
            except zmq.ZMQError as exc:
                # An unclosed socket would also make context.term() wait forever.
                sock.close(linger=0)
                raise SendRefused("connect_failed", f"{address!r}: {exc}") from None
            push = PushSocket(sock)
            self._pool.put(id(self), address, push)
        return push

    async def send(self, address: str, message: ControlMessage, msg_id: str | None) -> bool:
        """Queue one message to ``address``; False (and counted) if it could not be queued."""
        sent = self.send_soon(address, message, msg_id)
        return sent if isinstance(sent, bool) else await sent

    def send_soon(
        self, address: str, message: ControlMessage, msg_id: str | None
    ) -> bool | Awaitable[bool]:
        """:meth:`send` without a coroutine when the message is queued (True) or refused (False,
        counted) at once; only when the peer's queue is full, or a send already waits for room,
        the awaitable that waits behind it, bounded (await it before this channel's next send,
        so messages keep their order). The nodes' steps send this way: almost every message is
        queued at once, and a coroutine per message was part of each step's cost."""
        try:
            frames = self.codec.encode(message, msg_id)
        except FrameError as exc:
            return self._refused(address, message, SendRefused(exc.reason, exc.detail))
        try:
            push = self._socket_to(address)
        except SendRefused as refused:
            return self._refused(address, message, refused)
        try:
            # Almost always the peer's queue has room: queue it now, with no timer to arm (the
            # timeout scope was most of a small message's send cost) and no Future.
            if push.queue_now(frames):
                return True
        except zmq.ZMQError as exc:
            self.forget(address)
            return self._refused(
                address, message, SendRefused("send_error", f"{address!r}: {exc}")
            )
        if push.stalled:
            return self._refused(address, message, SendRefused(
                "peer_stalled", f"{address!r} read nothing since a send to it timed out"
            ))  # fmt: skip
        return self._send_waiting(address, message, push, frames)

    def _refused(self, address: str, message: ControlMessage, refused: SendRefused) -> bool:
        self._on_refused(refused.reason)
        log.warning("control_send_refused", to=address[:200], reason=refused.reason,
                    message=type(message).__name__, detail=str(refused)[:200])  # fmt: skip
        return False

    async def _send_waiting(
        self, address: str, message: ControlMessage, push: PushSocket, frames: list[bytes]
    ) -> bool:
        # The queue is full (SNDHWM), or a send waits for room already: wait behind it, bounded.
        push.waiting += 1
        try:
            with anyio.move_on_after(self._send_timeout_s):
                try:
                    await push.sock.send_multipart(frames)
                except zmq.ZMQError as exc:
                    self.forget(address)
                    return self._refused(
                        address, message, SendRefused("send_error", f"{address!r}: {exc}")
                    )
                push.stalled = False
                return True
        finally:
            push.waiting -= 1
        push.stalled = True
        self._on_send_failed(address)
        log.warning("control_send_timeout", to=address, message=type(message).__name__,
                    timeout_s=self._send_timeout_s)  # fmt: skip
        return False

    def forget(self, address: str) -> None:
        """Close the cached PUSH to a dead peer: queued messages go with it, and a new process
        at the same address gets a fresh connection."""
        push = self._pool.pop(id(self), address)
        if push is not None:
            push.close(linger=0)

    # ---- receiving -------------------------------------------------------------------------------
    async def receive_forever(self, deliver: Deliver) -> None:
        """Serve until cancelled: no frame, and no failure handling one, ends the loop.

        The PULL is read through its synchronous shadow only (NOBLOCK, each message that ZMQ
        says is queued), and the loop waits for more on the socket's ZMQ_FD, through one reader
        registered for as long as it serves. pyzmq's awaited receive costs a Future per frame
        and a reader callback of its own that reads the socket's events on every wake-up: a
        sixth of the decode loop's busy samples in the suite's 256 x 4 KiB. ZMQ_FD only says
        that the socket's state may have changed, so the queue is checked again after every
        wake-up, and before each wait once the wake-up flag is lowered (no wake-up is lost)."""
        pull: zmq.Socket[bytes] = zmq.Socket.shadow(self._pull.underlying)  # _pull owns it
        readable = asyncio.Event()
        loop = asyncio.get_running_loop()
        fd = int(self._pull.getsockopt(zmq.FD))
        loop.add_reader(fd, readable.set)
        self._reader = (loop, fd)
        received = 0
        try:
            while True:
                if self._pull.closed:
                    raise zmq.ZMQError(zmq.ENOTSOCK)  # as pyzmq's receive on a closed socket
                readable.clear()
                if not _holds_a_message(pull):
                    await readable.wait()
                    continue
                received += 1
                if received % YIELD_EVERY == 0:
                    # A queued frame is received without yielding, and a deliver need not
                    # yield either: let the timers and the other channels run between bursts.
                    await anyio.lowlevel.checkpoint()
                frames = pull.recv_multipart(zmq.NOBLOCK)
                await self._handle(frames, deliver)
        finally:
            self._stop_reading()

    def _stop_reading(self) -> None:
        # Before the socket closes: the selector must not keep its file descriptor.
        if self._reader is not None:
            loop, fd = self._reader
            self._reader = None
            loop.remove_reader(fd)

    async def _handle(self, frames: list[bytes], deliver: Deliver) -> None:
        """Decode and deliver one received frame list; a failure is counted, never raised."""
        try:
            message, msg_id = self.codec.decode(frames)
        except FrameError as exc:
            self._drop(exc.reason, exc.detail, len(frames))
            return
        except Exception as exc:  # a codec bug must not take the node down with it
            self._drop("codec_error", f"{type(exc).__name__}: {exc}", len(frames))
            return
        try:
            await deliver(message, msg_id)
        except Exception as exc:
            self._drop("handler_error", f"{type(exc).__name__}: {exc}", len(frames))
            log.exception("control_handler_failed", at=self.address,
                          message=type(message).__name__)  # fmt: skip

    def _drop(self, reason: str, detail: str, frames: int) -> None:
        self.dropped += 1
        self._on_drop(reason)
        log.warning("control_frame_dropped", at=self.address, reason=reason,
                    detail=detail[:200], frames=frames)  # fmt: skip

    def close(self) -> None:
        for address in self.peers:
            self.forget(address)
        self._stop_reading()
        self._pull.close(linger=0)

    @property
    def peers(self) -> tuple[str, ...]:
        return self._pool.addresses(id(self))
