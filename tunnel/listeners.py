"""TCP listeners and UDP sockets that several processes can share (SO_REUSEPORT).

`trio.open_tcp_listeners` has no reuse-port option, so this is its loop with one more
socket option: every process of a server with several workers binds the same public
port, and the kernel spreads new connections over their listening sockets (by a hash of
each connection's addresses, one accept queue per process: no thundering herd on one
queue). A process that exits takes its socket out of the group; new connections go to
the others at once. Without `reuse_port` this is `trio.open_tcp_listeners` itself.
"""

from __future__ import annotations

import errno
import socket

import trio

from tunnel.udp import SHARED_BUFFER, size_buffers


async def open_tcp_listeners(port: int, *, host: str | None = None,
                             reuse_port: bool = False) -> list[trio.SocketListener]:
    """Listen on `port` at every address `host` resolves to (None: all interfaces), as
    `trio.open_tcp_listeners` does; with `reuse_port`, other processes of the same user
    may listen on the same address too (each must set it)."""
    if not reuse_port:
        return await trio.open_tcp_listeners(port, host=host)
    addresses = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                              flags=socket.AI_PASSIVE)
    listeners: list[trio.SocketListener] = []
    try:
        for family, type_, proto, _, sockaddr in addresses:
            try:
                sock = trio.socket.socket(family, type_, proto)
            except OSError as exc:
                if exc.errno == errno.EAFNOSUPPORT:  # an IPv6 address on a v4-only host
                    continue
                raise
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                await sock.bind(sockaddr)
                sock.listen(socket.SOMAXCONN)
            except BaseException:
                sock.close()
                raise
            listeners.append(trio.SocketListener(sock))
    except BaseException:
        for listener in listeners:
            listener.socket.close()
        raise
    if not listeners:
        raise OSError(errno.EAFNOSUPPORT, f"no usable address for {host}:{port}")
    return listeners


def bind_udp(host: str, port: int, *, reuse_port: bool) -> socket.socket:
    """A non-blocking UDP socket bound to host:port (SO_REUSEPORT for workers: the
    kernel hashes each client address to one worker, so its flow stays there)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    try:
        sock.setblocking(False)
        size_buffers(sock, SHARED_BUFFER)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6 and host == "::":
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock
