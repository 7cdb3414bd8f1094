"""Hosts for a chaos run: one network namespace per host, all joined by veth pairs to a bridge
that lives in a hub namespace of its own, so nothing is added to the machine's own namespace and
no host has a route anywhere but the run's private /24 and its own loopback.

Faults the kernel here can inject (checked at start, see :data:`FAULT_MEANS`):

* partition: the host's port on the bridge goes down (both directions), then up;
* one-way (A -> B): A cannot reach B while B still reaches A. On the bridge's port towards B an
  ``htb`` qdisc classifies with ``u32`` filters: a packet from A whose source port is one A
  listens on (a reply on a connection B opened) passes; every other packet from A goes to a
  class whose ``pfifo limit 0`` drops it, silently. So A's connections to B (new ones: the SYN;
  open ones: every segment) go nowhere and time out, with no local error on A, while B's
  connections to A carry data both ways. The listening ports are A's as of the fault's start: a
  listener A opens during the fault (an engine rotation) is not let through. There is no
  iptables, nft or tc action here to track connections, so the filter is stateless;
* slow link: a ``tbf`` token bucket (rate limit) on both ends of the host's veth. ``netem``
  (delay, loss) is not available in this kernel, so there is no added latency or loss.

Where namespaces cannot be created (no privilege, or no ``ip`` on PATH),
:class:`LoopbackNetwork` puts every host on its own 127.x address in the machine's namespace and
refuses the network faults, saying why; without ``tc`` (or the qdiscs above) ``slow`` and
``oneway`` are refused the same way.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Sequence

import structlog

log = structlog.get_logger("pdflow.chaos.net")

NETWORK_FAULTS = ("partition", "oneway", "slow")
NS_PREFIX = "pdchaos"
SLOW_RATE = "384kbit"
FAULT_MEANS = {
    "partition": "ip link set <host port on the bridge> down/up",
    "oneway": "tc htb + u32 on the bridge port towards the peer: the sender's packets dropped "
              "(pfifo limit 0) but replies from its listening ports, so the sender cannot reach "
              "the peer and the peer still reaches the sender",
    "slow": f"tc qdisc tbf rate {SLOW_RATE} on both ends of the host's veth (no netem here)",
}  # fmt: skip
IP_MISSING = ("`ip` (iproute2) is not on PATH: install iproute2 (apt-get install iproute2) to "
              "run on namespaces, or pass --loopback")  # fmt: skip
TC_MISSING = ("`tc` (iproute2) is not on PATH: install iproute2, or leave slow and oneway out "
              "of --nemesis")  # fmt: skip


class NetworkError(RuntimeError):
    """A namespace, link or qdisc command failed."""


def have(tool: str) -> bool:
    """Whether ``tool`` is on PATH (``ip`` and ``tc`` are looked up once per run, not assumed)."""
    return shutil.which(tool) is not None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(list(args), capture_output=True, text=True, timeout=20)
    except FileNotFoundError:
        raise NetworkError(IP_MISSING if args[0] == "ip" else
                           TC_MISSING if args[0] == "tc" else
                           f"`{args[0]}` is not on PATH") from None  # fmt: skip
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
        if not have("tc"):
            self.unavailable["slow"] = f"slow: {TC_MISSING}"
            self.unavailable["oneway"] = f"oneway: {TC_MISSING}"
        else:
            self.unavailable.update(_probe_qdiscs())

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

    def listening_ports(self, host: str) -> list[int]:
        """The TCP ports something listens on in ``host``'s namespace, now."""
        shown = _ip("ip", "netns", "exec", self.ns(host), "cat", "/proc/net/tcp",
                    "/proc/net/tcp6", check=False)  # fmt: skip
        if not shown.stdout.strip():
            raise NetworkError(f"could not read {host}'s listening ports: {shown.stderr.strip()}")
        return listening_ports(shown.stdout)

    def block_oneway(self, source: str, target: str) -> None:
        if not self.can("oneway"):
            raise NetworkError(self.unavailable["oneway"])
        port = self._ports[target]  # the bridge's port towards the target: what it receives
        commands = oneway_commands(self.hub, port, self.addresses[source],
                                   self.listening_ports(source))  # fmt: skip
        try:
            for command in commands:
                _ip(*command)
        except NetworkError:
            _ip("tc", "-n", self.hub, "qdisc", "del", "dev", port, "root", check=False)
            raise
        self._blocked.add((source, target))

    def unblock_oneway(self, source: str, target: str) -> None:
        _ip("tc", "-n", self.hub, "qdisc", "del", "dev", self._ports[target], "root")
        self._blocked.discard((source, target))

    def slow(self, host: str) -> None:
        if not self.can("slow"):
            raise NetworkError(self.unavailable["slow"])
        tbf = ["root", "tbf", "rate", SLOW_RATE, "burst", "16kbit", "latency", "2s"]
        try:
            _ip("tc", "-n", self.ns(host), "qdisc", "add", "dev", "eth0", *tbf)
            _ip("tc", "-n", self.hub, "qdisc", "add", "dev", self._ports[host], *tbf)
        except NetworkError:
            self._unslow(host, check=False)
            raise
        self._slowed.add(host)

    def unslow(self, host: str) -> None:
        self._unslow(host, check=True)
        self._slowed.discard(host)

    def _unslow(self, host: str, check: bool) -> None:
        ends = [("-n", self.ns(host), "eth0"), ("-n", self.hub, self._ports[host])]
        failed = [_ip("tc", flag, ns, "qdisc", "del", "dev", dev, "root", check=False)
                  for flag, ns, dev in ends]  # fmt: skip
        errors = [r.stderr.strip() for r in failed if r.returncode != 0]
        if check and errors:
            raise NetworkError(f"removing the slow link of {host} failed: {'; '.join(errors)}")

    def heal(self) -> None:
        """Undo every fault still in place; raises once, after trying them all, if any failed."""
        undo: list[Callable[[], None]] = [
            *(functools.partial(self.link_up, h) for h in sorted(self._down)),
            *(functools.partial(self.unblock_oneway, *pair) for pair in sorted(self._blocked)),
            *(functools.partial(self.unslow, h) for h in sorted(self._slowed)),
        ]
        errors = []
        for step in undo:
            try:
                step()
            except NetworkError as exc:
                errors.append(str(exc))
        if errors:
            raise NetworkError("healing the network failed: " + "; ".join(errors))

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


