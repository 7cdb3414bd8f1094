"""Every table-driven machine of the core, by the name the spec uses."""

from __future__ import annotations

from typing import Any

from pdflow.core.admission import ADMISSION_TABLE
from pdflow.core.page_ledger import PAGE_LEDGER_TABLE
from pdflow.core.prefill_complete import PREFILL_COMPLETE_TABLE
from pdflow.core.receiver_room import RECEIVER_TABLE
from pdflow.core.registry import REGISTRY_TABLE
from pdflow.core.sender_room import SENDER_TABLE
from pdflow.core.staging_ring import STAGING_RING_TABLE
from pdflow.core.table import Table

MACHINES: dict[str, Table[Any]] = {
    ADMISSION_TABLE.machine: ADMISSION_TABLE,
    SENDER_TABLE.machine: SENDER_TABLE,
    RECEIVER_TABLE.machine: RECEIVER_TABLE,
    REGISTRY_TABLE.machine: REGISTRY_TABLE,
    PAGE_LEDGER_TABLE.machine: PAGE_LEDGER_TABLE,
    STAGING_RING_TABLE.machine: STAGING_RING_TABLE,
    PREFILL_COMPLETE_TABLE.machine: PREFILL_COMPLETE_TABLE,
}
