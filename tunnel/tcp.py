"""The one TCP dialer: the tunnel's own connection to the server (tunnel.dial), node-local
targets of streams (agent), direct backends and egress (server), and the transparent
proxy's direct dials.

Every address the name resolves to is tried in turn. Failures are `DialFailed`, whose
`reason` is the tunnel's refusal code (so the opener learns whether the target refused,
was unreachable or timed out: 502 vs 504 at the HTTP front) and whose `cause` is the
finer word a dialer's own logs and errors use (dns, refused, unreachable, timeout, mark),
with each address's error kept in `attempts`.
"""

from __future__ import annotations

import errno
import socket
from typing import Any, Literal

import trio

from tunnel.errors import StreamFailed
from tunnel.protocol import StreamReason

SO_MARK = getattr(socket, "SO_MARK", 36)
# TCP keepalive on every connection dialed here: a peer that vanished (host down, path
# gone, NAT state lost) is noticed by the kernel within 15 + 4 x 5 = 35 s of silence,
# with no work in this process. Go's dialer does the same by default (15 s).
KEEPALIVE_IDLE = 15
KEEPALIVE_INTERVAL = 5
KEEPALIVE_COUNT = 4
_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL, errno.ENETDOWN,
                errno.EHOSTDOWN}

DialCause = Literal["dns", "refused", "unreachable", "timeout", "mark"]
_REASONS: dict[DialCause, StreamReason] = {
    "dns": StreamReason.UNREACHABLE, "refused": StreamReason.REFUSED,
    "unreachable": StreamReason.UNREACHABLE, "timeout": StreamReason.TIMEOUT,
    "mark": StreamReason.INTERNAL,
}


class DialFailed(StreamFailed):
    """Connecting to the target failed; `cause` says how, `attempts` per address."""

    def __init__(self, cause: DialCause, message: str, *,
                 attempts: tuple[tuple[str, OSError], ...] = ()) -> None:
        super().__init__(_REASONS[cause], message)
        self.cause = cause
        self.attempts = attempts


def format_address(sockaddr: tuple[object, ...] | str) -> str:
    """`1.2.3.4:80`, `[::1]:80` for a socket address."""
    if isinstance(sockaddr, str):
        return sockaddr
    host, port = sockaddr[0], sockaddr[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def set_keepalive(sock: trio.socket.SocketType | socket.socket) -> None:
    """Turn on TCP keepalive with the timings above (Linux names them; elsewhere the
    system's timings apply). Best effort: a socket that refuses is left as it is."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE),
                            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                            ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
            option = getattr(socket, name, None)
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
    except OSError:
        pass


async def connect_tcp(host: str, port: int, *, connect_timeout: float | None,
                      mark: int | None = None) -> trio.SocketStream:
    """Connect to host:port within `connect_timeout` seconds (None: only the caller's
    cancel scopes bound it), with TCP_NODELAY set.

    `mark` sets SO_MARK before connecting: the agent's netfilter rules skip that mark,
    so its own upstream connections are never intercepted (no uid-based tricks).
    """
    if connect_timeout is None:
        return await _connect(host, port, mark)
    with trio.move_on_after(connect_timeout) as scope:
        return await _connect(host, port, mark)
    assert scope.cancelled_caught
    raise timed_out(host, port, connect_timeout)


def literal_family(host: str) -> socket.AddressFamily | None:
    """The address family of an IP literal; None for a name (one the resolver must answer)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        return family
    return None


def _literal(host: str, port: int) -> list[tuple[socket.AddressFamily, socket.SocketKind, int,
                                                 str, tuple[str, int]]] | None:
    """getaddrinfo's answer for an IP literal, without the resolver's round trip."""
    family = literal_family(host)
    if family is None:
        return None
    return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (host, port))]


def timed_out(host: str, port: int, timeout: float) -> DialFailed:
    return DialFailed("timeout", f"connecting to {host}:{port} timed out after {timeout:g}s")


def mark_failed(mark: int, exc: OSError) -> DialFailed:
    return DialFailed("mark", f"cannot set SO_MARK {mark} (needs CAP_NET_ADMIN): "
                              f"{exc.strerror}")


def connect_failed(host: str, port: int, attempts: list[tuple[str, OSError]]) -> DialFailed:
    """The failure of a dial whose every address failed (`attempts`, at least one)."""
    if all(isinstance(e, ConnectionRefusedError) for _, e in attempts):
        return DialFailed("refused", f"{host}:{port} refused the connection",
                          attempts=tuple(attempts))
    cause: DialCause = ("unreachable" if any(e.errno in _UNREACHABLE for _, e in attempts)
                        else "refused")
    last = attempts[-1][1]
    return DialFailed(cause, f"{host}:{port}: {last.strerror or last}", attempts=tuple(attempts))


async def _connect(host: str, port: int, mark: int | None) -> trio.SocketStream:
    infos: list[tuple[Any, ...]] | None = _literal(host, port)
    if infos is None:
        try:
            infos = list(await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except socket.gaierror as exc:
            raise DialFailed("dns", f"cannot resolve {host}: {exc.strerror}") from None
    if not infos:
        raise DialFailed("dns", f"{host} has no addresses")
    attempts: list[tuple[str, OSError]] = []
    for family, type_, proto, _, sockaddr in infos:
        sock = trio.socket.socket(family, type_, proto)
        try:
            if mark is not None:
                try:
                    sock.setsockopt(socket.SOL_SOCKET, SO_MARK, mark)
                except OSError as exc:
                    raise mark_failed(mark, exc) from None
            await sock.connect(sockaddr)
        except OSError as exc:
            sock.close()
            attempts.append((format_address(sockaddr), exc))
            continue
        except BaseException:
            sock.close()
            raise
        set_keepalive(sock)
        return trio.SocketStream(sock)  # which sets TCP_NODELAY (once: not here too)
    raise connect_failed(host, port, attempts)
