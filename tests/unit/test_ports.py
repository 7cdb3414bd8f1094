"""The test helper that names ports for child processes (tests/ports.py)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests import ports
from tests.ports import free_port


def test_ports_are_outside_the_ephemeral_range_and_never_handed_out_twice() -> None:
    floor = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    # Not from the range outgoing connections take their local ports from, nor Mooncake's.
    assert all(17_000 < port < floor for port in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_bound_by_someone_else_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_handed_out", set())
    first = free_port()  # the first port this process's scan finds free
    monkeypatch.setattr(ports, "_handed_out", set())
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", first))
        holder.listen()
        # The scan starts at the same place and must step past the held port. Where it lands
        # depends on the rest of the machine (ports of earlier tests in this run linger in
        # TIME_WAIT, and are skipped too), so only that it moved on is checked.
        second = free_port()
    assert second != first
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", second))  # what it handed out was free
