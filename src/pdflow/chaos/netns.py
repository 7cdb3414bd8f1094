"""Hosts for a chaos run: one network namespace per host, all joined by veth pairs to a bridge
that lives in a hub namespace of its own, so nothing is added to the machine's own namespace and
no host has a route anywhere but the run's private /24 and its own loopback.

Faults the kernel here can inject (checked at start, see :data:`FAULT_MEANS`):

* partition: the host's port on the bridge goes down (both directions), then up;
* one-way: a ``blackhole`` route in the sender's namespace drops what it sends to one peer while
  the peer's packets still arrive (there is no iptables/nft on this machine to do it per port);
* slow link: a ``tbf`` token bucket (rate limit) on both ends of the host's veth. ``netem``
  (delay, loss) is not available in this kernel, so there is no added latency or loss.

Where namespaces cannot be created (no privilege), :class:`LoopbackNetwork` puts every host on
its own 127.x address in the machine's namespace and refuses the network faults, saying why.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
from collections.abc import Sequence

import structlog

log = structlog.get_logger("pdflow.chaos.net")

NETWORK_FAULTS = ("partition", "oneway", "slow")
NS_PREFIX = "pdchaos"
SLOW_RATE = "384kbit"
FAULT_MEANS = {
    "partition": "ip link set <host port on the bridge> down/up",
    "oneway": "ip route add blackhole <peer>/32 in the sender's namespace",
    "slow": f"tc qdisc tbf rate {SLOW_RATE} on both ends of the host's veth (no netem here)",
}


class NetworkError(RuntimeError):
    """A namespace, link or qdisc command failed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise NetworkError(f"`{' '.join(args)}` failed: {result.stderr.strip()}")
    return result


class Network:
    """Where each host lives and which faults can be injected between them."""

    kind = "abstract"

    def __init__(self, hosts: Sequence[str]) -> None:
        self.hosts = list(hosts)
        self.addresses: dict[str, str] = {}
        self.unavailable: dict[str, str] = {}

    def command_prefix(self, host: str) -> list[str]:
        """What to put before a command so it runs on ``host``."""
        return []

    def can(self, fault: str) -> bool:
        return fault not in self.unavailable

    def link_down(self, host: str) -> None:
        raise NetworkError(self.unavailable["partition"])

    def link_up(self, host: str) -> None:
        raise NetworkError(self.unavailable["partition"])

    def block_oneway(self, source: str, target: str) -> None:
        raise NetworkError(self.unavailable["oneway"])

    def unblock_oneway(self, source: str, target: str) -> None:
        raise NetworkError(self.unavailable["oneway"])

    def slow(self, host: str) -> None:
        raise NetworkError(self.unavailable["slow"])

    def unslow(self, host: str) -> None:
        raise NetworkError(self.unavailable["slow"])

    def heal(self) -> None:
        """Undo every fault still in place."""

    def close(self) -> None:
        """Remove everything this network created."""

    def processes_inside(self) -> list[int]:
        """Processes still running on this network's hosts (namespaces only)."""
        return []


class LoopbackNetwork(Network):
    """Every host on its own 127.x address in this namespace; network faults refused."""

    kind = "loopback"

    def __init__(self, hosts: Sequence[str], why: str) -> None:
        super().__init__(hosts)
        self.addresses = {host: f"127.213.0.{10 + i}" for i, host in enumerate(self.hosts)}
        for fault in NETWORK_FAULTS:
            self.unavailable[fault] = (
                f"{fault}: needs network namespaces, which could not be created ({why})"
            )


def namespace_name(owner: int, host: str) -> str:
    return f"{NS_PREFIX}{owner}-{host}"


