"""One error hierarchy for the core. Every error says which machine refused what, and why."""

from __future__ import annotations


class ProtocolError(Exception):
    """An input the protocol does not allow in the current state. The state is unchanged."""

    def __init__(
        self,
        message: str,
        *,
        machine: str = "",
        state: str = "",
        input_name: str = "",
        hint: str = "",
    ) -> None:
        self.machine = machine
        self.state = state
        self.input_name = input_name
        self.hint = hint
        text = message
        if machine:
            text = f"{machine}[{state}] refused {input_name}: {message}"
        if hint:
            text = f"{text} (hint: {hint})"
        super().__init__(text)


class LocalProtocolError(ProtocolError):
    """The local caller (the engine or the shell) used the API out of order: fix the caller."""


class RemoteProtocolError(ProtocolError):
    """A peer sent something the protocol forbids here: drop it and count it; never crash."""


class InvalidInput(ValueError):
    """An input's arguments are malformed. Raised before any state changes."""
