"""Socket options the transparent proxy needs, on plain `socket.socket` objects.

Python's socket module does not name these Linux options, so the numbers are spelled
out here (from linux/in.h, linux/in6.h, linux/netfilter_ipv4.h, asm-generic/socket.h).
All helpers are synchronous and tiny. The option helpers take anything with the stdlib
socket's getsockopt/setsockopt/getsockname/family (`SocketLike`), which trio's sockets
have too, so the agent can pass its trio sockets directly.
"""

from __future__ import annotations

import socket
import struct
from typing import Any, Protocol

from netfilter.model import NetfilterError

SOL_IP = 0
SOL_IPV6 = 41
SO_MARK = 36
SO_ORIGINAL_DST = 80  # IPv4, level SOL_IP
IP6T_SO_ORIGINAL_DST = 80  # IPv6, level SOL_IPV6
IP_TRANSPARENT = 19
IPV6_TRANSPARENT = 75
IP_RECVORIGDSTADDR = 20  # also the cmsg type (IP_ORIGDSTADDR)
IPV6_RECVORIGDSTADDR = 74  # also the cmsg type (IPV6_ORIGDSTADDR)

_SOCKADDR_IN = 16
_SOCKADDR_IN6 = 28

Address = tuple[str, int, socket.AddressFamily]


class SocketLike(Protocol):
    @property
    def family(self) -> int: ...

    def getsockname(self) -> Any: ...

    def getsockopt(self, level: int, optname: int, buflen: int, /) -> bytes: ...

    def setsockopt(self, level: int, optname: int, value: int, /) -> None: ...


def _parse_sockaddr(raw: bytes) -> Address:
    family = struct.unpack_from("=H", raw)[0]
    port = struct.unpack_from("!H", raw, 2)[0]
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[4:8]), port, socket.AF_INET
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, raw[8:24]), port, socket.AF_INET6
    raise NetfilterError(f"unexpected address family {family} in sockaddr")


def original_dst(sock: SocketLike) -> Address:
    """The destination a REDIRECT'ed TCP connection was really addressed to.

    Conntrack keeps the pre-NAT tuple; SO_ORIGINAL_DST / IP6T_SO_ORIGINAL_DST read it.
    Raises OSError (ENOENT) for a connection that was not NAT'ed.
    """
    if sock.family == socket.AF_INET6:
        raw = sock.getsockopt(SOL_IPV6, IP6T_SO_ORIGINAL_DST, _SOCKADDR_IN6)
    else:
        raw = sock.getsockopt(SOL_IP, SO_ORIGINAL_DST, _SOCKADDR_IN)
    return _parse_sockaddr(raw)


def _local(sock: SocketLike) -> Address:
    name = sock.getsockname()
    return str(name[0]), int(name[1]), socket.AddressFamily(sock.family)


def intercepted_destination(sock: SocketLike, listen_port: int) -> Address:
    """Where an accepted, intercepted connection was going, whichever way it came in.

    A TPROXY'd connection keeps its destination, so its local address IS the target
    (and after a kube-proxy DNAT, that is the post-DNAT endpoint, which is what we want).
    A REDIRECT'ed one was NAT'ed to our listening port, so its local port is
    `listen_port` and SO_ORIGINAL_DST has the target. The ambiguous case — a TPROXY'd
    connection whose real destination port equals `listen_port` — is told apart by
    asking conntrack: it has no NAT record for it (ENOENT).
    """
    local = _local(sock)
    if local[1] != listen_port:
        return local
    try:
        return original_dst(sock)
    except OSError:
        return local


def set_mark(sock: SocketLike, mark: int) -> None:
    """Put `mark` on everything this socket sends (the rules skip it). Needs CAP_NET_ADMIN."""
    sock.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)


def set_transparent(sock: SocketLike, family: int | None = None) -> None:
    """Let the socket accept TPROXY'd traffic / bind non-local addresses (CAP_NET_ADMIN).

    Call before bind(). An AF_INET6 socket gets both options so a dual-stack listener
    also takes IPv4-mapped traffic.
    """
    fam = family if family is not None else sock.family
    if fam == socket.AF_INET6:
        sock.setsockopt(SOL_IPV6, IPV6_TRANSPARENT, 1)
        try:
            sock.setsockopt(SOL_IP, IP_TRANSPARENT, 1)
        except OSError:
            pass  # v6-only socket: the IPv4 option does not apply
    else:
        sock.setsockopt(SOL_IP, IP_TRANSPARENT, 1)


def enable_recv_original_dst(sock: SocketLike) -> None:
    """For a TPROXY UDP socket: ask for each datagram's original destination (cmsg)."""
    if sock.family == socket.AF_INET6:
        sock.setsockopt(SOL_IPV6, IPV6_RECVORIGDSTADDR, 1)
    else:
        sock.setsockopt(SOL_IP, IP_RECVORIGDSTADDR, 1)


def recv_with_original_dst(
    sock: socket.socket, bufsize: int = 65535
) -> tuple[bytes, Address, Address]:
    """One datagram from a TPROXY UDP socket: (data, source, original destination).

    The socket needs enable_recv_original_dst(); a datagram without the ancillary
    record (not TPROXY'd) reports the socket's own address as destination.
    """
    data, ancdata, _flags, src = sock.recvmsg(bufsize, socket.CMSG_SPACE(_SOCKADDR_IN6))
    dst: Address | None = None
    for level, ctype, cdata in ancdata:
        if (level, ctype) in ((SOL_IP, IP_RECVORIGDSTADDR), (SOL_IPV6, IPV6_RECVORIGDSTADDR)):
            dst = _parse_sockaddr(cdata)
    source: Address = (str(src[0]), int(src[1]), socket.AddressFamily(sock.family))
    return data, source, dst if dst is not None else _local(sock)


def transparent_udp_reply_socket(original: Address) -> socket.socket:
    """A UDP socket bound to a TPROXY'd datagram's original destination, for replies.

    The client expects the answer to come from the address it sent to, which is not
    ours; IP_TRANSPARENT lets us bind it. SO_REUSEADDR lets several clients' replies
    share that address while the TPROXY listener keeps receiving.
    """
    host, port, family = original
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        set_transparent(sock, family)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
