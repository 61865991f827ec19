"""tunnel/transports/tcpstate.py on real loopback sockets: what TCP_INFO says of a
connection with nothing waiting for an acknowledgement, and of things that are not one."""

from __future__ import annotations

import socket
import time

import trio

from tunnel.transports import PeerInfo, StreamTransport
from tunnel.transports.tcpstate import unacknowledged_wait


def test_nothing_waits_on_an_acknowledged_connection() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with socket.create_connection(listener.getsockname()) as client:
            server, _ = listener.accept()
            with server:
                client.sendall(b"x" * 1000)
                assert server.recv(2000)
                # Loopback acknowledges at once; poll briefly all the same.
                deadline = time.monotonic() + 5
                while unacknowledged_wait(client) is not None:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)


def test_what_cannot_say_is_none() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        assert unacknowledged_wait(udp) is None
    closed = socket.socket()
    closed.close()
    assert unacknowledged_wait(closed) is None
    assert unacknowledged_wait(object()) is None


async def test_a_stream_transport_asks_its_socket() -> None:
    a, b = trio.socket.socketpair()  # not TCP: cannot say
    transport = StreamTransport(trio.SocketStream(a), PeerInfo("x"))
    assert transport.unacknowledged_wait() is None
    listener = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener[0].socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listener[0].accept()
    tcp = StreamTransport(client, PeerInfo("y"))
    await tcp.send(b"hello")
    assert await server.receive_some(10) == b"hello"
    for _ in range(500):  # loopback acknowledges at once; poll briefly all the same
        if tcp.unacknowledged_wait() is None:
            break
        await trio.sleep(0.01)
    assert tcp.unacknowledged_wait() is None
    for s in (tcp, transport):
        await s.aclose()
    await server.aclose()
    b.close()
    await listener[0].aclose()
