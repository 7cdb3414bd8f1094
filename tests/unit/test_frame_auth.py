"""Authenticated control frames: what verifies, and why each forged frame is refused."""

from __future__ import annotations

import hashlib
import hmac

import pytest

from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.protocol.messages import Abort, PeerId, RoomMetadata, StatusReport
from pdflow.io import frame_auth
from pdflow.io.codec import FrameError, MsgpackCodec
from pdflow.io.frame_auth import AuthenticatedCodec, authenticated, control_key, identity

DECODE = PeerId("127.0.0.1:5001", "d-inc", 0)
PREFILL = PeerId("127.0.0.1:6001", "p-inc", 1)
KEY = control_key("s3cret")


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def codec(clock: Clock, key: bytes = KEY) -> AuthenticatedCodec:
    return AuthenticatedCodec(MsgpackCodec(), key, window_s=30.0, clock=clock)


def reason_of(receiver: AuthenticatedCodec, frames: list[bytes]) -> str:
    with pytest.raises(FrameError) as caught:
        receiver.decode(frames)
    return caught.value.reason


def metadata(room: int = 7) -> RoomMetadata:
    return RoomMetadata(room, 0, DECODE, PREFILL, "s", (1, 2, 3), None, 1)


def test_an_authenticated_frame_round_trips_with_its_id() -> None:
    clock = Clock()
    sender, receiver = codec(clock), codec(clock)
    status = StatusReport(7, 0, KVPoll.Success, PREFILL, DECODE)
    for message, sent_by in ((metadata(), DECODE), (status, PREFILL)):
        frames = sender.encode(message, "decode-x#0:3:0")
        assert len(frames) == 2 and frames[-1].endswith(identity(sent_by))  # message, MAC
        assert receiver.decode(frames) == (message, "decode-x#0:3:0")


def test_frames_without_a_valid_mac_are_refused_by_reason() -> None:
    clock = Clock()
    sender, receiver = codec(clock), codec(clock)
    plain = MsgpackCodec().encode(metadata(), None)
    assert reason_of(receiver, plain) == "unauthenticated"
    assert reason_of(receiver, [*plain, b"short"]) == "unauthenticated"
    good = sender.encode(metadata(), "m:1:0")
    tampered = [good[0].replace(b"\x01\x02\x03", b"\x01\x02\x04"), good[1]]
    assert reason_of(receiver, tampered) == "bad_mac"
    [other_id] = MsgpackCodec().encode(metadata(), "m:1:1")
    assert reason_of(receiver, [other_id, good[1]]) == "bad_mac"  # another id
    assert reason_of(receiver, [good[0], good[1][:-1] + b"9"]) == "bad_mac"  # another sender
    other_token = codec(clock, control_key("other")).encode(metadata(), None)
    assert reason_of(receiver, other_token) == "bad_mac"


def test_stale_and_replayed_frames_are_refused() -> None:
    sender_clock, receiver_clock = Clock(), Clock()
    sender, receiver = codec(sender_clock), codec(receiver_clock)
    frames = sender.encode(metadata(), None)
    receiver_clock.now += 31.0
    assert reason_of(receiver, frames) == "stale"
    receiver_clock.now -= 62.0  # a sender clock ahead of ours by more than the window
    assert reason_of(receiver, frames) == "stale"
    receiver_clock.now += 31.0 + 29.0
    assert receiver.decode(frames)[0] == metadata()
    assert reason_of(receiver, frames) == "replayed"
    # The same message sent again is a new frame (its sequence differs), not a replay.
    assert receiver.decode(sender.encode(metadata(), None))[0] == metadata()


def test_a_mac_naming_another_sender_than_the_message_is_refused() -> None:
    """A token holder cannot put one peer's name on another peer's message."""
    clock = Clock()
    receiver = codec(clock)
    honest = codec(clock).encode(Abort(7, 0, DECODE, PREFILL), None)
    body, head = honest[:1], honest[1][:16]
    other = identity(PeerId("127.0.0.1:9999", "x", 0))
    mac = hmac.new(KEY, b"pdflow control frame v1\0", hashlib.sha256)
    mac.update(head + b"".join(len(part).to_bytes(8, "big") for part in (other, *body)))
    for part in (other, *body):
        mac.update(part)
    assert reason_of(receiver, [*body, head + mac.digest() + other]) == "sender_mismatch"


