"""What an IP address stands for: `addresses_meant(host)` gives the address itself and
every IPv4 address it embeds, so that the protected floor and the node-ownership (relay)
check judge the same set and cannot disagree.

An IPv6 address can carry an IPv4 one that a dial reaches in the end: the kernel itself
dials the IPv4 address of `::ffff:a.b.c.d` (IPv4-mapped). A check that looks at the IPv6
address alone lets `::ffff:10.244.1.5` past the owner of 10.244.1.5.
"""

from __future__ import annotations

import functools
import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@functools.lru_cache(maxsize=4096)
def addresses_meant(host: str) -> tuple[IPAddress, ...]:
    """Every address a dial to `host` may reach: the address, then the IPv4 address it
    embeds (see the module docstring). Empty for a name (its resolved addresses are
    checked one by one)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return ()
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return (address, address.ipv4_mapped)
    return (address,)


__all__ = ["IPAddress", "addresses_meant"]
