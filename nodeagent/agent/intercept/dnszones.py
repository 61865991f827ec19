"""DNS by zone: which intercepted DNS queries go to the cloud-side resolver.

A udp intercept rule with `dns_zones` sends a query through the tunnel when the name it
asks lies in one of the zones (like `sshuttle --dns`, but per zone); anything else,
including what does not parse as a DNS query, goes where the pod sent it. The message is
read with dnslib, never by hand.
"""

from __future__ import annotations

from dnslib import DNSError, DNSRecord


def in_zones(query: bytes, zones: tuple[str, ...]) -> bool:
    """Whether `query` is a DNS query whose first question's name is one of `zones`
    (lower-case, with the trailing dot) or below one."""
    try:
        record = DNSRecord.parse(query)
    except (DNSError, ValueError, IndexError, UnicodeDecodeError):
        return False
    if record.header.qr or not record.questions:
        return False
    name = str(record.q.qname).lower()
    if not name.endswith("."):
        name += "."
    return any(name == zone or name.endswith("." + zone) for zone in zones)
