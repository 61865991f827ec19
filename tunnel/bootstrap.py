"""How many bootstrap connections may be open, in all and per source address: pure.

A bootstrap connection (tunnel.server.Bootstrap) is anonymous: anyone who can reach the
server may open one. A cap in all alone lets one client hold every slot, and no new agent
enrolls; so each source address also gets a few (`max_per_source`), and the server holds
each connection only as long as one certificate request takes (tunnel.server).

Addresses are counted by `source_of`: an IPv4 address is itself, an IPv6 address counts
by its /64 (the smallest block one host or site gets, so a client cannot escape the cap
by cycling through its own prefix). Behind a load balancer or proxy that hides client
addresses every dialer has the same source: there, turn the per-source cap off (None).
"""

from __future__ import annotations

import ipaddress
from enum import Enum


def source_of(address: str) -> str:
    """Whom a connection from `address` ("host:port", "[v6]:port", or a bare host) counts
    against."""
    host = address
    if host.startswith("["):
        host = host[1:].partition("]")[0]
    elif host.count(":") == 1:
        host = host.partition(":")[0]
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host  # not an address (a Unix socket, a test's name): itself
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class BootstrapRefusal(Enum):
    """Why a bootstrap connection got no slot (the value is the refusal's metric label)."""

    FULL = "bootstrap_full"  # max_total open in all
    PER_SOURCE = "bootstrap_per_address"  # max_per_source open from this source


class BootstrapSlots:
    """The bootstrap connections open now: `take(source)` before serving one (None, or
    why not), `give_back(source)` when it ends."""

    def __init__(self, max_total: int, max_per_source: int | None) -> None:
        if max_total < 0 or (max_per_source is not None and max_per_source < 1):
            raise ValueError("need max_total >= 0 and max_per_source >= 1 (or None)")
        self.max_total = max_total
        self.max_per_source = max_per_source
        self.total = 0
        self._by_source: dict[str, int] = {}  # a source goes when its count is back to 0

    def take(self, source: str) -> BootstrapRefusal | None:
        held = self._by_source.get(source, 0)
        if self.max_per_source is not None and held >= self.max_per_source:
            return BootstrapRefusal.PER_SOURCE
        if self.total >= self.max_total:
            return BootstrapRefusal.FULL
        self._by_source[source] = held + 1
        self.total += 1
        return None

    def give_back(self, source: str) -> None:
        held = self._by_source.get(source, 0)
        if held <= 0:
            raise ValueError(f"no bootstrap slot held for {source}")
        if held == 1:
            del self._by_source[source]
        else:
            self._by_source[source] = held - 1
        self.total -= 1

    def held_by(self, source: str) -> int:
        return self._by_source.get(source, 0)
