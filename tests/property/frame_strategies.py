"""Hypothesis strategies for hostile control frames, shared by the codec and node fuzzers.

``PDFLOW_FUZZ_EXAMPLES`` sets how many frames (and HTTP requests) each fuzzer sends; the CI
budget is 5,000. Runs are derandomized: the same budget replays the same inputs."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import msgspec
import structlog
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from pdflow.core.dataplane.buffers import KvBuffer, KvBuffers, KvRole, PageOrder
from pdflow.core.dataplane.layout import KvDtype, packed_layout
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import (
    PROTOCOL_VERSION,
    WIRE_INT_MAX,
    Abort,
    AbortAck,
    BootstrapRequest,
    KvArgs,
    KvArgsAccepted,
    PeerId,
    RoomMetadata,
    StatusReport,
)
from pdflow.io.codec import MAGIC, ControlMessage, MsgpackCodec, wire_frames

FUZZ_EXAMPLES = int(os.environ.get("PDFLOW_FUZZ_EXAMPLES", "5000"))


def fuzz_settings(examples: int = FUZZ_EXAMPLES) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))  # fmt: skip


@contextlib.contextmanager
def errors_only() -> Iterator[None]:
    """Fuzzed input makes a counted warning per frame or request: keep them out of the run."""
    saved = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    try:
        yield
    finally:
        structlog.configure(**saved)


VERSION = str(PROTOCOL_VERSION).encode()
_PEERS = st.builds(PeerId, st.sampled_from(["127.0.0.1:1", "127.0.0.1:notaport", "ipc:///x", ""]),
                   st.text(max_size=8), st.integers(0, 2**40))  # fmt: skip
# Valid messages: every integer in its wire range (tests/unit/test_codec.py refuses the rest).
_ROOM = st.integers(0, WIRE_INT_MAX)
_LAYOUT = KvBuffers.from_layout(packed_layout(base_addr=4096, num_layers=1, num_pages=8,
                                               page_size=1, num_heads=1, head_dim=1,
                                               dtype=KvDtype.FP16), 1)  # fmt: skip
# Engine buffers: an MLA latent and a draft model's head-major K, item lengths of their own.
_MLA_BUFFERS = KvBuffers(4, (KvBuffer(1 << 20, 4096, 512, 0, KvRole.LATENT),
                             KvBuffer(1 << 21, 2048, 256, 1, KvRole.K, 2, True, PageOrder.HND)))

MESSAGES: st.SearchStrategy[ControlMessage] = st.one_of(
    st.builds(RoomMetadata, _ROOM, st.integers(0, 3), _PEERS, _PEERS, st.text(max_size=8),
              st.lists(st.integers(0, 2**33), max_size=16).map(tuple),
              st.none() | st.integers(0, 9), st.integers(1, 4)),
    st.builds(BootstrapRequest, _ROOM, st.integers(0, 3), _PEERS, _PEERS),
    st.builds(StatusReport, _ROOM, st.integers(0, 3), st.sampled_from(KVPoll), _PEERS, _PEERS,
              st.text(max_size=8), st.none() | st.integers(0, 2**64 - 1)),
    st.builds(Abort, _ROOM, st.integers(0, 3), _PEERS, _PEERS, st.text(max_size=8)),
    st.builds(AbortAck, _ROOM, st.integers(0, 3), _PEERS, _PEERS),
    st.builds(KvArgs, _PEERS, _PEERS, st.text(max_size=8), st.sampled_from([_LAYOUT, _MLA_BUFFERS]),
              st.integers(1, 4), st.integers(0, 3), st.integers(1, 8)),
    st.builds(KvArgsAccepted, _PEERS, _PEERS, st.text(max_size=8)),
)  # fmt: skip

_PLAIN = MsgpackCodec()

# MessagePack values of any shape, nested a little; depth bombs come separately.
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                  max_size=4),
    max_leaves=12,
)  # fmt: skip


_D, _P = PeerId("127.0.0.1:5001", "d-inc", 0), PeerId("127.0.0.1:6001", "p-inc", 1)
_SAMPLES: tuple[ControlMessage, ...] = (
    RoomMetadata(7, 1, _D, _P, "127.0.0.1:9000", (0, 1, 2, 70_000), None, 1),
    RoomMetadata(2**40, 0, _D, _P, "", (), 3, 2, decode_prefix_len=5, staging_offset=4096),
    BootstrapRequest(7, 1, _D, _P),
    StatusReport(7, 1, KVPoll.Success, _P, _D, checksum=2**63),
    StatusReport(7, 1, KVPoll.Failed, _P, _D, reason="transfer failed"),
    Abort(7, 1, _D, _P, "client went away"),
    AbortAck(7, 1, _P, _D),
    KvArgs(_D, _P, "127.0.0.1:9000", _LAYOUT, 2, 1, 4, staging_addr=1 << 40),
    KvArgsAccepted(_P, _D, "127.0.0.1:9001"),
)
"""One of each message type, the bases mutations start from (cheaper to draw than MESSAGES)."""
_SAMPLE_FRAMES = tuple(_PLAIN.encode(message, "decode-x#0:12:3") for message in _SAMPLES)


@st.composite
def _mutated(draw: st.DrawFn) -> list[bytes]:
    """A valid frame list with bytes flipped, cut, inserted, or frames dropped or added."""
    frames = list(draw(st.sampled_from(_SAMPLE_FRAMES)))
    for _ in range(draw(st.integers(1, 4))):
        index = draw(st.integers(0, len(frames) - 1))
        frame = bytearray(frames[index])
        edit = draw(st.sampled_from(["flip", "cut", "insert", "drop_frame", "add_frame"]))
        at = draw(st.integers(0, len(frame)))
        if edit == "flip" and frame:
            frame[min(at, len(frame) - 1)] ^= draw(st.integers(1, 255))
        elif edit == "cut":
            del frame[at:]
        elif edit == "insert":
            frame[at:at] = draw(st.binary(min_size=1, max_size=8))
        if edit == "drop_frame" and len(frames) > 1:
            del frames[index]
            continue
        if edit == "add_frame":
            frames.insert(index, draw(st.binary(max_size=16)))
            continue
        frames[index] = bytes(frame)
    return frames


def _bomb(prefix: bytes, layers: int, opener: bytes) -> bytes:
    return prefix + opener * layers + b"\xc0"


DEPTH_BOMBS = st.builds(
    lambda prefix, layers, opener: wire_frames(_bomb(prefix, layers, opener)),
    st.sampled_from([b"", b"\x81\xa8abcdefgh", b"\x82\xa4type\xa5abort\xa4room",
                     b"\x81\xa4type", b"\xde\x00\x01\xa1x"]),
    st.integers(1, 5000),
    st.sampled_from([b"\x91", b"\x81\xa1k", b"\xdc\x00\x01"]),
)  # fmt: skip

FRAME_LISTS: st.SearchStrategy[list[bytes]] = st.one_of(
    _mutated(),
    DEPTH_BOMBS,
    st.lists(st.binary(max_size=64), max_size=6),
    st.builds(lambda value, msg_id: wire_frames(msgspec.msgpack.encode(value), msg_id),
              _VALUES, st.binary(max_size=8)),
    # pdflow's earlier four-frame wire, and a header with another version
    st.builds(lambda value: [MAGIC, VERSION, msgspec.msgpack.encode(value), b""], _VALUES),
    st.builds(lambda value, version: wire_frames(msgspec.msgpack.encode(value), version=version),
              _VALUES, st.integers(0, 255)),
    st.builds(lambda message: _PLAIN.encode(message, None), MESSAGES),
)  # fmt: skip
"""Anything a peer could put on the wire: mutated and valid messages, depth bombs, noise."""
