"""Network namespaces and veth links for tests and benchmarks.

Tests that touch the kernel build their own little network here: each namespace is a
"host" (pod, node, cloud, remote, ...), joined by veth pairs. Names carry a random
suffix so parallel or crashed runs never collide, and everything is deleted on exit.
Only root can do this; `netns_available()` says why not when it cannot.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field


def netns_available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs iproute2 (the `ip` command)"
    return None


def run(args: Sequence[str], *, ns: str | None = None, check: bool = True,
        input: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = list(args)
    if ns is not None:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, input=input)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@dataclass
class Topology:
    """A set of namespaces joined by veth links, torn down by `close()`."""

    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    namespaces: dict[str, str] = field(default_factory=dict)  # short name -> real ns name
    _links: int = 0

    def ns(self, name: str) -> str:
        return self.namespaces[name]

    def add(self, name: str) -> str:
        real = f"na-{name}-{self.tag}"
        run(["ip", "netns", "add", real])
        self.namespaces[name] = real
        run(["ip", "link", "set", "lo", "up"], ns=real)
        return real

    def link(self, a: str, a_addrs: Sequence[str], b: str, b_addrs: Sequence[str],
             *, forward: bool = True) -> tuple[str, str]:
        """Join namespaces a and b with a veth pair; addresses are CIDRs like 10.1.0.1/24.

        Returns the interface names (in a, in b). IPv6 addresses get `nodad` so they are
        usable at once.
        """
        self._links += 1
        ifa = f"v{self._links}{a[:5]}"[:15]
        ifb = f"v{self._links}{b[:5]}"[:15]
        tmp_a, tmp_b = f"t{self.tag}a{self._links}"[:15], f"t{self.tag}b{self._links}"[:15]
        run(["ip", "link", "add", tmp_a, "type", "veth", "peer", "name", tmp_b])
        run(["ip", "link", "set", tmp_a, "netns", self.ns(a), "name", ifa])
        run(["ip", "link", "set", tmp_b, "netns", self.ns(b), "name", ifb])
        for ns, ifname, addrs in ((a, ifa, a_addrs), (b, ifb, b_addrs)):
            for addr in addrs:
                extra = ["nodad"] if ":" in addr else []
                run(["ip", "addr", "add", addr, "dev", ifname, *extra], ns=self.ns(ns))
            run(["ip", "link", "set", ifname, "up"], ns=self.ns(ns))
            if forward:
                run(["sysctl", "-qw", "net.ipv4.ip_forward=1"], ns=self.ns(ns))
                run(["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"], ns=self.ns(ns))
        return ifa, ifb

    def route(self, ns: str, dest: str, via: str) -> None:
        run(["ip", "route", "replace", dest, "via", via], ns=self.ns(ns))

    def exec(self, ns: str, args: Sequence[str], check: bool = True,
             input: str | None = None) -> subprocess.CompletedProcess[str]:
        return run(args, ns=self.ns(ns), check=check, input=input)

    def popen(self, ns: str, args: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        proc: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            ["ip", "netns", "exec", self.ns(ns), *args], **kwargs)
        return proc

    def close(self) -> None:
        for real in self.namespaces.values():
            run(["ip", "netns", "pids", real], check=False)
            # Kill anything still running inside, then delete; deleting the namespace
            # removes its veth ends as well.
            pids = run(["ip", "netns", "pids", real], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            run(["ip", "netns", "del", real], check=False)
        self.namespaces.clear()


@contextmanager
def topology() -> Iterator[Topology]:
    topo = Topology()
    try:
        yield topo
    finally:
        topo.close()


_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    # os.setns exists only from Python 3.12; the project supports 3.11, so call libc.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


@contextmanager
def in_netns(real_name: str) -> Iterator[None]:
    """Run the body with this thread's network namespace switched (sockets made inside
    belong to that namespace and keep it after switching back)."""
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{real_name}", os.O_RDONLY)
    try:
        _setns(target)
        yield
    finally:
        _setns(own)
        os.close(own)
        os.close(target)


@dataclass
class NftBalancer:
    """An L4 load balancer in one namespace, as a cloud LB or kube-proxy builds it: for
    each frontend port, `dnat to numgen inc mod N map @backends` (round robin over N
    slots), the slots filled by `set_backends` in one nft transaction. Connections already
    set up keep their backend (conntrack), as with a Service endpoint removed."""

    topo: Topology
    ns: str  # the Topology's short name of its namespace
    ports: dict[str, tuple[int, int]]  # map name -> (frontend port, backend port)
    slots: int = 2

    def install(self) -> None:
        maps = "".join(f"  map {name} {{ typeof numgen inc mod {self.slots} : ip daddr; }}\n"
                       for name in self.ports)
        rules = "".join(f"    tcp dport {front} dnat to numgen inc mod {self.slots} "
                        f"map @{name}:{back}\n" for name, (front, back) in self.ports.items())
        self.topo.exec(self.ns, ["nft", "-f", "-"], input=(
            f"table ip balancer {{\n{maps}  chain pre {{\n    type nat hook prerouting "
            f"priority dstnat; policy accept;\n{rules}  }}\n}}\n"))

    def set_backends(self, name: str, addresses: Sequence[str]) -> None:
        """Round robin over `addresses` (the slots cycle through them); none: the map is
        empty and connections reach the balancer itself, which refuses them."""
        lines = [f"flush map ip balancer {name}"]
        if addresses:
            elements = ", ".join(f"{i} : {addresses[i % len(addresses)]}"
                                 for i in range(self.slots))
            lines.append(f"add element ip balancer {name} {{ {elements} }}")
        self.topo.exec(self.ns, ["nft", "-f", "-"], input="\n".join(lines) + "\n")
