"""The control channel's MessagePack codec: round trips, and typed refusals of bad frames."""

from __future__ import annotations

import msgspec
import pytest

from pdflow.core.dataplane.buffers import KvBuffers
from pdflow.core.dataplane.layout import KvDtype, packed_layout
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import (
    PROTOCOL_VERSION,
    WIRE_INT_MAX,
    Abort,
    AbortAck,
    BootstrapRequest,
    KvArgs,
    PeerId,
    RoomMetadata,
    StatusReport,
)
from pdflow.io.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_SMALL_MESSAGE_BYTES,
    HEADER_BYTES,
    MAGIC,
    MAX_SCHEMA_DEPTH,
    ControlMessage,
    FrameError,
    MsgpackCodec,
    wire_frames,
)

DECODE = PeerId("127.0.0.1:5001", "d-inc", 0)
PREFILL = PeerId("127.0.0.1:6001", "p-inc", 1)


def metadata(pages: int = 4) -> RoomMetadata:
    return RoomMetadata(
        room=7, generation=2, decode=DECODE, prefill=PREFILL, session_id="127.0.0.1:9000",
        dst_pages=tuple(range(pages)), aux_index=None, required_dst_info_num=1,
    )  # fmt: skip


@pytest.mark.parametrize(
    "message",
    [
        metadata(),
        StatusReport(7, 2, KVPoll.Success, PREFILL, DECODE, checksum=12345),
        Abort(7, 2, DECODE, PREFILL, reason="client went away"),
        KvArgs(
            DECODE,
            PREFILL,
            "127.0.0.1:9000",
            KvBuffers.from_layout(
                packed_layout(
                    base_addr=4096,
                    num_layers=2,
                    num_pages=8,
                    page_size=4,
                    num_heads=2,
                    head_dim=8,
                    dtype=KvDtype.FP16,
                ),
                2,
            ),
            2,
            0,
            4,
        ),
    ],
)
def test_round_trip_keeps_message_and_id(message: object) -> None:
    codec = MsgpackCodec()
    frames = codec.encode(message, "decode-x#0:12:0")  # type: ignore[arg-type]
    assert len(frames) == 1  # one frame: pyzmq gives the GIL up per frame
    assert frames[0][:6] == MAGIC and frames[0][6] == PROTOCOL_VERSION
    assert codec.decode(frames) == (message, "decode-x#0:12:0")


def test_the_frame_is_the_header_the_id_and_the_message() -> None:
    codec = MsgpackCodec()
    message = StatusReport(7, 2, KVPoll.Success, PREFILL, DECODE, checksum=12345)
    payload = msgspec.msgpack.encode(message)
    header = MAGIC + bytes([PROTOCOL_VERSION, 0, 3])
    assert codec.encode(message, "m:1") == [header + b"m:1" + payload]
    assert wire_frames(payload, b"m:1") == codec.encode(message, "m:1")


def test_missing_message_id_decodes_as_none() -> None:
    codec = MsgpackCodec()
    assert codec.decode(codec.encode(metadata(), None)) == (metadata(), None)


def reason_of(codec: MsgpackCodec, frames: list[bytes]) -> str:
    with pytest.raises(FrameError) as caught:
        codec.decode(frames)
    return caught.value.reason


def test_bad_frames_raise_typed_reasons() -> None:
    codec = MsgpackCodec()
    [good] = codec.encode(metadata(), None)
    payload = good[HEADER_BYTES:]
    assert reason_of(codec, [b"garbage"]) == "malformed"
    assert reason_of(codec, []) == "malformed"
    assert reason_of(codec, [b"nope!!" + good[6:]]) == "malformed"
    assert reason_of(codec, [good[:HEADER_BYTES - 1]]) == "malformed"  # a header cut short
    assert reason_of(codec, [good, b""]) == "malformed"  # a second frame
    assert reason_of(codec, [MAGIC + b"\x01\x00\x05abc"]) == "malformed"  # id past the end
    assert reason_of(codec, wire_frames(payload, version=99)) == "bad_version"
    # pdflow's earlier four-frame wire: that peer runs another version of the protocol.
    assert reason_of(codec, [MAGIC, b"1", payload, b""]) == "bad_version"
    assert reason_of(codec, wire_frames(b"\xc1\xc1")) == "undecodable"
    assert reason_of(codec, wire_frames(payload[:-3])) == "undecodable"
    assert reason_of(codec, wire_frames(payload, b"\xff\xfe")) == "undecodable"
    assert reason_of(codec, wire_frames(b"")) == "undecodable"  # a header and nothing else


