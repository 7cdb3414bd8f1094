"""Wire codecs of the control channel: control messages <-> ZMQ multipart frames.

A codec only translates; it never decides what a message means. The channel hands every frame
list it receives to :meth:`WireCodec.decode` and drops (and counts) whatever raises
:class:`FrameError`. pdflow's own codec is :class:`MsgpackCodec`; a codec speaking SGLang's
positional ASCII frames would implement the same two methods and map those frames onto the same
message structs, so neither the core nor the nodes change.

MsgpackCodec frames (four, in order)::

    0  b"pdflow"                      magic: not a pdflow frame -> "malformed"
    1  protocol version, ASCII int    another version -> "bad_version"
    2  the message, MessagePack       undecodable or unknown type -> "undecodable"
    3  message id, UTF-8 (may be empty; it only orders merged traces)

The message must be a map whose first key is its ``type`` tag (pdflow's encoder always writes it
first). Decoding is then typed from the first byte on, so its depth is bounded by the message
schema (at most :data:`MAX_SCHEMA_DEPTH` containers); a frame that puts another key first would
make msgspec skip that key's value untyped, which recurses as deep as the sender nests it.
The tag, read before decoding, also sets the size limit: only LARGE_MESSAGE_TYPES (and only
where ``large_inbound`` admits them) may exceed ``small_message_bytes``.
"""

from __future__ import annotations

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


class FrameError(Exception):
    """A received frame list that is not a valid message; ``reason`` is one of DROP_REASONS."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class WireCodec(Protocol):
    """Encode a control message into frames and back."""

    max_message_bytes: int

    def encode(self, message: ControlMessage, msg_id: str | None) -> list[bytes]: ...

    def decode(self, frames: list[bytes]) -> tuple[ControlMessage, str | None]:
        """Raise :class:`FrameError` for anything that is not one valid message."""
        ...


class MsgpackCodec:
    """pdflow's codec: msgspec MessagePack behind a magic and a protocol-version frame."""

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
        self.version = version
        self._version_frame = str(version).encode()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(ControlMessage)

    def encode(self, message: ControlMessage, msg_id: str | None) -> list[bytes]:
        frames = [
            MAGIC,
            self._version_frame,
            self._encoder.encode(message),
            (msg_id or "").encode(),
        ]
        size = sum(len(frame) for frame in frames)
        if size > self.max_message_bytes:
            # Refuse locally: the peer would drop it anyway, and silently.
            raise FrameError(
                "oversized",
                f"{type(message).__name__} encodes to {size} bytes, over the "
                f"{self.max_message_bytes}-byte limit; raise max_message_bytes on both sides",
            )
        return frames

    def decode(self, frames: list[bytes]) -> tuple[ControlMessage, str | None]:
        size = sum(len(frame) for frame in frames)
        if size > self.max_message_bytes:
            raise FrameError(
                "oversized", f"{size} bytes in {len(frames)} frames, limit {self.max_message_bytes}"
            )
        if len(frames) != 4 or frames[0] != MAGIC:
            raise FrameError(
                "malformed", f"expected 4 frames starting with {MAGIC!r}, got {len(frames)}"
            )
        if frames[1] != self._version_frame:
            shown = frames[1][:16].decode("ascii", "replace")
            raise FrameError(
                "bad_version", f"protocol version {shown!r}, this node speaks {self.version}"
            )
        tag = message_tag(frames[2])
        if size > self.small_message_bytes and tag not in self.large_inbound:
            raise FrameError(
                "oversized", f"a {tag[:40]!r} message of {size} bytes; only "
                f"{sorted(self.large_inbound)} may exceed {self.small_message_bytes} bytes here",
            )
        try:
            message = self._decoder.decode(frames[2])
            msg_id = frames[3].decode() or None
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            raise FrameError("undecodable", str(exc)) from None
        return message, msg_id


def message_tag(payload: bytes) -> str:
    """The ``type`` tag of a MessagePack payload, which must be a map starting with that key."""
    header = payload[:1]
    if header and 0x80 <= header[0] <= 0x8F:
        start = 1
    elif header == b"\xde":
        start = 3
    elif header == b"\xdf":
        start = 5
    else:
        raise FrameError("undecodable", "the message is not a MessagePack map")
    if payload[start : start + len(_TAG_KEY)] != _TAG_KEY:
        raise FrameError("undecodable", "the message's first key must be its 'type' tag")
    at = start + len(_TAG_KEY)
    header = payload[at : at + 1]
    if not header or not 0xA0 <= header[0] <= 0xBF:  # every tag is a short (fix)str
        raise FrameError("undecodable", "the message's type tag is not a short string")
    return payload[at + 1 : at + 1 + (header[0] & 0x1F)].decode("utf-8", "replace")
