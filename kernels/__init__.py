"""Data-plane kernels: Triton gather/scatter for staging, page copy and checksum, with torch
references.

Importing this package is free: submodules pull in torch and triton only when imported
(``kernels.reference`` needs torch, ``kernels.triton_kernels`` needs torch and triton; install
the ``kernels`` extra).
"""

from importlib.util import find_spec


def triton_available() -> bool:
    """True when both torch and triton can be imported."""
    return find_spec("torch") is not None and find_spec("triton") is not None