def _with(message: object, **fields: object) -> object:
    # msgspec checks field constraints only when decoding, so a message can be built with
    # values no peer's decoder accepts: exactly what a hostile or buggy peer would send.
    return msgspec.structs.replace(message, **fields)  # type: ignore[type-var]


OUT_OF_RANGE = [
    (_with(metadata(), room=-1), "$.room"),
    (_with(metadata(), room=2**63), "$.room"),
    (_with(metadata(), generation=2**64 - 1), "$.generation"),
    (_with(metadata(), dst_pages=(0, -3)), "$.dst_pages[1]"),
    (_with(metadata(), dst_pages=(2**63,)), "$.dst_pages[0]"),
    (_with(metadata(), aux_index=-1), "$.aux_index"),
    (_with(metadata(), staging_offset=-4096), "$.staging_offset"),
    (_with(metadata(), decode_prefix_len=-16), "$.decode_prefix_len"),
    (_with(metadata(), required_dst_info_num=0), "$.required_dst_info_num"),
    (_with(metadata(), state_indices=((1,), (-2,))), "$.state_indices[1][0]"),
    (_with(metadata(), decode=PeerId("127.0.0.1:5001", "d-inc", -1)), "$.decode.rank"),
    (BootstrapRequest(-5, 2, DECODE, PREFILL), "$.room"),
    (StatusReport(7, -2, KVPoll.Failed, PREFILL, DECODE), "$.generation"),
    (StatusReport(7, 2, KVPoll.Success, PREFILL, DECODE, checksum=-1), "$.checksum"),
    (Abort(2**63, 2, DECODE, PREFILL), "$.room"),
    (AbortAck(7, -(2**63), PREFILL, DECODE), "$.generation"),
]


@pytest.mark.parametrize(("message", "field"), OUT_OF_RANGE, ids=[f for _, f in OUT_OF_RANGE])
def test_an_integer_outside_the_wire_range_is_undecodable_naming_the_field(
    message: object, field: str
) -> None:
    # Every one of these decoded and went on to the core: RoomMetadata naming page -3 or
    # staging offset -4096 became a StartTransfer writing at those places.
    codec = MsgpackCodec()
    payload = msgspec.msgpack.encode(message)
    with pytest.raises(FrameError) as caught:
        codec.decode(wire_frames(payload))
    assert caught.value.reason == "undecodable"
    assert field in caught.value.detail


def test_the_ends_of_the_wire_range_decode() -> None:
    codec = MsgpackCodec()
    edge = _with(metadata(), room=WIRE_INT_MAX, generation=0, dst_pages=(0, WIRE_INT_MAX),
                 staging_offset=0, state_indices=((WIRE_INT_MAX,),))  # fmt: skip
    report = StatusReport(WIRE_INT_MAX, WIRE_INT_MAX, KVPoll.Success, PREFILL, DECODE,
                          checksum=2**64 - 1)  # fmt: skip
    for message in (edge, report):
        assert codec.decode(wire_frames(msgspec.msgpack.encode(message))) == (message, None)


def test_unknown_message_type_is_undecodable() -> None:
    codec = MsgpackCodec()
    payload = msgspec.msgpack.encode({"type": "format_disk", "room": 1})
    assert reason_of(codec, wire_frames(payload)) == "undecodable"


def test_oversized_is_refused_both_ways() -> None:
    codec = MsgpackCodec(max_message_bytes=4096)
    assert reason_of(codec, wire_frames(b"x" * 5000)) == "oversized"
    assert reason_of(codec, [MAGIC, b"1", b"x" * 5000, b""]) == "oversized"  # before any framing
    with pytest.raises(FrameError) as caught:
        codec.encode(metadata(pages=2000), None)
    assert caught.value.reason == "oversized"
    assert "raise max_message_bytes" in str(caught.value)


def test_a_small_message_type_over_the_small_limit_is_refused_before_sending() -> None:
    """Every receiver refuses it, and a decode's ZMQ cuts the connection it came on (MAXMSGSIZE
    is the decode's small limit): the sender must never put it on the wire."""
    codec = MsgpackCodec()
    huge_aux = StatusReport(1, 0, KVPoll.Success, PREFILL, DECODE,
                            aux=b"x" * DEFAULT_SMALL_MESSAGE_BYTES)  # fmt: skip
    with pytest.raises(FrameError) as caught:
        codec.encode(huge_aux, None)
    assert caught.value.reason == "oversized" and "StatusReport" in str(caught.value)
    assert len(codec.encode(metadata(pages=30_000), None)[0]) > DEFAULT_SMALL_MESSAGE_BYTES


