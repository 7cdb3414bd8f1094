"""The pure, deterministic protocol core.

Nothing in this package reads a clock, draws randomness, opens a socket or starts a thread:
time arrives as ``now`` arguments, entropy arrives inside inputs, and every effect leaves as
plain data in a :class:`~pdflow.core.framework.step.Step`.
"""

from pdflow.core.framework.errors import (
    InvalidInput,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
)
from pdflow.core.framework.kvpoll import KVPoll
from pdflow.core.framework.step import Step

__all__ = [
    "InvalidInput",
    "KVPoll",
    "LocalProtocolError",
    "ProtocolError",
    "RemoteProtocolError",
    "Step",
]
