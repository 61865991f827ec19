"""A tiny TCP service for netns tests: answers each connection with the address it sees
the client coming from, then echoes. `python -m tests.e2e.peerecho HOST:PORT [...]`."""

from __future__ import annotations

import socket
import sys
import threading


def serve(sock: socket.socket) -> None:
    while True:
        conn, addr = sock.accept()

        def handle(c: socket.socket, a: tuple[str, int]) -> None:
            with c:
                c.sendall(f"peer={a[0]}\n".encode())
                while data := c.recv(65536):
                    c.sendall(data)

        threading.Thread(target=handle, args=(conn, addr), daemon=True).start()


def main() -> None:
    threads = []
    for spec in sys.argv[1:]:
        host, _, port = spec.rpartition(":")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # Otherwise [::]:P also claims 0.0.0.0:P and the two specs collide.
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, int(port)))
        sock.listen(128)
        t = threading.Thread(target=serve, args=(sock,), daemon=True)
        t.start()
        threads.append(t)
    print("ready", flush=True)
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
