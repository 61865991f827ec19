"""CONNECT front: stream setup time and throughput, against the same stream through a TCP
mapping and against a direct connection, in the same run.

A real `nodeagent server` and `nodeagent agent` on loopback (TLS tunnel), a target on the
"node" (a sink that reads a length, then that many bytes, then answers `ok`), and four
paths to it:

  direct        client → target
  tcp-mapping   client → server's TCP mapping port → tunnel → agent → target
  connect-uds   client → CONNECT over the server's Unix socket → tunnel → agent → target
  connect-tls   client → CONNECT over the mutual-TLS listener (new handshake per stream)

Setup: sequential connections, each sending one byte and waiting for `ok` (p50/p99 ms and
connections/s). Throughput: one stream uploading --mib MiB. Needs root (the agent marks its
sockets). Not a test: timings move with the machine; read the ratios. Prints a table (setup
p50/p99, connections/s, Gbit/s per path) and writes bench-results/connect-DATE-TIME.json.
From the repository root:

    sudo .venv/bin/python -m scripts.bench.connect_front [--connections 500] [--mib 256]
"""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trustme

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import free_port
from nodeagent.trust import pki
from scripts import ROOT

TOKEN = "bench-token-0123456789abcdef"


def sink_server() -> tuple[socket.socket, int]:
    listener = socket.create_server(("127.0.0.1", 0), backlog=1024)

    def serve(conn: socket.socket) -> None:
        try:
            serve_one(conn)
        except OSError:
            pass  # a client that went away; the bench itself reports failures

    def serve_one(conn: socket.socket) -> None:
        with conn:
            head = b""
            while len(head) < 8:
                data = conn.recv(8 - len(head))
                if not data:
                    return
                head += data
            left = struct.unpack("!Q", head)[0]
            while left > 0:
                data = conn.recv(min(left, 1 << 20))
                if not data:
                    return
                left -= len(data)
            conn.sendall(b"ok")
            while conn.recv(1 << 16):  # until the client closes
                pass

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return listener, listener.getsockname()[1]


def read_head(sock: socket.socket) -> None:
    head = b""
    while b"\r\n\r\n" not in head:
        byte = sock.recv(1)
        if not byte:
            raise OSError(f"closed during the CONNECT answer: {head!r}")
        head += byte
    if not head.startswith(b"HTTP/1.1 200 "):
        raise OSError(f"CONNECT refused: {head!r}")