def test_no_token_means_no_wrapper_and_the_key_is_not_the_token() -> None:
    plain = MsgpackCodec()
    assert authenticated(plain, None, 30.0) is plain
    assert isinstance(authenticated(plain, "t", 30.0), AuthenticatedCodec)
    assert control_key("t") != control_key("u") and len(control_key("t")) == 32
    assert control_key("t") != hashlib.sha256(b"t").digest()
    with pytest.raises(ValueError, match="positive"):
        AuthenticatedCodec(plain, KEY, window_s=0)


def test_replays_are_refused_by_sequence_however_many_frames_came_between() -> None:
    """A bounded set of seen tags forgot a tag after 131,072 frames (13 s at 10,000 frames a
    second, inside the window) and the replay passed. Sequences per (sender, recipient) pair
    cannot be outrun."""
    clock = Clock()
    sender, receiver = codec(clock), codec(clock)
    first = sender.encode(metadata(1), None)
    receiver.decode(first)
    for room in range(2, 200_002):
        clock.now += 0.0001
        receiver.decode(sender.encode(metadata(room), None))
    assert clock.now - 1_000_000.0 < 30.0  # still inside the freshness window
    assert reason_of(receiver, first) == "replayed"
    assert len(receiver._last) == 1


def test_a_senders_frames_to_two_recipients_may_arrive_interleaved_either_way() -> None:
    """One node's codec numbers the frames of all its ranks and peers from one counter; only
    the frames to one recipient share a connection, and so an order."""
    clock = Clock()
    sender, receiver = codec(clock), codec(clock)
    other_prefill = PeerId("127.0.0.1:6002", "p-inc", 2)
    to_one = sender.encode(metadata(1), None)
    to_other = sender.encode(RoomMetadata(2, 0, DECODE, other_prefill, "s", (1,), None, 1), None)
    receiver.decode(to_other)  # the later frame, over the other connection, came first
    assert receiver.decode(to_one)[0] == metadata(1)
    assert reason_of(receiver, to_one) == "replayed"


def test_a_process_back_under_the_same_identity_numbers_above_its_earlier_life() -> None:
    clock = Clock()
    receiver = codec(clock)
    for _ in range(3):
        receiver.decode(codec(clock).encode(metadata(), None))  # a fresh codec each time
        clock.now += 0.001


def test_the_pair_memory_is_bounded_and_forgets_silent_pairs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(frame_auth, "_PAIR_CAPACITY", 3)
    clock = Clock()
    sender, receiver = codec(clock), codec(clock)
    for rank in range(5):
        prefill = PeerId("127.0.0.1:6001", "p-inc", rank)
        receiver.decode(sender.encode(RoomMetadata(1, 0, DECODE, prefill, "s", (1,), None, 1),
                                      None))  # fmt: skip
    assert len(receiver._last) == 3
    clock.now += 61.0  # silent for twice the window: any frame of theirs is stale now
    receiver.decode(codec(clock).encode(metadata(9), None))
    assert len(receiver._last) == 1


def test_an_oversized_body_is_refused_before_its_mac_is_computed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hashing a forged 8 MiB body cost the loop milliseconds per frame; its size is known
    before any byte is hashed."""
    clock = Clock()
    receiver = codec(clock)
    good = codec(clock).encode(metadata(), None)
    hashed: list[int] = []
    real_tag = AuthenticatedCodec._tag

    def counting_tag(self: AuthenticatedCodec, head: bytes, sender: bytes,
                     frames: list[bytes]) -> bytes:  # fmt: skip
        hashed.append(sum(map(len, frames)))
        return real_tag(self, head, sender, frames)

    monkeypatch.setattr(AuthenticatedCodec, "_tag", counting_tag)
    forged = [b"\x00" * (MsgpackCodec().max_message_bytes + 1), good[1]]
    assert reason_of(receiver, forged) == "oversized"
    assert hashed == [], "the MAC of an oversized body was computed"
