"""What an IP address stands for: `addresses_meant(host)` gives the address itself and
every IPv4 address it embeds, so that the protected floor and the node-ownership (relay)
check judge the same set and cannot disagree.

An IPv6 address can carry an IPv4 one that a dial reaches in the end: the kernel itself
dials the IPv4 address of `::ffff:a.b.c.d` (IPv4-mapped); a NAT64 gateway translates the
well-known prefix `64:ff9b::/96` and the local-use `64:ff9b:1::/48` (RFC 6052, RFC 8215);
6to4 `2002::/16` and Teredo `2001::/32` relays tunnel to the IPv4 addresses in them; the
deprecated IPv4-compatible `::a.b.c.d` and IPv4-translated `::ffff:0:a.b.c.d` forms are
the same address to some stacks. A check that looks at the IPv6 address alone lets
`64:ff9b::a9fe:a9fe` through to 169.254.169.254. A NAT64 network-specific prefix an
operator picked is not knowable here: a CIDR egress rule for it is the operator's choice.
"""

from __future__ import annotations

import functools
import ipaddress

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")
_NAT64_LOCAL_USE = ipaddress.IPv6Network("64:ff9b:1::/48")
_SIX_TO_FOUR = ipaddress.IPv6Network("2002::/16")
_TEREDO = ipaddress.IPv6Network("2001::/32")
_IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
_IPV4_TRANSLATED = ipaddress.IPv6Network("::ffff:0:0:0/96")


def _nat64_local_use(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 address at each place RFC 6052 allows for a prefix inside 64:ff9b:1::/48
    (lengths 48, 56, 64 and 96; bits 64-71, the "u" octet, are skipped). Which length
    the network uses is not in the address, so every candidate counts."""
    raw = address.packed
    return [ipaddress.IPv4Address(bytes(b)) for b in (
        raw[6:8] + raw[9:11],    # /48
        raw[7:8] + raw[9:12],    # /56
        raw[9:13],               # /64
        raw[12:16],              # /96
    )]


@functools.lru_cache(maxsize=4096)
def addresses_meant(host: str) -> tuple[IPAddress, ...]:
    """Every address a dial to `host` may reach: the address, then the IPv4 addresses it
    embeds (see the module docstring). Empty for a name (its resolved addresses are
    checked one by one)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return ()
    if isinstance(address, ipaddress.IPv4Address):
        return (address,)
    embedded: list[ipaddress.IPv4Address] = []
    if address.ipv4_mapped is not None:
        embedded.append(address.ipv4_mapped)
    elif address in _NAT64_WELL_KNOWN or address in _IPV4_COMPATIBLE or (
            address in _IPV4_TRANSLATED):
        embedded.append(ipaddress.IPv4Address(address.packed[12:]))
    elif address in _NAT64_LOCAL_USE:
        embedded.extend(_nat64_local_use(address))
    elif address.sixtofour is not None:
        embedded.append(address.sixtofour)
    elif address.teredo is not None:
        embedded.extend(address.teredo)  # (server, client): the client's de-obfuscated
    return (address, *dict.fromkeys(embedded))


__all__ = ["IPAddress", "addresses_meant"]