def run_stream(sock: Any, payload: bytes, total: int) -> None:
    """Send `total` bytes (after their count) and wait for the target's `ok`."""
    sock.sendall(struct.pack("!Q", total))
    sent = 0
    while sent < total:
        chunk = payload[: total - sent]
        sock.sendall(chunk)
        sent += len(chunk)
    got = b""
    while len(got) < 2 and (data := sock.recv(2 - len(got))):
        got += data
    if got != b"ok":
        raise OSError(f"target answered {got!r}")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.connect_front",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=500)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-connect-"))
    ca = pki.create_ca("bench")
    ca.write(work / "ca.crt", work / "ca.key")
    pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"]).write(
        work / "server.crt", work / "server.key")
    # kube-apiserver's side: its own CA and a client certificate (trustme: clientAuth).
    client_ca = trustme.CA()
    client_ca.cert_pem.write_to_path(str(work / "client-ca.crt"))
    leaf = client_ca.issue_cert("kube-apiserver")
    leaf.cert_chain_pems[0].write_to_path(str(work / "client.crt"))
    leaf.private_key_pem.write_to_path(str(work / "client.key"))
    listener, target = sink_server()
    tunnel, mapping, tls_port = free_port(), free_port(), free_port()
    uds = work / "connect.sock"
    server = NodeagentProcess("server", {
        "tunnel": f"tls://127.0.0.1:{tunnel}",
        "tls": {"cert_file": str(work / "server.crt"), "key_file": str(work / "server.key")},
        "tokens": [{"node": "edge-1", "token": TOKEN}],
        "tcp": [{"listen": f"127.0.0.1:{mapping}", "node": "edge-1",
                 "target": f"127.0.0.1:{target}"}],
        "connect": {"uds": str(uds), "listen": f"127.0.0.1:{tls_port}",
                    "tls": {"client_ca_file": str(work / "client-ca.crt")}},
        "connect_nodes": {"edge-1": {"addresses": ["127.0.0.1"], "ports": [target]}},
        "debug_socket": str(work / "server.sock"),
    }, work, "server").start()
    agent = NodeagentProcess("agent", {
        "node": "edge-1", "server": f"tls://127.0.0.1:{tunnel}", "token": TOKEN,
        "tls": {"ca_file": str(work / "ca.crt")},
        "allow": [f"127.0.0.1:{target}"], "control_plane": [f"127.0.0.1:{target}"],
        "debug_socket": str(work / "agent.sock"),
    }, work, "agent")
    try:
        server.wait_ready()
        agent.start().wait_ready()
        server.wait_for(lambda s: s["agents"], what="agent connected")
        client_ctx = ssl.create_default_context(cafile=str(work / "ca.crt"))
        client_ctx.load_cert_chain(str(work / "client.crt"), str(work / "client.key"))
        connect = f"CONNECT 127.0.0.1:{target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()

        def direct() -> socket.socket:
            return socket.create_connection(("127.0.0.1", target))

        def tcp_mapping() -> socket.socket:
            return socket.create_connection(("127.0.0.1", mapping))

        def connect_uds() -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(uds))
            sock.sendall(connect)
            read_head(sock)
            return sock

        def connect_tls() -> Any:
            raw = socket.create_connection(("127.0.0.1", tls_port))
            # As Go's dialer (kube-apiserver) does; without it the handshake's small
            # writes meet delayed ACKs (~40 ms each).
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = client_ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            sock.sendall(connect)
            read_head(sock)
            return sock

        paths: dict[str, Callable[[], Any]] = {
            "direct": direct, "tcp-mapping": tcp_mapping, "connect-uds": connect_uds,
            "connect-tls": connect_tls}
        results: dict[str, dict[str, float]] = {}
        payload = bytes(1 << 20)
        for name, opener in paths.items():
            times = []
            for _ in range(20):  # warm up
                run_stream(opener(), b"x", 1)
            start = time.perf_counter()
            for _ in range(args.connections):
                t0 = time.perf_counter()
                sock = opener()
                run_stream(sock, b"x", 1)
                sock.close()
                times.append(time.perf_counter() - t0)
            elapsed = time.perf_counter() - start
            sock = opener()
            t0 = time.perf_counter()
            run_stream(sock, payload, args.mib << 20)
            seconds = time.perf_counter() - t0
            sock.close()
            times.sort()
            results[name] = {
                "setup_p50_ms": statistics.median(times) * 1000,
                "setup_p99_ms": times[int(len(times) * 0.99) - 1] * 1000,
                "connections_per_s": args.connections / elapsed,
                "gbit_per_s": (args.mib << 20) * 8 / seconds / 1e9,
            }
    finally:
        agent.kill()
        server.kill()
        listener.close()
    base = results["tcp-mapping"]
    print(f"{'path':<13} {'setup p50':>10} {'p99':>9} {'conn/s':>8} {'Gbit/s':>7}  "
          f"vs tcp-mapping (setup p50, Gbit/s)")
    for name, r in results.items():
        print(f"{name:<13} {r['setup_p50_ms']:>8.2f}ms {r['setup_p99_ms']:>7.2f}ms "
              f"{r['connections_per_s']:>8.0f} {r['gbit_per_s']:>7.2f}  "
              f"{r['setup_p50_ms'] / base['setup_p50_ms']:.2f}x, "
              f"{r['gbit_per_s'] / base['gbit_per_s']:.2f}x")
    out = ROOT / "bench-results"
    out.mkdir(exist_ok=True)
    path = out / f"connect-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({"connections": args.connections, "mib": args.mib,
                                "results": results}, indent=2))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
