"""Authenticated control frames: an HMAC-SHA256 over every frame when the cluster token is set.

Without a MAC, anyone who can reach a control port and read the registry can speak as any
peer. With the token set (``PDFLOW_BOOTSTRAP_TOKEN``), :class:`AuthenticatedCodec` wraps the
node's codec and appends one frame to what it sends (the message's frame comes first)::

    1  auth: sent_at_ms (8, big-endian) | sequence (8) | tag (32) | sender identity (UTF-8)

The tag is HMAC-SHA256 under a key derived from the token (:func:`control_key`; never the token
itself) over a domain string, sent_at_ms, the sequence, the length of every part, the sender
identity, and the codec's frames (one: header, message id and message bytes). The sender identity is
the ``address|incarnation|rank`` of the peer the message says sent it (the decode of a
RoomMetadata, the prefill of a StatusReport, ...), and the receiver checks it against the
decoded message. A frame is dropped and counted when the auth
frame is missing or short (``unauthenticated``), the tag does not verify (``bad_mac``, checked
before anything is decoded), it was sent more than ``window_s`` from the receiver's clock
(``stale``), its sequence is not above the last one this sender sent this recipient
(``replayed``) or the message names another sender (``sender_mismatch``). Time is wall-clock
time read here, in the shell: nodes need clocks within ``window_s`` of each other (NTP).

Replays are refused by sequence, not by remembering tags: a node's codec numbers every frame it
sends from one counter (started at the wall clock's microsecond, so a process that comes back
under the same identity numbers above its earlier life), and a sender's frames to one recipient
travel one ZMQ connection, in order. So the receiver keeps one number per (sender, recipient)
pair and refuses a frame whose sequence is not above it. A bounded set of seen tags was
outrun under load: at 10,000 frames a second it forgot a tag after 13 s, inside the window, and
the replay passed. Pairs silent for twice the window are forgotten (any frame of theirs is
stale by then).

The token is shared by every node of the cluster: a MAC proves a frame came from a token
holder, at that time, naming that sender; it does not tell token holders apart.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import struct
import time
from collections import OrderedDict
from collections.abc import Callable

from pdflow.core.protocol.messages import (
    Abort,
    AbortAck,
    BootstrapRequest,
    KvArgs,
    KvArgsAccepted,
    PeerId,
    RoomMetadata,
    StatusReport,
)
from pdflow.io.codec import ControlMessage, FrameError, WireCodec

DEFAULT_WINDOW_S = 30.0
AUTH_REASONS = ("unauthenticated", "bad_mac", "stale", "replayed", "sender_mismatch")

_KEY_DOMAIN = b"pdflow control-plane frame key v1"
_MAC_DOMAIN = b"pdflow control frame v1\0"
_HEAD = struct.Struct(">QQ")
_TAG_BYTES = 32
_AUTH_MIN = _HEAD.size + _TAG_BYTES
# (sender, recipient) pairs whose last sequence is kept; past this the longest silent goes
# first (only token holders make pairs, so this bounds a misbehaving member, not the world).
_PAIR_CAPACITY = 1 << 16


def control_key(token: str) -> bytes:
    """The MAC key: derived from the token, so a frame tag never exposes the HTTP secret."""
    return hmac.new(token.encode(), _KEY_DOMAIN, hashlib.sha256).digest()


def ends_of(message: ControlMessage) -> tuple[PeerId, PeerId]:
    """The peer a message says sent it, and the peer it is addressed to."""
    if isinstance(message, RoomMetadata | BootstrapRequest | Abort | KvArgs):
        return message.decode, message.prefill
    if isinstance(message, StatusReport | AbortAck | KvArgsAccepted):
        return message.prefill, message.decode
    raise TypeError(f"no sender field known for {type(message).__name__}")


def identity(peer: PeerId) -> bytes:
    return f"{peer.address}|{peer.incarnation}|{peer.rank}".encode()


class AuthenticatedCodec:
    """Wraps a codec: MAC on encode, verify-then-decode on decode (see the module docstring)."""

    def __init__(
        self,
        inner: WireCodec,
        key: bytes,
        *,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"the freshness window must be positive seconds, got {window_s}")
        self.inner = inner
        self.max_message_bytes = inner.max_message_bytes
        # The MAC frame (48 bytes and the sender's identity) is far below any usable limit.
        self.max_inbound_frame_bytes = inner.max_inbound_frame_bytes
        self.window_s = window_s
        self._keyed = hmac.new(key, _MAC_DOMAIN, hashlib.sha256)
        self._clock = clock
        self._sequence = itertools.count(int(clock() * 1_000_000))
        # (sender identity, recipient identity) -> (last sequence, when it came), the longest
        # silent first.
        self._last: OrderedDict[tuple[bytes, bytes], tuple[int, float]] = OrderedDict()

    def _tag(self, head: bytes, sender: bytes, frames: list[bytes]) -> bytes:
        parts = (sender, *frames)
        mac = self._keyed.copy()
        # Every part's length first, so no two different frame lists hash the same bytes. One
        # joined update: a copy of the message bytes costs less than an update call per part.
        mac.update(b"".join((head, struct.pack(f">{len(parts)}Q", *map(len, parts)), *parts)))
        return mac.digest()

    def encode(self, message: ControlMessage, msg_id: str | None) -> list[bytes]:
        frames = self.inner.encode(message, msg_id)
        sender = identity(ends_of(message)[0])
        head = _HEAD.pack(int(self._clock() * 1000), next(self._sequence))
        return [*frames, head + self._tag(head, sender, frames) + sender]

    def decode(self, frames: list[bytes]) -> tuple[ControlMessage, str | None]:
        if len(frames) < 2 or len(frames[-1]) < _AUTH_MIN:
            raise FrameError("unauthenticated", "no MAC frame: the cluster token is set here; "
                                                "set PDFLOW_BOOTSTRAP_TOKEN on every node")
        *body, auth = frames
        size = sum(map(len, body))
        if size > self.inner.max_message_bytes:
            # Before the MAC: hashing a forged 8 MiB body costs the loop milliseconds.
            raise FrameError("oversized", f"{size} bytes, limit {self.inner.max_message_bytes}")
        head, tag, sender = auth[: _HEAD.size], auth[_HEAD.size : _AUTH_MIN], auth[_AUTH_MIN:]
        if not hmac.compare_digest(tag, self._tag(head, sender, body)):
            raise FrameError("bad_mac", "the MAC does not verify: another token, or a forgery")
        now = self._clock()
        sent_at_ms, sequence = _HEAD.unpack(head)
        if abs(now - sent_at_ms / 1000) > self.window_s:
            raise FrameError("stale", f"sent {now - sent_at_ms / 1000:.1f}s from this node's "
                                      f"clock, window {self.window_s:g}s: check NTP")
        message, msg_id = self.inner.decode(body)
        named_sender, recipient = ends_of(message)
        if identity(named_sender) != sender:
            raise FrameError("sender_mismatch", "the message names another sender than its MAC")
        self._in_order(sender, identity(recipient), sequence, now)
        return message, msg_id

    def _in_order(self, sender: bytes, recipient: bytes, sequence: int, now: float) -> None:
        last = self._last
        while last:  # forget pairs silent for twice the window: their frames are stale now
            oldest, (_, heard_at) = next(iter(last.items()))
            if now - heard_at < 2 * self.window_s and len(last) < _PAIR_CAPACITY:
                break
            del last[oldest]
        pair = (sender, recipient)
        known = last.get(pair)
        if known is not None and sequence <= known[0]:
            raise FrameError("replayed", f"sequence {sequence} is not above the {known[0]} "
                                         "already received from this sender")  # fmt: skip
        last[pair] = (sequence, now)
        last.move_to_end(pair)


def authenticated(codec: WireCodec, token: str | None, window_s: float) -> WireCodec:
    """The codec a node uses: wrapped when the cluster token is set, else untouched (no cost)."""
    if token is None:
        return codec
    return AuthenticatedCodec(codec, control_key(token), window_s=window_s)
