"""UDP services and clients for the end-to-end tests and benchmarks: an echo service, a
real DNS server (dnslib's, answering a fixed zone), and small blocking clients. Threads:
they stand for ordinary programs on the node and in front of the server, not for
nodeagent code."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Big socket buffers for the services: a burst of 64 KiB datagrams must not be lost
# in the echo's own receive buffer (that would be the test's loss, not the tunnel's).
SERVICE_BUFFER = 8 * 1024 * 1024


def _big_buffers(sock: socket.socket) -> None:
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SERVICE_BUFFER)


@dataclass
class UdpEcho:
    port: int
    received: int = 0  # datagrams it echoed


@contextlib.contextmanager
def run_udp_echo(host: str = "127.0.0.1", *, amplify: int = 1) -> Iterator[UdpEcho]:
    """A UDP echo service: every datagram goes back to its sender as it came (`amplify`
    times over, up to 65,507 bytes: a service whose answers are bigger than questions)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    _big_buffers(sock)
    sock.bind((host, 0))
    echo = UdpEcho(sock.getsockname()[1])

    def serve() -> None:
        while True:
            try:
                data, peer = sock.recvfrom(65_535)
            except OSError:
                return
            echo.received += 1
            with contextlib.suppress(OSError):
                sock.sendto((data * amplify)[:65_507], peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield echo
    finally:
        sock.close()


@dataclass
class DnsServer:
    port: int
    zone: str
    address: str  # what every A query under the zone answers
    server: Any


@contextlib.contextmanager
def run_dns_server(zone: str = "svc.cloud.internal.", address: str = "10.20.30.40",
                   host: str = "127.0.0.1", port: int = 0, *,
                   answer_asker: bool = False) -> Iterator[DnsServer]:
    """A real DNS server (dnslib) on UDP: A queries for names in `zone` answer `address`,
    anything else NXDOMAIN. `answer_asker`: every A query answers the address the query
    came from (a resolver that shows which path a query took)."""
    from dnslib import QTYPE, RCODE, RR, A
    from dnslib.server import BaseResolver, DNSLogger, DNSServer

    class Resolver(BaseResolver):  # type: ignore[misc]
        def resolve(self, request: Any, handler: Any) -> Any:
            reply = request.reply()
            name = str(request.q.qname).lower()
            if answer_asker and request.q.qtype == QTYPE.A:
                reply.add_answer(RR(request.q.qname, QTYPE.A,
                                    rdata=A(handler.client_address[0]), ttl=0))
            elif name.endswith(zone) and request.q.qtype == QTYPE.A:
                reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=30))
            else:
                reply.header.rcode = RCODE.NXDOMAIN
            return reply

    server = DNSServer(Resolver(), port=port, address=host,
                       logger=DNSLogger(log="-request,-reply,-truncated,-error,-recv,-send,"
                                            "-data", prefix=False))
    server.start_thread()
    port = server.server.server_address[1]
    try:
        yield DnsServer(port, zone, address, server)
    finally:
        server.stop()
        server.server.server_close()


def exchange(port: int, payload: bytes, *, host: str = "127.0.0.1", timeout: float = 2.0,
             tries: int = 1, sock: socket.socket | None = None) -> bytes | None:
    """Send `payload` to host:port and return the first datagram back (None: nothing
    within `timeout`, `tries` times)."""
    own = sock is None
    if sock is None:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                             socket.SOCK_DGRAM)
        _big_buffers(sock)
    try:
        sock.settimeout(timeout)
        for _ in range(tries):
            sock.sendto(payload, (host, port))
            try:
                data, _ = sock.recvfrom(65_535)
                return data
            except TimeoutError:
                continue
        return None
    finally:
        if own:
            sock.close()


def dns_query(port: int, name: str, *, host: str = "127.0.0.1",
              timeout: float = 2.0, tries: int = 3) -> list[str] | None:
    """A-record addresses for `name` asked of host:port over UDP ([] for NXDOMAIN, None
    without an answer), encoded and decoded by dnslib."""
    from dnslib import QTYPE, RCODE, DNSRecord

    query = DNSRecord.question(name, "A")
    raw = exchange(port, query.pack(), host=host, timeout=timeout, tries=tries)
    if raw is None:
        return None
    reply = DNSRecord.parse(raw)
    if reply.header.id != query.header.id:
        return None
    if reply.header.rcode == RCODE.NXDOMAIN:
        return []
    return [str(rr.rdata) for rr in reply.rr if rr.rtype == QTYPE.A]

