"""A tiny UDP service for netns tests: answers each datagram with the address it saw it
come from, then the datagram. `python -m tests.e2e.peerudp HOST:PORT [...]`; and with
`--dns HOST:PORT` a real DNS server (dnslib, nodeagent.testing.udp) answering
svc.cloud.internal. names with 10.20.30.40; `--dns-asker HOST:PORT` one answering every
name with the address that asked."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading


def serve(sock: socket.socket) -> None:
    while True:
        data, addr = sock.recvfrom(65_535)
        with contextlib.suppress(OSError):
            sock.sendto(f"peer={addr[0]}\n".encode() + data, addr)


def main() -> None:
    threads = []
    args = sys.argv[1:]
    stack = contextlib.ExitStack()
    while args:
        spec = args.pop(0)
        if spec in ("--dns", "--dns-asker"):
            from nodeagent.testing.udp import run_dns_server
            host, _, port = args.pop(0).rpartition(":")
            stack.enter_context(run_dns_server(host=host.strip("[]"), port=int(port),
                                               answer_asker=spec == "--dns-asker"))
            continue
        host, _, port = spec.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_DGRAM)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, int(port)))
        t = threading.Thread(target=serve, args=(sock,), daemon=True)
        t.start()
        threads.append(t)
    print("ready", flush=True)
    with stack:
        for t in threads:
            t.join()
        threading.Event().wait()


if __name__ == "__main__":
    main()
