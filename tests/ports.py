"""Ports for a child process (or a later bind) that must be told its address before it binds.

A port 0 bind gets a port from the kernel's ephemeral range, and every outgoing connection on
the machine (zmq, Mooncake, httpx) takes its local port from that same range: between the probe
closing and the child binding, one of them may take it, and the child fails with EADDRINUSE.
Ports below that range, and away from the 15000-17000 Mooncake picks for its own listeners,
are taken only by an explicit bind; this process also never hands one out twice.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

_FIRST = 20_000
_MOONCAKE_AND_EPHEMERAL_FLOOR = 32_768
_handed_out: set[int] = set()


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _MOONCAKE_AND_EPHEMERAL_FLOOR


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))  # the wildcard: free on every local address
        except OSError:
            return False
        return True


def free_port() -> int:
    """A TCP port free on every local address now, below the ephemeral range."""
    last = min(_ephemeral_floor(), _MOONCAKE_AND_EPHEMERAL_FLOOR)
    span = last - _FIRST
    if span <= 0:
        raise RuntimeError(f"the ephemeral port range starts at {last}, below {_FIRST}: "
                           "raise net.ipv4.ip_local_port_range's low end")  # fmt: skip
    # Start where this process's id points, so pytest processes running at once stay apart.
    start = os.getpid() * 7919 % span
    for step in range(span):
        port = _FIRST + (start + step) % span
        if port not in _handed_out and _bindable(port):
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no free TCP port in {_FIRST}-{last - 1}")
