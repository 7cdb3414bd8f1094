"""Wire codecs of the control channel: control messages <-> ZMQ frames.

A codec only translates; it never decides what a message means. The channel hands every frame
list it receives to :meth:`WireCodec.decode` and drops (and counts) whatever raises
:class:`FrameError`. pdflow's own codec is :class:`MsgpackCodec`; a codec speaking SGLang's
positional ASCII frames would implement the same two methods and map those frames onto the same
message structs, so neither the core nor the nodes change.

MsgpackCodec sends every message as ONE ZMQ frame (pyzmq gives the GIL up for each frame it sends
or receives; four frames a message were four hand-overs each way)::

    bytes 0-5  b"pdflow"          magic: not a pdflow frame (or under 9 bytes) -> "malformed"
    byte 6     protocol version  an unsigned byte; another version -> "bad_version"
    bytes 7-8  n, big-endian     the message id's length; past the frame's end -> "malformed"
    n bytes    message id        UTF-8, may be empty (it only orders merged traces)
    the rest   the message       MessagePack; undecodable or unknown type -> "undecodable"

A frame list of anything but one frame is "malformed", except the four frames pdflow sent before
(``b"pdflow"``, the version in ASCII, the message, the id), which are "bad_version": that peer
runs the earlier wire.

The message must be a map whose first key is its ``type`` tag (pdflow's encoder always writes it
first). Decoding is then typed from the first byte on, so its depth is bounded by the message
schema (at most :data:`MAX_SCHEMA_DEPTH` containers); a frame that puts another key first would
make msgspec skip that key's value untyped, which recurses as deep as the sender nests it.
The tag, read before decoding, also sets the size limit: only LARGE_MESSAGE_TYPES (and only
where ``large_inbound`` admits them) may exceed ``small_message_bytes``.
"""

from __future__ import annotations

import struct
from typing import Any, Protocol

import msgspec

from pdflow.core.protocol.messages import PROTOCOL_VERSION, AnyMessage

DEFAULT_MAX_MESSAGE_BYTES = 1 << 20
DEFAULT_SMALL_MESSAGE_BYTES = 64 << 10
LARGE_MESSAGE_TYPES = ("room_metadata", "kv_args")
"""The messages that grow with a room (its pages) or a rank (its buffers): the only ones a
prefill receives past the small limit. A decode receives none (MsgpackCodec(large_inbound=()))."""
MAGIC = b"pdflow"

ControlMessage = AnyMessage
"""Everything the control channel carries: the core's messages (the KV layout handshake
included), and nothing else."""

MAX_SCHEMA_DEPTH = 4
"""Deepest nesting of any ControlMessage (KvArgs -> state -> a component -> its addrs); tests
check it."""

DROP_REASONS = ("malformed", "oversized", "bad_version", "undecodable")

_TAG_KEY = b"\xa4type"  # the MessagePack str "type"
_HEADER = struct.Struct(">6sBH")  # magic, version, message id length
HEADER_BYTES = _HEADER.size


