"""Transports move bytes between registered buffers of engines: in-process or Mooncake."""

from pdflow.transport.base import (
    FenceUnavailableError,
    InvalidWriteError,
    RegistrationError,
    RotationUnavailableError,
    TransferOutcome,
    Transport,
    TransportClosedError,
    TransportError,
    WriteOpLike,
)
from pdflow.transport.inprocess import InProcessFabric, InProcessTransport, WriteHold
from pdflow.transport.mooncake import MooncakeConfig, MooncakeTransport

__all__ = [
    "FenceUnavailableError",
    "InProcessFabric",
    "InProcessTransport",
    "InvalidWriteError",
    "MooncakeConfig",
    "MooncakeTransport",
    "RegistrationError",
    "RotationUnavailableError",
    "TransferOutcome",
    "Transport",
    "TransportClosedError",
    "TransportError",
    "WriteHold",
    "WriteOpLike",
]
