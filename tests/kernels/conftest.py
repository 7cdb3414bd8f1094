"""Kernel tests run on PDFLOW_KERNEL_DEVICE (default cpu, where Triton runs interpreted)."""

import os

import pytest

KERNEL_DEVICE = os.environ.get("PDFLOW_KERNEL_DEVICE", "cpu")
if KERNEL_DEVICE == "cpu":
    # Must precede the first triton import: @triton.jit decides interpret mode when it decorates.
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture
def device() -> str:
    return KERNEL_DEVICE