class FrameError(Exception):
    """A received frame list that is not a valid message; ``reason`` is one of DROP_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class WireCodec(Protocol):
    """Encode a control message into frames and back."""

    max_message_bytes: int
    max_inbound_frame_bytes: int
    """The largest single frame this codec ever accepts from a peer: the control channel has
    ZMQ refuse a larger one (MAXMSGSIZE) before buffering it."""

    def encode(self, message: ControlMessage, msg_id: str | None) -> list[bytes]: ...

    def decode(self, frames: list[bytes]) -> tuple[ControlMessage, str | None]:
        """Raise :class:`FrameError` for anything that is not one valid message."""
        ...


class MsgpackCodec:
    """pdflow's codec: one frame, a header (magic, protocol version, id) and msgspec MessagePack."""

    def __init__(
        self,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        small_message_bytes: int = DEFAULT_SMALL_MESSAGE_BYTES,
        large_inbound: tuple[str, ...] = LARGE_MESSAGE_TYPES,
        version: int = PROTOCOL_VERSION,
    ) -> None:
        if max_message_bytes < 64:
            raise ValueError(f"max_message_bytes must be at least 64, got {max_message_bytes}")
        self.max_message_bytes = max_message_bytes
        self.small_message_bytes = min(small_message_bytes, max_message_bytes)
        self.large_inbound = frozenset(large_inbound)
        self.max_inbound_frame_bytes = (
            self.max_message_bytes if self.large_inbound else self.small_message_bytes
        )
        if not 0 <= version <= 0xFF:
            raise ValueError(f"the protocol version must fit in one byte, got {version}")
        self.version = version
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(ControlMessage)

    def encode(self, message: ControlMessage, msg_id: str | None) -> list[bytes]:
        ident = (msg_id or "").encode()
        if len(ident) > 0xFFFF:
            raise FrameError("oversized", f"a message id of {len(ident)} bytes, over 65535")
        frames = wire_frames(self._encoder.encode(message), ident, version=self.version)
        frame = frames[0]
        if len(frame) > self.max_message_bytes:
            # Refuse locally: the peer would drop it anyway, and silently.
            raise FrameError(
                "oversized",
                f"{type(message).__name__} encodes to {len(frame)} bytes, over the "
                f"{self.max_message_bytes}-byte limit; raise max_message_bytes on both sides",
            )
        if len(frame) > self.small_message_bytes and (
            message.__struct_config__.tag not in LARGE_MESSAGE_TYPES
        ):
            # Every receiver refuses it (a decode's ZMQ even cuts the connection it came on).
            raise FrameError(
                "oversized",
                f"{type(message).__name__} encodes to {len(frame)} bytes; only "
                f"{list(LARGE_MESSAGE_TYPES)} may exceed {self.small_message_bytes} bytes",
            )
        return frames

    def decode(self, frames: list[bytes]) -> tuple[ControlMessage, str | None]:
        size = sum(len(frame) for frame in frames)
        if size > self.max_message_bytes:
            raise FrameError(
                "oversized", f"{size} bytes in {len(frames)} frames, limit {self.max_message_bytes}"
            )
        if len(frames) != 1:
            if len(frames) == 4 and frames[0] == MAGIC:
                raise FrameError("bad_version", "four frames: the peer runs pdflow's earlier "
                                                "wire (one frame per message since 2026-12-02)")
            raise FrameError("malformed", f"expected one frame, got {len(frames)}")
        frame = frames[0]
        if len(frame) < HEADER_BYTES or frame[:6] != MAGIC:
            raise FrameError("malformed", f"a frame not starting with {MAGIC!r} and a header")
        _, version, id_bytes = _HEADER.unpack_from(frame)
        if version != self.version:
            raise FrameError(
                "bad_version", f"protocol version {version}, this node speaks {self.version}"
            )
        start = HEADER_BYTES + id_bytes
        if start > len(frame):
            raise FrameError("malformed", f"a {id_bytes}-byte message id past the frame's end")
        tag = message_tag(frame, start)
        if size > self.small_message_bytes and tag not in self.large_inbound:
            raise FrameError(
                "oversized", f"a {tag[:40]!r} message of {size} bytes; only "
                f"{sorted(self.large_inbound)} may exceed {self.small_message_bytes} bytes here",
            )
        try:
            message = self._decoder.decode(memoryview(frame)[start:])
            msg_id = frame[HEADER_BYTES:start].decode() or None
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise FrameError("undecodable", str(exc)) from None
        return message, msg_id


def wire_frames(payload: bytes, msg_id: bytes = b"", *, version: int = PROTOCOL_VERSION,
                magic: bytes = MAGIC) -> list[bytes]:  # fmt: skip
    """The frame list MsgpackCodec would send for these MessagePack bytes: for tests and fuzzers
    that build frames by hand (``magic`` must be 6 bytes to land where the real one does)."""
    return [_HEADER.pack(magic, version, len(msg_id)) + msg_id + payload]


def message_tag(frame: bytes, offset: int = 0) -> str:
    """The ``type`` tag of the MessagePack message at ``offset``, which must be a map starting
    with that key."""
    header = frame[offset : offset + 1]
    if header and 0x80 <= header[0] <= 0x8F:
        start = offset + 1
    elif header == b"\xde":
        start = offset + 3
    elif header == b"\xdf":
        start = offset + 5
    else:
        raise FrameError("undecodable", "the message is not a MessagePack map")
    if frame[start : start + len(_TAG_KEY)] != _TAG_KEY:
        raise FrameError("undecodable", "the message's first key must be its 'type' tag")
    at = start + len(_TAG_KEY)
    header = frame[at : at + 1]
    if not header or not 0xA0 <= header[0] <= 0xBF:  # every tag is a short (fix)str
        raise FrameError("undecodable", "the message's type tag is not a short string")
    return frame[at + 1 : at + 1 + (header[0] & 0x1F)].decode("utf-8", "replace")