class NamespaceNetwork(Network):
    """One namespace per host plus a hub namespace holding the bridge."""

    kind = "netns"

    def __init__(self, hosts: Sequence[str], subnet: str = "10.213.0.0/24") -> None:
        super().__init__(hosts)
        self.owner = os.getpid()
        self.hub = namespace_name(self.owner, "hub")
        self.subnet = ipaddress.ip_network(subnet)
        base = self.subnet.network_address
        self.addresses = {host: str(base + 10 + i) for i, host in enumerate(self.hosts)}
        self._ports = {host: f"pc{self.owner}h{i}" for i, host in enumerate(self.hosts)}
        self._created: list[str] = []
        self._down: set[str] = set()
        self._blocked: set[tuple[str, str]] = set()
        self._slowed: set[str] = set()
        if not _has_tbf():
            self.unavailable["slow"] = "slow: the kernel has no tbf qdisc (and no netem)"

    def ns(self, host: str) -> str:
        return namespace_name(self.owner, host)

    def create(self) -> None:
        prefix = self.subnet.prefixlen
        _ip("ip", "netns", "add", self.hub)
        self._created.append(self.hub)
        _ip("ip", "-n", self.hub, "link", "set", "lo", "up")
        _ip("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("ip", "-n", self.hub, "link", "set", "br0", "up")
        for host in self.hosts:
            ns, port = self.ns(host), self._ports[host]
            _ip("ip", "netns", "add", ns)
            self._created.append(ns)
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
            # Both ends are created inside namespaces: the machine's own gets no interface.
            _ip("ip", "-n", self.hub, "link", "add", port, "type", "veth",
                "peer", "name", "eth0", "netns", ns)  # fmt: skip
            _ip("ip", "-n", ns, "addr", "add", f"{self.addresses[host]}/{prefix}", "dev", "eth0")
            _ip("ip", "-n", ns, "link", "set", "eth0", "up")
            _ip("ip", "-n", self.hub, "link", "set", port, "master", "br0")
            _ip("ip", "-n", self.hub, "link", "set", port, "up")
        log.info("chaos_network_created", hub=self.hub, addresses=self.addresses)

    def command_prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns(host)]

    def link_down(self, host: str) -> None:
        _ip("ip", "-n", self.hub, "link", "set", self._ports[host], "down")
        self._down.add(host)

    def link_up(self, host: str) -> None:
        _ip("ip", "-n", self.hub, "link", "set", self._ports[host], "up")
        self._down.discard(host)

    def block_oneway(self, source: str, target: str) -> None:
        _ip("ip", "-n", self.ns(source), "route", "add", "blackhole",
            f"{self.addresses[target]}/32")  # fmt: skip
        self._blocked.add((source, target))

    def unblock_oneway(self, source: str, target: str) -> None:
        _ip("ip", "-n", self.ns(source), "route", "del", "blackhole",
            f"{self.addresses[target]}/32")  # fmt: skip
        self._blocked.discard((source, target))

    def slow(self, host: str) -> None:
        if not self.can("slow"):
            raise NetworkError(self.unavailable["slow"])
        tbf = ["root", "tbf", "rate", SLOW_RATE, "burst", "16kbit", "latency", "2s"]
        _ip("tc", "-n", self.ns(host), "qdisc", "add", "dev", "eth0", *tbf)
        _ip("tc", "-n", self.hub, "qdisc", "add", "dev", self._ports[host], *tbf)
        self._slowed.add(host)

    def unslow(self, host: str) -> None:
        _ip("tc", "-n", self.ns(host), "qdisc", "del", "dev", "eth0", "root", check=False)
        _ip("tc", "-n", self.hub, "qdisc", "del", "dev", self._ports[host], "root", check=False)
        self._slowed.discard(host)

    def heal(self) -> None:
        for host in sorted(self._down):
            self.link_up(host)
        for source, target in sorted(self._blocked):
            self.unblock_oneway(source, target)
        for host in sorted(self._slowed):
            self.unslow(host)

    def processes_inside(self) -> list[int]:
        pids: list[int] = []
        for ns in self._created:
            result = _ip("ip", "netns", "pids", ns, check=False)
            pids.extend(int(p) for p in result.stdout.split() if p.isdigit())
        return pids

    def close(self) -> None:
        for ns in reversed(self._created):
            _ip("ip", "netns", "del", ns, check=False)
        self._created.clear()


def _has_tbf() -> bool:
    """Whether the kernel has the tbf qdisc (tried on a throwaway namespace's loopback)."""
    probe = namespace_name(os.getpid(), "probe")
    if _ip("ip", "netns", "add", probe, check=False).returncode != 0:
        return False
    try:
        added = _ip("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                    "1mbit", "burst", "16kbit", "latency", "100ms", check=False)  # fmt: skip
        return added.returncode == 0
    finally:
        _ip("ip", "netns", "del", probe, check=False)


def remove_leftovers() -> list[str]:
    """Delete namespaces (and kill what runs in them) left by chaos runs whose process died."""
    listed = _ip("ip", "netns", "list", check=False)
    removed = []
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(NS_PREFIX):
            continue
        owner = name[len(NS_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and _alive(int(owner)):
            continue
        for pid in _ip("ip", "netns", "pids", name, check=False).stdout.split():
            if pid.isdigit():
                kill_pid(int(pid))
        _ip("ip", "netns", "del", name, check=False)
        removed.append(name)
    return removed


def remove_owned() -> None:
    """Kill what runs in this process's namespaces and delete them (the last-resort cleanup
    when a run is interrupted before its own teardown ran)."""
    listed = _ip("ip", "netns", "list", check=False)
    mine = namespace_name(os.getpid(), "")
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(mine):
            for pid in _ip("ip", "netns", "pids", name, check=False).stdout.split():
                if pid.isdigit():
                    kill_pid(int(pid))
            _ip("ip", "netns", "del", name, check=False)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_pid(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


def open_network(hosts: Sequence[str], want_namespaces: bool = True) -> Network:
    """Namespaces when this process may create them, else loopback with the reason."""
    if not want_namespaces:
        return LoopbackNetwork(hosts, "loopback was asked for (--loopback)")
    remove_leftovers()
    network = NamespaceNetwork(hosts)
    try:
        network.create()
    except (NetworkError, FileNotFoundError, subprocess.TimeoutExpired) as exc:
        network.close()
        return LoopbackNetwork(hosts, str(exc))
    return network