def test_the_inbound_frame_limit_is_the_largest_frame_the_codec_accepts() -> None:
    assert MsgpackCodec().max_inbound_frame_bytes == DEFAULT_MAX_MESSAGE_BYTES
    assert MsgpackCodec(large_inbound=()).max_inbound_frame_bytes == DEFAULT_SMALL_MESSAGE_BYTES
    assert MsgpackCodec(max_message_bytes=4096).max_inbound_frame_bytes == 4096


def test_limit_must_be_sane() -> None:
    with pytest.raises(ValueError, match="at least 64"):
        MsgpackCodec(max_message_bytes=10)


def test_a_1017_byte_nested_frame_is_refused_not_raised() -> None:
    """A map with another key before the tag, then 999 nested arrays: RecursionError before."""
    codec = MsgpackCodec()
    payload = b"\x81\xa8abcdefgh" + b"\x91" * 999 + b"\x00"
    frames = wire_frames(payload)
    assert sum(len(frame) for frame in frames) == 1019  # 1017 in the four-frame wire
    assert reason_of(codec, frames) == "undecodable"
    deeper = wire_frames(b"\x81\xa8abcdefgh" + b"\xdc\x00\x01" * 300_000 + b"\x00")
    assert reason_of(codec, deeper) == "undecodable"


@pytest.mark.parametrize("field", ["room", "decode", "dst_pages", "reason", "zzz"])
def test_nesting_under_the_tag_is_refused_at_the_first_container(field: str) -> None:
    codec = MsgpackCodec()
    payload = b"\x82\xa4type\xadroom_metadata" + msgspec.msgpack.encode(field)
    payload += b"\x91" * 5000 + b"\x00"
    assert reason_of(codec, wire_frames(payload)) == "undecodable"


def _depth(info: msgspec.inspect.Type) -> int:
    if isinstance(info, msgspec.inspect.UnionType):
        return max(_depth(t) for t in info.types)
    if isinstance(info, msgspec.inspect.StructType):
        return 1 + max((_depth(f.type) for f in info.fields), default=0)
    if isinstance(info, msgspec.inspect.VarTupleType | msgspec.inspect.ListType):
        return 1 + _depth(info.item_type)
    assert not isinstance(info, msgspec.inspect.AnyType | msgspec.inspect.DictType), info
    return 0


def test_every_control_message_nests_at_most_max_schema_depth() -> None:
    """Typed decoding never goes deeper than the schema: the bound the tag-first rule relies on."""
    assert _depth(msgspec.inspect.type_info(ControlMessage)) == MAX_SCHEMA_DEPTH


def test_only_messages_that_grow_with_a_room_may_be_large_and_only_where_received() -> None:
    prefill_side, decode_side = MsgpackCodec(), MsgpackCodec(large_inbound=())
    big_metadata = metadata(pages=30_000)  # about 90 KiB: over the small limit
    frames = MsgpackCodec().encode(big_metadata, None)
    assert sum(map(len, frames)) > prefill_side.small_message_bytes
    assert prefill_side.decode(frames) == (big_metadata, None)
    assert reason_of(decode_side, frames) == "oversized"  # a decode never receives one
    padded = StatusReport(7, 2, KVPoll.Failed, PREFILL, DECODE, reason="x" * 70_000)
    padded_frames = wire_frames(msgspec.msgpack.encode(padded))  # (a pdflow sender refuses it)
    for codec in (prefill_side, decode_side):
        with pytest.raises(FrameError, match="may exceed") as caught:
            codec.decode(padded_frames)
        assert caught.value.reason == "oversized"
    small = StatusReport(7, 2, KVPoll.Failed, PREFILL, DECODE, reason="x" * 1000)
    assert decode_side.decode(decode_side.encode(small, None)) == (small, None)


def test_the_type_tag_must_be_a_short_string() -> None:
    codec = MsgpackCodec()
    for payload in (b"\x81\xa4type\x05", b"\x81\xa4type\xd9\x05abort", b"\x81\xa4type"):
        assert reason_of(codec, wire_frames(payload)) == "undecodable"
