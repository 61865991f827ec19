"""The Python floor for the UDP benchmark: the least a trio program can do to relay UDP.

One process, no tunnel: datagrams to `listen` go to `target` from one connected socket
per client address, and replies go back. Each socket is read by one task that waits for
readability (trio.lowlevel.wait_readable) and then reads until the socket is empty, as
nodeagent's datagram path does. What this relays per second is what one trio process on
this machine can do at all, with no protocol, TLS or second process: nodeagent carries
every datagram through two such processes (server and agent) and a TLS connection.

    python -m scripts.bench.udp_relay 127.0.0.1:PORT 127.0.0.1:TARGET_PORT
"""

from __future__ import annotations

import socket
import sys

import trio
import trio.lowlevel

from tunnel.udp import size_buffers

BUFFER = 8 * 1024 * 1024


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def _udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    # The buffers nodeagent asks for (past rmem_max where the process may): the same
    # kernel-side slack, so what differs is the path.
    size_buffers(sock, BUFFER)
    return sock


async def _replies(upstream: socket.socket, listener: socket.socket,
                   client: tuple[str, int]) -> None:
    while True:
        await trio.lowlevel.wait_readable(upstream)
        while True:
            try:
                data = upstream.recv(65_535)
            except BlockingIOError:
                break
            except OSError:
                continue
            try:
                listener.sendto(data, client)
            except OSError:
                pass


async def relay(listen: tuple[str, int], target: tuple[str, int]) -> None:
    listener = _udp_socket()
    listener.bind(listen)
    upstreams: dict[tuple[str, int], socket.socket] = {}
    async with trio.open_nursery() as nursery:
        while True:
            await trio.lowlevel.wait_readable(listener)
            while True:
                try:
                    data, client = listener.recvfrom(65_535)
                except BlockingIOError:
                    break
                except OSError:
                    continue
                upstream = upstreams.get(client)
                if upstream is None:
                    upstream = upstreams[client] = _udp_socket()
                    upstream.connect(target)
                    nursery.start_soon(_replies, upstream, listener, client)
                try:
                    upstream.send(data)
                except OSError:
                    pass


def main() -> None:
    trio.run(relay, _address(sys.argv[1]), _address(sys.argv[2]))


if __name__ == "__main__":
    main()
