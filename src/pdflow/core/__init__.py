"""The pure, deterministic protocol core.

Nothing in this package reads a clock, draws randomness, opens a socket or starts a thread:
time arrives as ``now`` arguments, entropy arrives inside inputs, and every effect leaves as
plain data in a :class:`~pdflow.core.step.Step`.
"""

from pdflow.core.errors import (
    InvalidInput,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from pdflow.core.kvpoll import KVPoll
from pdflow.core.step import Step

__all__ = [
    "InvalidInput",
    "KVPoll",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "Step",
]
