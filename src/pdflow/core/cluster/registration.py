"""RegistrationKeeper: a prefill node's hold on its entry in a standalone registry.

A standalone registry (``pdflow bootstrap``) that restarts comes back empty, and decodes get 503
until every rank registers again (chaos finding 2). The shell asks the registry for this node's
own ranks every heartbeat interval and reports which it lacks (an unreachable registry tells
nothing, so nothing is reported); the keeper answers with the ranks to register again, with the
same incarnation and start time (the registry's ordering takes that as the same process life),
and counts each time that worked. See ``[machines.RegistrationKeeper]`` in
spec/machines/registration.toml.
"""

from __future__ import annotations

import enum

from pdflow.core.framework.table import Table, TableMachine, row
from pdflow.core.protocol.inputs import Input
from pdflow.core.protocol.outputs import Output


class RegistrationState(enum.Enum):
    REGISTERED = "REGISTERED"
    LOST = "LOST"


class RanksProbed(Input, frozen=True, tag="RanksProbed"):
    """The registry answered for this node's ranks: these tp ranks it does not hold."""

    missing: tuple[int, ...]


class RegistrationAnswered(Input, frozen=True, tag="RegistrationAnswered"):
    """The registry answered the registration the keeper asked for."""

    accepted: bool
    reason: str = ""


class RegisterAgain(Output, frozen=True, tag="register_again"):
    """Register every rank of this node again (same incarnation, same started_at)."""

    missing: tuple[int, ...]


class RegistrationKeeper(TableMachine[RegistrationState]):
    """One prefill node's registration. Drive it with :meth:`fire`."""

    table: Table[RegistrationState]

    def __init__(self) -> None:
        self.key = 0
        self.state = REGISTRATION_TABLE.initial
        self.reregistrations = 0
        self.last_refusal = ""

    def _guard_ranks_missing(self, inp: RanksProbed, now: float) -> bool:
        return bool(inp.missing)

    def _guard_accepted(self, inp: RegistrationAnswered, now: float) -> bool:
        return inp.accepted

    def _act_register_again(self, inp: RanksProbed, now: float) -> list[Output]:
        return [RegisterAgain(inp.missing)]

    def _act_count(self, inp: Input, now: float) -> list[Output]:
        self.reregistrations += 1
        return []

    def _act_note_refusal(self, inp: RegistrationAnswered, now: float) -> list[Output]:
        # Refused or unreachable: the next probe asks again; a 409 means a newer life holds
        # the rank, and the operator should stop this one.
        self.last_refusal = inp.reason
        return []


_S = RegistrationState
_K = RegistrationKeeper
REGISTRATION_TABLE: Table[RegistrationState] = Table(
    machine="RegistrationKeeper",
    states=RegistrationState,
    initial=RegistrationState.REGISTERED,
    inputs=(RanksProbed, RegistrationAnswered),
    remote_inputs=(),
    rows=[
        row(_S.REGISTERED, RanksProbed, _S.LOST, guard=_K._guard_ranks_missing,
            emits=["register_again"], action=_K._act_register_again),
        row(_S.REGISTERED, RanksProbed, _S.REGISTERED),
        row(_S.LOST, RanksProbed, _S.LOST, guard=_K._guard_ranks_missing,
            emits=["register_again"], action=_K._act_register_again),
        row(_S.LOST, RanksProbed, _S.REGISTERED),
        row(_S.LOST, RegistrationAnswered, _S.REGISTERED, guard=_K._guard_accepted,
            action=_K._act_count),
        row(_S.LOST, RegistrationAnswered, _S.LOST, action=_K._act_note_refusal),
    ],
    keyed_by_room=False,
)  # fmt: skip
RegistrationKeeper.table = REGISTRATION_TABLE