def listening_ports(proc_net_tcp: str) -> list[int]:
    """The local ports of the LISTEN sockets (state ``0A``) in ``/proc/net/tcp``-style text."""
    ports = set()
    for line in proc_net_tcp.splitlines():
        fields = line.split()
        if len(fields) > 3 and fields[3] == "0A" and ":" in fields[1]:
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return sorted(ports)


def oneway_commands(ns: str, port: str, source: str, allowed: Sequence[int]) -> list[list[str]]:
    """``tc`` commands (in namespace ``ns``, on ``port``) dropping what ``source`` sends out of
    ``port`` except TCP from the ``allowed`` source ports (replies on connections the other
    side opened)."""
    tc = ["tc", "-n", ns]
    rate = ["htb", "rate", "10gbit", "quantum", "60000"]
    commands = [
        [*tc, "qdisc", "add", "dev", port, "root", "handle", "1:", "htb", "default", "10"],
        [*tc, "class", "add", "dev", port, "parent", "1:", "classid", "1:10", *rate],
        [*tc, "class", "add", "dev", port, "parent", "1:", "classid", "1:20", *rate],
        [*tc, "qdisc", "add", "dev", port, "parent", "1:20", "handle", "20:", "pfifo", "limit",
         "0"],
    ]  # fmt: skip
    match = [*tc, "filter", "add", "dev", port, "parent", "1:", "protocol", "ip"]
    for allowed_port in allowed:
        commands.append([*match, "prio", "1", "u32", "match", "ip", "src", f"{source}/32",
                         "match", "ip", "protocol", "6", "0xff", "match", "ip", "sport",
                         str(allowed_port), "0xffff", "flowid", "1:10"])  # fmt: skip
    commands.append([*match, "prio", "2", "u32", "match", "ip", "src", f"{source}/32",
                     "flowid", "1:20"])  # fmt: skip
    return commands


def _probe_qdiscs() -> dict[str, str]:
    """The network faults this kernel cannot make, with why: ``slow`` needs ``tbf``, ``oneway``
    ``htb``, ``pfifo`` and the ``u32`` classifier (tried on a throwaway namespace's loopback)."""
    probe = namespace_name(os.getpid(), "probe")
    added = _ip("ip", "netns", "add", probe, check=False)
    if added.returncode != 0:
        why = f"could not create a namespace to probe qdiscs: {added.stderr.strip()}"
        return {"slow": f"slow: {why}", "oneway": f"oneway: {why}"}
    missing = {}
    try:
        tbf = _ip("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
                  "1mbit", "burst", "16kbit", "latency", "100ms", check=False)  # fmt: skip
        if tbf.returncode != 0:
            missing["slow"] = f"slow: the kernel has no tbf qdisc (and no netem): {tbf.stderr}"
        _ip("tc", "-n", probe, "qdisc", "del", "dev", "lo", "root", check=False)
        for command in oneway_commands(probe, "lo", "127.0.0.2", [1]):
            tried = _ip(*command, check=False)
            if tried.returncode != 0:
                missing["oneway"] = (f"oneway: `{' '.join(command[3:])}` failed here: "
                                     f"{tried.stderr.strip()}")  # fmt: skip
                break
    finally:
        _ip("ip", "netns", "del", probe, check=False)
    return missing


def remove_leftovers() -> list[str]:
    """Delete namespaces (and kill what runs in them) left by chaos runs whose process died."""
    if not have("ip"):
        return []  # no namespaces without iproute2, so none left behind
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
    if not have("ip"):
        return
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
    if not have("ip"):
        return LoopbackNetwork(hosts, IP_MISSING)
    remove_leftovers()
    network = NamespaceNetwork(hosts)
    try:
        network.create()
    except (NetworkError, subprocess.TimeoutExpired) as exc:
        network.close()
        return LoopbackNetwork(hosts, str(exc))
    return network
