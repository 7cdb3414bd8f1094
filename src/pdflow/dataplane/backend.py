"""Which data-plane backend this process can use: Triton, torch, numpy or plain Python."""

from __future__ import annotations

import enum
import importlib
import os
from types import ModuleType


class Backend(enum.Enum):
    """Fastest first: the order :func:`available_backends` prefers them in."""

    TRITON = "triton"
    TORCH = "torch"
    NUMPY = "numpy"
    PYTHON = "python"


def load_optional(name: str) -> ModuleType | None:
    """Import an optional dependency, or ``None`` when it is not installed.

    Every optional import of the data plane goes through here, so tests can simulate a
    missing package by patching this one function.
    """
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def is_cuda_device(device: str) -> bool:
    return device.startswith("cuda")


def triton_interpreted() -> bool:
    """True when Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available_backends(device: str = "cpu") -> list[Backend]:
    """Backends able to move bytes in memory of ``device`` ("cpu" or "cuda[:n]"), best first."""
    torch = load_optional("torch")
    cuda = is_cuda_device(device)
    if cuda and (torch is None or not torch.cuda.is_available()):
        return []
    found = []
    triton_runs_here = cuda or triton_interpreted()
    if torch is not None and triton_runs_here and load_optional("triton") is not None:
        found.append(Backend.TRITON)
    if torch is not None:
        found.append(Backend.TORCH)
    if not cuda:
        if load_optional("numpy") is not None:
            found.append(Backend.NUMPY)
        found.append(Backend.PYTHON)
    return found
