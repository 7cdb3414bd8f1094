"""RegistrationKeeper: a prefill registers again with a standalone registry that restarted empty
(chaos finding 2), and only then; every cell of its table."""

from __future__ import annotations

import pytest

from pdflow.core.cluster.registration import (
    REGISTRATION_TABLE,
    RanksProbed,
    RegisterAgain,
    RegistrationAnswered,
    RegistrationKeeper,
    RegistrationState,
)
from pdflow.core.framework.errors import ProtocolError
from pdflow.core.protocol.inputs import Input

SAMPLES: dict[str, list[Input]] = {
    "RanksProbed": [RanksProbed(()), RanksProbed((0, 1))],
    "RegistrationAnswered": [RegistrationAnswered(True), RegistrationAnswered(False, "409")],
}


def keeper_in(state: RegistrationState) -> RegistrationKeeper:
    keeper = RegistrationKeeper()
    if state is RegistrationState.LOST:
        keeper.fire(RanksProbed((1,)), 0.0)
    assert keeper.state is state
    return keeper


@pytest.mark.parametrize("state", list(RegistrationState), ids=lambda s: s.name)
@pytest.mark.parametrize("on", REGISTRATION_TABLE.inputs)
def test_every_cell(state: RegistrationState, on: str) -> None:
    for sample in SAMPLES[on]:
        keeper = keeper_in(state)
        cell = REGISTRATION_TABLE.cell(state, on)
        if cell:
            _, fired = keeper.fire(sample, 1.0)
            assert keeper.state in {r.target for r in cell} and fired.source == state.name
        else:
            with pytest.raises(ProtocolError):
                keeper.fire(sample, 1.0)
            assert keeper.state is state


def test_a_registry_that_forgot_the_node_gets_every_rank_again_until_it_takes_them() -> None:
    keeper = RegistrationKeeper()
    assert keeper.fire(RanksProbed(()), 1.0)[0] == []  # held: nothing to do
    assert keeper.fire(RanksProbed((0, 1)), 2.0)[0] == [RegisterAgain((0, 1))]
    keeper.fire(RegistrationAnswered(False, "cannot reach the registry"), 2.1)
    assert keeper.state is RegistrationState.LOST and "cannot reach" in keeper.last_refusal
    assert keeper.fire(RanksProbed((0, 1)), 3.0)[0] == [RegisterAgain((0, 1))]  # asked again
    keeper.fire(RegistrationAnswered(True), 3.1)
    assert keeper.state is RegistrationState.REGISTERED and keeper.reregistrations == 1
    assert keeper.fire(RanksProbed(()), 4.0)[0] == []


def test_an_answer_nobody_asked_for_is_a_shell_bug() -> None:
    with pytest.raises(ProtocolError):
        RegistrationKeeper().fire(RegistrationAnswered(True), 1.0)
