"""The set-up the in-process tunnel benchmarks share (scripts.bench.tunnel_cpu,
scripts.bench.stream_notes_cost): a connected loopback TCP socket pair for two
TunnelConnections in one process, and a handshake check that admits any peer."""

from __future__ import annotations

import socket

from tunnel import protocol as p
from tunnel.transports import PeerInfo


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Both ends of one loopback TCP connection, non-blocking, Nagle off (as the tunnel
    sets its sockets)."""
    lst = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(lst.getsockname())
    b, _ = lst.accept()
    lst.close()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
    return a, b


async def allow_any_peer(hello: p.Hello, peer: PeerInfo) -> p.Hello:
    """The acceptor's handshake check: every dialer is admitted."""
    return p.Hello(identity={"server": "micro"})
