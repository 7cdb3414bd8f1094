"""Every table-driven machine of the core, by the name the spec uses."""

from __future__ import annotations

from typing import Any

from pdflow.core.cluster.registration import REGISTRATION_TABLE
from pdflow.core.cluster.registry import REGISTRY_TABLE
from pdflow.core.endpoints.decode_slots import DECODE_SLOT_TABLE
from pdflow.core.endpoints.prefill_slots import PREFILL_SLOT_TABLE
from pdflow.core.framework.table import Table
from pdflow.core.resources.admission import ADMISSION_TABLE
from pdflow.core.resources.kv_layouts import ANNOUNCEMENT_TABLE, DECODE_LAYOUT_TABLE
from pdflow.core.resources.page_ledger import PAGE_LEDGER_TABLE
from pdflow.core.resources.staging_ring import STAGING_RING_TABLE
from pdflow.core.rooms.prefill_complete import PREFILL_COMPLETE_TABLE
from pdflow.core.rooms.receiver_room import RECEIVER_TABLE
from pdflow.core.rooms.sender_room import SENDER_TABLE

MACHINES: dict[str, Table[Any]] = {
    ADMISSION_TABLE.machine: ADMISSION_TABLE,
    SENDER_TABLE.machine: SENDER_TABLE,
    RECEIVER_TABLE.machine: RECEIVER_TABLE,
    REGISTRY_TABLE.machine: REGISTRY_TABLE,
    REGISTRATION_TABLE.machine: REGISTRATION_TABLE,
    PAGE_LEDGER_TABLE.machine: PAGE_LEDGER_TABLE,
    STAGING_RING_TABLE.machine: STAGING_RING_TABLE,
    PREFILL_COMPLETE_TABLE.machine: PREFILL_COMPLETE_TABLE,
    PREFILL_SLOT_TABLE.machine: PREFILL_SLOT_TABLE,
    DECODE_SLOT_TABLE.machine: DECODE_SLOT_TABLE,
    ANNOUNCEMENT_TABLE.machine: ANNOUNCEMENT_TABLE,
    DECODE_LAYOUT_TABLE.machine: DECODE_LAYOUT_TABLE,
}
