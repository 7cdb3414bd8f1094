"""Codec fuzzer: whatever a peer sends, decoding yields one message or a FrameError; never
another exception, and never an unbounded recursion. With the token set, nothing without a
valid MAC is even decoded."""

from __future__ import annotations

from hypothesis import given

from pdflow.io.codec import DROP_REASONS, ControlMessage, FrameError, MsgpackCodec
from pdflow.io.frame_auth import AUTH_REASONS, AuthenticatedCodec, control_key
from tests.property.frame_strategies import FRAME_LISTS, MESSAGES, fuzz_settings

PLAIN = MsgpackCodec()
AUTHENTICATED = AuthenticatedCodec(MsgpackCodec(), control_key("fuzz"))


def outcome(codec: object, frames: list[bytes]) -> str:
    try:
        message, _ = codec.decode(frames)  # type: ignore[attr-defined]
    except FrameError as exc:
        return exc.reason
    assert isinstance(message, ControlMessage.__args__)  # type: ignore[attr-defined]
    return "ok"


@fuzz_settings()
@given(FRAME_LISTS)
def test_any_frame_list_decodes_or_is_refused_by_reason(frames: list[bytes]) -> None:
    assert outcome(PLAIN, frames) in ("ok", *DROP_REASONS)
    # Without the MAC frame a token-holding node never accepts it.
    assert outcome(AUTHENTICATED, frames) in AUTH_REASONS


@fuzz_settings(500)
@given(MESSAGES)
def test_every_valid_message_round_trips_through_both_codecs(message: ControlMessage) -> None:
    assert PLAIN.decode(PLAIN.encode(message, "m:1:0")) == (message, "m:1:0")
    sender = AuthenticatedCodec(MsgpackCodec(), control_key("fuzz"))
    assert AUTHENTICATED.decode(sender.encode(message, None)) == (message, None)
