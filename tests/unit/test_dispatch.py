"""Type dispatch (framework/dispatch.py): a subclass of an input goes where isinstance sent it."""

from __future__ import annotations

import pytest

from pdflow.core.endpoints.endpoint_io import (
    OpenReceiver,
    OpenRoom,
    PrefillEndpointConfig,
    RoomCall,
)
from pdflow.core.endpoints.prefill_endpoint import PrefillEndpoint
from pdflow.core.framework.dispatch import listed_kind, remembered_kind
from pdflow.core.framework.errors import LocalProtocolError
from pdflow.core.protocol.messages import PeerId

PREFILL = PeerId("127.0.0.1:7000", "p1", 0)


class LabelledOpenRoom(OpenRoom, frozen=True):
    """An engine's own subclass of an endpoint input."""


def test_a_subclass_dispatches_as_its_listed_type() -> None:
    listed = frozenset({OpenRoom, RoomCall})
    assert listed_kind(LabelledOpenRoom(1, 1), listed) is OpenRoom
    assert listed_kind(OpenReceiver(1, 1, "b"), listed) is OpenReceiver  # unlisted: its own
    seen: dict[type, type] = {}
    assert remembered_kind(LabelledOpenRoom(1, 1), listed, seen) is OpenRoom
    assert seen == {LabelledOpenRoom: OpenRoom}


def test_an_endpoint_takes_a_subclass_of_its_inputs() -> None:
    prefill = PrefillEndpoint(PrefillEndpointConfig(me=PREFILL))
    prefill.handle(LabelledOpenRoom(9, 1), 0.0)
    assert prefill.is_open(9)
    with pytest.raises(LocalProtocolError, match="does not take OpenReceiver"):
        prefill.handle(OpenReceiver(9, 1, "b"), 0.0)  # type: ignore[arg-type]
