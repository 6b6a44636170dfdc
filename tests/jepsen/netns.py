"""Network namespaces for the fault suite: one per node, joined to a bridge in the root namespace.

```
 root namespace (the test process: producers, consumer, observer)
   bridge jb<tag>  10.<a>.<b>.1/24
     |-- veth --> namespace jp<tag>-meta    eth0 10.<a>.<b>.2
     |-- veth --> namespace jp<tag>-n1      eth0 10.<a>.<b>.3
     `-- veth --> namespace jp<tag>-n2      eth0 10.<a>.<b>.4
```

Every name carries a tag drawn per run, so runs side by side never meet; `close()` deletes the
namespaces (which takes their veth ends with them) and the bridge, and is safe to call twice.

A partition between two namespaces is a blackhole route to the other's address on each side:
packets between them are dropped as on a cut cable (no reset, no ICMP), while both stay reachable
from the root namespace and from the other nodes. `isolate` cuts one node off from every other
node but leaves it reachable from the root namespace, as a producer on the far side of a network
split would see it.
"""
from __future__ import annotations

import ipaddress
import random
import re
import secrets
import shutil
import subprocess

import attrs


class NamespaceError(RuntimeError):
    """An `ip` command failed; the message has the command and what it printed."""


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", *(["-n", netns] if netns else []), *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise NamespaceError(f"{' '.join(command)}: {result.stderr.strip() or result.returncode}")
    return result


def unsupported_reason() -> str | None:
    """Why network namespaces cannot be used here, found by trying (None: they can)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"jpprobe{secrets.token_hex(3)}"
    try:
        ip("netns", "add", probe)
    except NamespaceError as e:
        return f"the kernel or this user may not create network namespaces: {e}"
    try:
        ip("link", "add", f"{probe}a", "type", "veth", "peer", "name", "eth0", "netns", probe)
        ip("link", "del", f"{probe}a")
    except NamespaceError as e:
        return f"veth pairs into a network namespace are refused: {e}"
    finally:
        ip("netns", "del", probe, check=False)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.64.0.0/10 that no interface of the root namespace uses."""
    used = [ipaddress.ip_interface(a).network for a in re.findall(r"inet (\S+)", ip("-4", "addr", "show").stdout)]
    rng = random.Random()
    for _ in range(100):
        net = ipaddress.ip_network(f"10.{rng.randint(64, 127)}.{rng.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise NamespaceError("no free 10.64.0.0/10 subnet for the bridge")


@attrs.define(eq=False)
class Network:
    tag: str = attrs.Factory(lambda: secrets.token_hex(3))
    subnet: ipaddress.IPv4Network | None = None
    addresses: dict[str, str] = attrs.Factory(dict)  # node name -> its address
    namespaces: dict[str, str] = attrs.Factory(dict)  # node name -> its namespace
    blackholes: set[tuple[str, str]] = attrs.Factory(set)  # (from node, to node)
    host_ends: list[str] = attrs.Factory(list)  # the root namespace's end of each veth pair
    _bridge_made: bool = False

    @property
    def bridge(self) -> str:
        return f"jb{self.tag}"

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)

    def open(self) -> Network:
        self.subnet = _free_subnet()
        ip("link", "add", self.bridge, "type", "bridge")
        self._bridge_made = True
        ip("addr", "add", f"{self.gateway}/{self.subnet.prefixlen}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        return self

    def add(self, name: str) -> str:
        """A namespace for node `name`, on the bridge; returns its address."""
        ns = f"jp{self.tag}-{name}"
        address = str(self.subnet.network_address + 2 + len(self.namespaces))
        ip("netns", "add", ns)
        self.namespaces[name] = ns
        host_end = f"jv{self.tag}{len(self.namespaces)}"
        ip("link", "add", host_end, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self.host_ends.append(host_end)
        ip("link", "set", host_end, "master", self.bridge, "up")
        ip("addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0", netns=ns)
        ip("link", "set", "eth0", "up", netns=ns)
        ip("link", "set", "lo", "up", netns=ns)
        self.addresses[name] = address
        return address

    def exec_prefix(self, name: str) -> list[str]:
        """The command prefix that runs a program in node `name`'s namespace (`ip netns exec`
        execs it, so the process id is the program's own)."""
        return ["ip", "netns", "exec", self.namespaces[name]]

    # --- faults -----------------------------------------------------------------------------------

    def partition(self, a: str, b: str) -> None:
        """Drop every packet between nodes `a` and `b`, both ways."""
        for src, dst in ((a, b), (b, a)):
            if (src, dst) not in self.blackholes:
                ip("route", "add", "blackhole", f"{self.addresses[dst]}/32", netns=self.namespaces[src])
                self.blackholes.add((src, dst))

    def isolate(self, name: str) -> None:
        """Cut node `name` off from every other node (the root namespace still reaches it)."""
        for other in self.namespaces:
            if other != name:
                self.partition(name, other)

    def heal(self) -> None:
        """End every partition."""
        for src, dst in sorted(self.blackholes):
            ip("route", "del", "blackhole", f"{self.addresses[dst]}/32", netns=self.namespaces[src], check=False)
        self.blackholes.clear()

    def close(self) -> None:
        # A veth pair goes with its namespace, but only some time later: delete it now.
        for host_end in self.host_ends:
            ip("link", "del", host_end, check=False)
        self.host_ends.clear()
        for ns in self.namespaces.values():
            ip("netns", "del", ns, check=False)
        self.namespaces.clear()
        if self._bridge_made:
            ip("link", "del", self.bridge, check=False)
            self._bridge_made = False

    def leftovers(self) -> list[str]:
        """Namespaces and links of this run still present (empty after `close`)."""
        names = ip("netns", "list").stdout.split() + ip("-o", "link", "show").stdout.split()
        return sorted({n.rstrip(":").split("@")[0] for n in names if self.tag in n})
