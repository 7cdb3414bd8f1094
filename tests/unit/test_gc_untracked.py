"""Structs declared ``gc=False`` must never be able to take part in a reference cycle.

msgspec does not track such instances with the cyclic garbage collector (they neither count
toward its thresholds nor get traversed), so a cycle through one would leak. A class may carry
the flag (it is inherited) only if it is frozen and every field's declared type holds scalars,
enums, tuples of those, or other such Structs: nothing that could refer back to the instance.
"""

from __future__ import annotations

import enum
import gc
import importlib
import pkgutil
import types
import typing

import msgspec
import pytest

import pdflow
from pdflow.core.framework.step import Fired
from pdflow.core.protocol.inputs import TransferCompleted
from pdflow.core.protocol.messages import PeerId, RoomMetadata, StatusReport
from pdflow.core.protocol.outputs import StartTransfer

_SCALARS = (int, str, bytes, bool, float, type(None))


def _untracked_structs() -> list[type[msgspec.Struct]]:
    for module in pkgutil.walk_packages(pdflow.__path__, "pdflow."):
        if module.name.endswith(".__main__"):
            continue
        try:
            importlib.import_module(module.name)
        except ModuleNotFoundError as missing:  # an optional engine (sglang) not installed here
            if (missing.name or "").startswith("pdflow"):
                raise
    found: list[type[msgspec.Struct]] = []
    pending: list[type] = [msgspec.Struct]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if (
            cls is not msgspec.Struct
            and cls.__module__.startswith("pdflow.")
            and not cls.__struct_config__.gc
        ):
            found.append(cls)
    return sorted(set(found), key=lambda c: f"{c.__module__}.{c.__qualname__}")


def cycle_risks(annotation: object, where: str) -> list[str]:
    """Why a field of this declared type could reference a container that refers back."""
    origin = typing.get_origin(annotation)
    if annotation in _SCALARS:
        return []
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return []
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        config = annotation.__struct_config__
        if config.gc or not config.frozen:
            return [f"{where}: {annotation.__qualname__} is tracked or mutable"]
        return []
    if origin is typing.Literal:
        return []
    if origin in (typing.Union, types.UnionType):
        return [r for arg in typing.get_args(annotation) for r in cycle_risks(arg, where)]
    if origin is tuple:
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        return [r for arg in args for r in cycle_risks(arg, where)]
    return [f"{where}: {annotation!r} may hold a cycle"]


def struct_cycle_risks(cls: type[msgspec.Struct]) -> list[str]:
    risks = [] if cls.__struct_config__.frozen else [f"{cls.__qualname__} is not frozen"]
    hints = typing.get_type_hints(cls)
    for name in cls.__struct_fields__:
        risks += cycle_risks(hints[name], f"{cls.__qualname__}.{name}")
    return risks


UNTRACKED = _untracked_structs()


def test_the_hot_path_records_are_untracked() -> None:
    # What the rule guards: the protocol's per-room records stay out of the GC's reach.
    for cls in (PeerId, RoomMetadata, StatusReport, TransferCompleted, StartTransfer, Fired):
        assert cls in UNTRACKED
    peer = PeerId("tcp://a:1", "i")
    metadata = RoomMetadata(1, 1, peer, peer, "s", (1, 2), None, 1)
    assert not gc.is_tracked(metadata)
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(metadata), type=RoomMetadata)
    assert not gc.is_tracked(decoded)


@pytest.mark.parametrize("cls", UNTRACKED, ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_untracked_struct_cannot_hold_a_cycle(cls: type[msgspec.Struct]) -> None:
    assert struct_cycle_risks(cls) == []


def test_the_rule_refuses_containers() -> None:
    class Holder(msgspec.Struct, frozen=True, gc=False):
        items: list[int]
        table: dict[str, int]
        anything: object
        fine: tuple[tuple[int, ...], ...]

    assert len(struct_cycle_risks(Holder)) == 3
