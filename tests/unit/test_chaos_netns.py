"""The chaos network: what it does without iproute2, and a one-way fault that is one-way for
TCP (checked on real namespaces where this process may create them)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdflow.chaos.netns import (
    IP_MISSING,
    LoopbackNetwork,
    NamespaceNetwork,
    NetworkError,
    listening_ports,
    open_network,
    remove_leftovers,
    remove_owned,
)

HOSTS = ["registry", "prefill-0"]


def test_without_ip_on_path_the_run_falls_back_to_loopback_and_cleanup_is_quiet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert remove_leftovers() == []
    remove_owned()
    network = open_network(HOSTS, want_namespaces=True)
    assert isinstance(network, LoopbackNetwork)
    assert IP_MISSING in network.unavailable["partition"]
    with pytest.raises(NetworkError, match="iproute2"):
        network.slow("prefill-0")


def test_without_tc_slow_and_oneway_are_refused_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    ip = shutil.which("ip")
    assert ip is not None, "iproute2 is missing: scripts/setup.sh installs it"
    (tmp_path / "ip").symlink_to(ip)
    monkeypatch.setenv("PATH", str(tmp_path))
    network = NamespaceNetwork(HOSTS)  # nothing created yet
    assert not network.can("slow") and not network.can("oneway") and network.can("partition")
    for refused in (lambda: network.slow("prefill-0"),
                    lambda: network.block_oneway("prefill-0", "registry")):  # fmt: skip
        with pytest.raises(NetworkError, match=r"`tc` .* not on PATH: install iproute2"):
            refused()


def test_listening_ports_are_read_from_proc_net_tcp() -> None:
    text = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid
   0: 0A00D50C:2326 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0
   1: 0A00D50C:8E61 0A00D50E:C350 01 00000000:00000000 00:00000000 00000000     0
   2: 00000000000000000000000000000000:1F90 00000000000000000000000000000000:0000 0A 0
"""
    assert listening_ports(text) == [0x1F90, 0x2326]  # the established one is not listening


SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 7000)); s.listen(8)
print("up", flush=True)
while True:
    c, _ = s.accept()
    c.settimeout(5)
    try:
        c.sendall(b"echo:" + c.recv(100))
    except OSError:
        pass
    c.close()
"""
CLIENT = """
import socket, sys
s = socket.socket(); s.settimeout(1.5)
try:
    s.connect((sys.argv[1], 7000)); s.sendall(b"hi"); print(s.recv(100).decode())
except OSError as e:
    print(type(e).__name__)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_oneway_cuts_the_senders_connections_and_keeps_the_peers() -> None:
    """A -> B blocked: A's connects to B time out (no local error on A); B's connections to
    A carry data both ways; after the unblock A reaches B again."""
    network = NamespaceNetwork(["a", "b"], subnet="10.214.0.0/24")
    if not network.can("oneway"):
        pytest.skip(network.unavailable["oneway"])
    servers: list[subprocess.Popen[str]] = []
    try:
        network.create()
        for host in ("a", "b"):
            server = subprocess.Popen([*network.command_prefix(host), sys.executable, "-c",
                                       SERVER], stdout=subprocess.PIPE, text=True)  # fmt: skip
            servers.append(server)
            assert server.stdout is not None and server.stdout.readline() == "up\n"

        def connect(source: str, target: str) -> str:
            done = subprocess.run([*network.command_prefix(source), sys.executable, "-c",
                                   CLIENT, network.addresses[target]],
                                  capture_output=True, text=True, timeout=20)  # fmt: skip
            return done.stdout.strip()

        assert connect("a", "b") == connect("b", "a") == "echo:hi"
        network.block_oneway("a", "b")
        started = time.monotonic()
        assert connect("a", "b") == "TimeoutError"  # silent: not EINVAL, not refused
        assert time.monotonic() - started > 1.0
        assert connect("b", "a") == "echo:hi"  # B's connection to A works both ways
        network.unblock_oneway("a", "b")
        assert connect("a", "b") == "echo:hi"
        network.heal()  # nothing left to undo
    finally:
        for server in servers:
            server.kill()
            server.wait()
        network.close()
