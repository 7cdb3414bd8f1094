"""The data plane: execute transfer plans (writes, staging gather/scatter, checksums).

Plans come from :mod:`pdflow.core.dataplane.planning` as absolute addresses; an executor moves
the bytes
with the fastest backend this process has (Triton, then the torch reference, then numpy, then
plain Python). torch, triton and numpy are optional: without them this package still imports
and falls back.
"""

from pdflow.dataplane.backend import Backend, available_backends
from pdflow.dataplane.executor import Executor, make_executor
from pdflow.dataplane.host import memmove_write_ops

__all__ = ["Backend", "Executor", "available_backends", "make_executor", "memmove_write_ops"]
