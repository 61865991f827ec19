"""PROXY protocol headers, sans-IO: bytes in, a `ProxyHeader` out, and back.

Written here rather than taken from PyPI: the one library (`proxy-protocol`, last release
2024) is built around asyncio readers, its v1 parser takes what the spec forbids
(`int()` ports such as " 80" or "+80", no 107-byte cap), and what the server needs is
small: build v1 and v2 for backends, parse v2 from a load balancer. Real peers check it
in tests/e2e/test_proxy_protocol.py (HAProxy sends v2 to the server, nginx parses what
the server sends).

v2 (section 2.2): a 12-byte signature, version/command, family/transport, a 16-bit
length, then the addresses and TLVs. Parsing is two steps so the reader never reads past
the header (no bytes of the client's own stream to put back): `v2_length(first 16)` says
how many bytes follow, `parse_v2(all of it)` gives the addresses. TLVs are skipped (the
spec lets a receiver ignore them). LOCAL (a load balancer's own health check) and
UNSPEC families carry no client address: the connection's own peer stands.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from typing import Literal

V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V2_HEADER_SIZE = 16  # signature, version/command, family/transport, length
# The largest address block we accept: IPv6 addresses (36) plus TLVs. HAProxy sends under
# 100 bytes of TLVs; 512 keeps what a peer makes us buffer small.
V2_MAX_LENGTH = 512
_COMMAND_LOCAL = 0x0
_COMMAND_PROXY = 0x1
_FAMILIES = {0x1: (4, 12), 0x2: (16, 36)}  # AF_INET, AF_INET6: address size, block size
_FAMILY_UNIX = 0x3  # AF_UNIX: no address an IP front can use
_STREAM = 0x1

Version = Literal["v1", "v2"]
Address = tuple[str, int]

# Why a header was refused: wire-independent reason codes for metrics and logs.
# `timeout` and `truncated` are the reader's (receive.py): no whole header in time, or
# the connection closed inside one.
Reason = Literal["bad_signature", "bad_version", "bad_command", "bad_family",
                 "bad_length", "bad_address", "timeout", "truncated"]


class ProxyHeaderError(Exception):
    """A header that is not PROXY v2 as the spec writes it."""

    def __init__(self, reason: Reason, detail: str) -> None:
        super().__init__(detail)
        self.reason: Reason = reason


@dataclass(frozen=True, slots=True)
class ProxyHeader:
    """What a header says: the client's address and the one it connected to; both None
    for LOCAL or UNSPEC (the connection speaks for itself)."""

    source: Address | None
    destination: Address | None


def v2_length(head: bytes) -> int:
    """How many bytes follow the 16 of `head` (the first bytes of a connection).
    Raises ProxyHeaderError when they are not a v2 header we take."""
    if len(head) != V2_HEADER_SIZE:
        raise ValueError(f"v2_length needs exactly {V2_HEADER_SIZE} bytes")
    if head[:12] != V2_SIGNATURE:
        raise ProxyHeaderError("bad_signature", "the connection did not start with a "
                                                "PROXY v2 signature")
    version, command = head[12] >> 4, head[12] & 0x0F
    if version != 2:
        raise ProxyHeaderError("bad_version", f"PROXY header version {version}, not 2")
    if command not in (_COMMAND_LOCAL, _COMMAND_PROXY):
        raise ProxyHeaderError("bad_command", f"PROXY v2 command {command:#x}")
    (length,) = struct.unpack_from("!H", head, 14)
    if length > V2_MAX_LENGTH:
        raise ProxyHeaderError("bad_length", f"PROXY v2 header of {length} bytes, over "
                                             f"{V2_MAX_LENGTH}")
    return int(length)


def parse_v2(data: bytes) -> ProxyHeader:
    """The header in `data`: exactly the 16 bytes and the `v2_length` that follow."""
    length = v2_length(data[:V2_HEADER_SIZE])
    if len(data) != V2_HEADER_SIZE + length:
        raise ValueError("parse_v2 needs exactly the header's bytes")
    if data[12] & 0x0F == _COMMAND_LOCAL:
        return ProxyHeader(None, None)  # the balancer's own connection (health checks)
    family, transport = data[13] >> 4, data[13] & 0x0F
    if family == 0 or family == _FAMILY_UNIX:
        return ProxyHeader(None, None)  # UNSPEC: "unknown"; a socket path means nothing here
    if family not in _FAMILIES or transport != _STREAM:
        raise ProxyHeaderError("bad_family", f"PROXY v2 family/transport {data[13]:#04x} "
                                             f"on a TCP listener")
    size, block = _FAMILIES[family]
    if length < block:
        raise ProxyHeaderError("bad_length", f"PROXY v2 addresses need {block} bytes, the "
                                             f"header has {length}")
    body = data[V2_HEADER_SIZE:]
    source = ipaddress.ip_address(body[:size])
    destination = ipaddress.ip_address(body[size:2 * size])
    source_port, destination_port = struct.unpack_from("!HH", body, 2 * size)
    return ProxyHeader((str(source), source_port), (str(destination), destination_port))


def build_header(version: Version, source: Address, destination: Address) -> bytes:
    """The header that tells a backend `source` connected to `destination` over TCP.
    Addresses are IP literals (an IPv4-mapped IPv6 address counts as IPv4); when one is
    IPv4 and the other IPv6, both are sent as IPv6 (a header has one family)."""
    src, dst = _ip(source[0]), _ip(destination[0])
    if src.version != dst.version:
        src, dst = _as_v6(src), _as_v6(dst)
    if version == "v1":
        family = "TCP4" if src.version == 4 else "TCP6"
        return (f"PROXY {family} {src} {dst} {source[1]} {destination[1]}\r\n"
                .encode("ascii"))
    family_code = 0x1 if src.version == 4 else 0x2
    body = src.packed + dst.packed + struct.pack("!HH", source[1], destination[1])
    return (V2_SIGNATURE + bytes([0x20 | _COMMAND_PROXY, family_code << 4 | _STREAM])
            + struct.pack("!H", len(body)) + body)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    try:
        address = ipaddress.ip_address(text.strip("[]").split("%", 1)[0])
    except ValueError:
        raise ProxyHeaderError("bad_address", f"{text!r} is not an IP address") from None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _as_v6(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv6Address:
    if isinstance(address, ipaddress.IPv6Address):
        return address
    return ipaddress.IPv6Address(f"::ffff:{address}")
