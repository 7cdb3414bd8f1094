"""Every table-driven machine of the core, by the name the spec uses."""

from __future__ import annotations

from typing import Any

from pdflow.core.receiver_room import RECEIVER_TABLE
from pdflow.core.sender_room import SENDER_TABLE
from pdflow.core.table import Table

MACHINES: dict[str, Table[Any]] = {
    SENDER_TABLE.machine: SENDER_TABLE,
    RECEIVER_TABLE.machine: RECEIVER_TABLE,
}
