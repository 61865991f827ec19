"""HTTP via the Host router, in one process: CPU or instructions per request, against another tree.

The production request path of `scripts.bench.tunnel --only http` without the namespaces,
the real processes and nginx: an `HttpFront` (as `server/listeners.py` builds it) whose
upstream opener is the server's (`HttpBackends.open_http_backend`, through `DataPath`),
opening a stream through a `TunnelConnection` (the server's end) over the tunnel's TLS on
a loopback TCP connection to a second `TunnelConnection` (the agent's end), whose stream
handler relays each stream to the upstream with `relay_incoming` (the agent's path: dial,
accept, the splice loop). Both ends run in the one measured process, so a figure is
server + agent together; `--front-only` dials the upstream directly instead (the front's
share alone).

The load generator (keep-alive GETs on `--connections` connections, a fixed number per
connection: threads of the driver) and the upstream (a fixed 1 KiB response with nginx's
header set, a process of its own) run outside the measured process: their CPU is not
counted.

    .venv/bin/python -m scripts.bench.http_tunnel                          # CPU µs per request
    .venv/bin/python -m scripts.bench.http_tunnel --tree /work/base        # A/B, interleaved
    .venv/bin/python -m scripts.bench.http_tunnel --tree /work/base --instructions
    .venv/bin/python -m scripts.bench.http_tunnel --steps   # the front's sans-IO steps alone

CPU mode: the measured process's CPU time (/proc) over `--requests` requests after a
warm-up. `--instructions`: callgrind counts the process's instructions for two runs
(`--requests` and a tenth of it) and reports the difference per request, which takes the
start-up (imports, TLS handshake, connections) out; callgrind runs the interpreter ~80x
slower, so use a few thousand requests. `--tree` runs the other checkout's `nodeagent` and
`tunnel` packages under this script (PYTHONPATH, -P), alternating with this tree for
`--rounds` rounds; prints each round and the median ratio (this / other) with its
min-max.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BODY = b"x" * 1024
# nginx's answer to the benchmark's GET /1k (scripts.bench.tunnel's target), header for header.
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Fri, 27 Nov 2026 14:00:00 GMT\r\n"
    b"Content-Type: application/octet-stream\r\nContent-Length: 1024\r\n"
    b"Last-Modified: Fri, 27 Nov 2026 13:00:00 GMT\r\nConnection: keep-alive\r\n"
    b'ETag: "6566a0b0-400"\r\nAccept-Ranges: bytes\r\n\r\n' + BODY)
REQUEST = (b"GET /1k HTTP/1.1\r\nHost: bench.test\r\nUser-Agent: wrk\r\n"
           b"Accept: */*\r\n\r\n")


# -- the upstream and the client (other processes / threads: not measured) -------------------

def run_upstream(port_out: Any) -> None:
    """An epoll-free thread-per-connection upstream answering every request head with
    RESPONSE (the benchmark's requests have no body)."""
    lst = socket.create_server(("127.0.0.1", 0))
    port_out.put(lst.getsockname()[1])

    def serve(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = b""
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(65536):
                buf += data
                n = buf.count(b"\r\n\r\n")
                if n:
                    buf = buf[buf.rfind(b"\r\n\r\n") + 4:]
                    conn.sendall(RESPONSE * n)

    while True:
        conn, _ = lst.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def load(port: int, connections: int, per_connection: int) -> None:
    """`per_connection` keep-alive GETs on each of `connections` connections, one at a
    time per connection (wrk's shape); raises if an answer is not the upstream's."""
    errors: list[str] = []

    def client() -> None:
        try:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                buf = b""
                for _ in range(per_connection):
                    s.sendall(REQUEST)
                    while True:
                        end = buf.find(b"\r\n\r\n")
                        if end >= 0:
                            m = re.search(rb"(?i)\r\ncontent-length: *(\d+)", buf[:end])
                            if not buf.startswith(b"HTTP/1.1 200") or m is None:
                                raise RuntimeError(f"unexpected answer {buf[:200]!r}")
                            total = end + 4 + int(m.group(1))
                            if len(buf) >= total:
                                buf = buf[total:]
                                break
                        data = s.recv(65536)
                        if not data:
                            raise RuntimeError("the front closed the connection")
                        buf += data
        except Exception as exc:  # reported by the caller
            errors.append(repr(exc))

    threads = [threading.Thread(target=client) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"load failed: {errors[0]}")


# -- the measured process ---------------------------------------------------------------------

def child(upstream_port: int, front_only: bool, certs: Path) -> None:
    """The front + tunnel + agent relay, in one trio process; prints its port, serves until
    stdin closes."""
    import trio
    from prometheus_client import CollectorRegistry
    from prometheus_client import Counter as MetricCounter

    from nodeagent.config import RoutesConfig
    from nodeagent.http import Backend, HttpFront, Route, RouteSpec, RouteTable
    from nodeagent.ops.logs import get_logger
    from nodeagent.ops.streamviews import StreamNotes
    from nodeagent.server.datapath import DataPath
    from nodeagent.server.openers import HttpBackends, StreamOutcomes
    from nodeagent.server.refusals import PolicyRefusals
    from nodeagent.trust import pki
    from scripts.bench.lib.loopback import allow_any_peer, tcp_pair
    from tunnel import protocol as p
    from tunnel.endpoint import EndpointSettings, IncomingStream, TunnelConnection
    from tunnel.relay import relay_incoming
    from tunnel.tcp import connect_tcp
    from tunnel.transports import PeerInfo, StreamTransport, TLSStream

    async def agent_handler(incoming: IncomingStream) -> None:
        target = incoming.target

        async def dial() -> trio.SocketStream:
            return await connect_tcp(target.host, target.port, connect_timeout=5)

        await relay_incoming(incoming, dial, on_finished=lambda result: None)

    async def main() -> None:
        a, b = tcp_pair()
        sa = trio.SocketStream(trio.socket.from_stdlib_socket(a))
        sb = trio.SocketStream(trio.socket.from_stdlib_socket(b))
        ca = (certs / "ca.pem").read_bytes()
        ta = TLSStream(sa, pki.client_ssl_context(ca), server_hostname="localhost")
        tb = TLSStream(sb, pki.server_ssl_context((certs / "cert.pem").read_bytes(),
                                                  (certs / "key.pem").read_bytes()),
                       server_side=True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ta.do_handshake)
            nursery.start_soon(tb.do_handshake)
        settings = EndpointSettings()
        server = TunnelConnection(StreamTransport(ta, PeerInfo("agent")), p.Role.DIALER,
                                  settings, None)
        agent = TunnelConnection(StreamTransport(tb, PeerInfo("server")), p.Role.ACCEPTOR,
                                 settings, agent_handler)

        # The server's opener (server/openers.py), through a DataPath to this tunnel.
        registry = CollectorRegistry()
        backends = HttpBackends(
            datapath=DataPath(routes=RoutesConfig, open_stream=lambda node, target, meta:
                              server.open_stream(target, meta),
                              refusals=PolicyRefusals(registry, get_logger("bench")),
                              dial_timeout=10, controller=None),
            notes=StreamNotes(), direct_backends=False,
            outcomes=StreamOutcomes(MetricCounter("streams", "", ["direction", "outcome"],
                                                  registry=registry)))

        async def open_upstream(backend: Backend, route: Route,
                                client: str = "") -> trio.abc.HalfCloseableStream:
            if front_only:
                return await connect_tcp(backend.host, backend.port, connect_timeout=5)
            return await backends.open_http_backend(backend, route, client)

        route = Route("bench", (Backend("node", "127.0.0.1", upstream_port),))
        table = RouteTable.build([RouteSpec("bench.test", "/", route)])
        front = HttpFront(table=lambda: table, open_upstream=open_upstream,
                          unhealthy=lambda backend: False)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent.accept_handshake, allow_any_peer)
            await server.dial_handshake(p.Hello(identity={"node": "node"}))
            await nursery.start(server.run)
            await nursery.start(agent.run)
            listeners = await nursery.start(front.run, "127.0.0.1", 0)
            print(listeners[0].socket.getsockname()[1], flush=True)
            await trio.to_thread.run_sync(sys.stdin.read)  # until the parent closes it
            nursery.cancel_scope.cancel()

    trio.run(main)


# -- the driver -------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(tree: Path, args: argparse.Namespace, upstream_port: int, certs: Path,
            requests: int, callgrind: bool) -> float:
    """CPU seconds (or instructions, under callgrind) the measured process spent on
    `requests` requests (CPU mode: after a warm-up; callgrind: the whole run)."""
    # Only the other tree's packages: this tree's benchmark runs over them.
    packages = Path(tempfile.mkdtemp())
    for name in ("nodeagent", "tunnel"):
        (packages / name).symlink_to(tree / name)
    env = dict(os.environ, PYTHONPATH=f"{packages}{os.pathsep}{ROOT}", PYTHONHASHSEED="0")
    cmd = [sys.executable, "-P", "-m", "scripts.bench.http_tunnel", "--child",
           str(upstream_port), str(certs)] + (["--front-only"] if args.front_only else [])
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        if callgrind:
            cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *cmd]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdin is not None
        port = int(proc.stdout.readline())
        per = max(1, requests // args.connections)
        if callgrind:
            load(port, args.connections, per)
            _, err = proc.communicate(b"", timeout=600)
            shutil.rmtree(packages)
            match = re.search(rb"Collected : (\d+)", err)
            if match is None:
                raise SystemExit(f"no instruction count:\n{err[-2000:].decode()}")
            return float(match.group(1))
        load(port, args.connections, max(1, per // 5))  # warm-up: upstream streams, caches
        spy = None
        if args.profile and tree == ROOT:
            spy = subprocess.Popen(
                [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
                 "record", "--pid", str(proc.pid), "--rate", "500", "--format", "raw",
                 "--output", str(args.profile), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1)
        before = cpu_seconds(proc.pid)
        load(port, args.connections, per)
        spent = cpu_seconds(proc.pid) - before
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        proc.stdin.close()
        proc.wait(30)
        shutil.rmtree(packages)
        return spent


def steps(count: int = 30000) -> dict[str, float]:
    """CPU µs per request of the front's sans-IO steps alone (no I/O, no trio), in this
    process: what a request costs before any socket, task or tunnel is involved."""
    from nodeagent.http.dispatch import route_request
    from nodeagent.http.h1 import ResponseParser, serialize_request
    from nodeagent.http.headers import frame_response, read_request, upstream_headers
    from nodeagent.http.request import RequestHead, RequestReader
    from nodeagent.http.routetable import Backend, Route, RouteSpec, RouteTable
    from nodeagent.http.stats import HttpStats

    route = Route("bench", (Backend("node", "127.0.0.1", 80),))
    table = RouteTable.build([RouteSpec("bench.test", "/", route)])
    stats = HttpStats()
    reader = RequestReader(65536)
    parser = ResponseParser(65536)
    spent: dict[str, float] = {}
    clock = time.process_time
    for _ in range(count):
        t0 = clock()
        reader.feed(REQUEST)
        req = reader.next()
        assert type(req) is RequestHead
        t1 = clock()
        creq = read_request(req.http_version, req.target, req.headers)
        t2 = clock()
        route_request(table, req.method, creq, https=False, max_body=None)
        t3 = clock()
        serialize_request(req.method, creq.target, upstream_headers(
            creq, default_host="node", client=b"10.0.0.1", proto=b"http"))
        reader.next()  # EndOfRequest
        t4 = clock()
        parser.start(False)
        parser.next()
        parser.feed(RESPONSE)
        head = parser.next()
        parser.next()
        parser.next()
        t5 = clock()
        frame_response(head.status, head.reason, head.headers,  # type: ignore[union-attr]
                       length=parser.length, head_request=False, http11=True,
                       keep_alive=True)
        t6 = clock()
        stats.requests += 1
        stats.count_status(200)
        stats.count_route("bench", "h1", 200)
        reader.start_next()
        t7 = clock()
        for name, a, b in (("parse the request head (llhttp)", t0, t1),
                           ("header policy (read_request)", t1, t2),
                           ("route lookup (route_request)", t2, t3),
                           ("upstream head (upstream_headers, serialize)", t3, t4),
                           ("parse the response (ResponseParser)", t4, t5),
                           ("client's response head (frame_response)", t5, t6),
                           ("counters, next request", t6, t7)):
            spent[name] = spent.get(name, 0.0) + b - a
    return {name: round(v / count * 1e6, 2) for name, v in spent.items()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), "--front-only" in sys.argv, Path(sys.argv[3]))
        return
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.http_tunnel",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, help="another checkout to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per run (default 20,000; 3,000 with --instructions)")
    parser.add_argument("--instructions", action="store_true",
                        help="callgrind instruction counts instead of CPU time")
    parser.add_argument("--front-only", action="store_true",
                        help="the front dials the upstream directly (no tunnel)")
    parser.add_argument("--profile", type=Path,
                        help="py-spy record this tree's process during the load (CPU "
                             "mode) into this file (raw format)")
    parser.add_argument("--steps", action="store_true",
                        help="only the front's sans-IO steps, CPU µs each, in this process")
    args = parser.parse_args()
    if args.steps:
        result = steps()
        print(json.dumps(result | {"total": round(sum(result.values()), 2)}, indent=1))
        return
    if args.instructions and shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian package: valgrind)")
    requests = args.requests or (3000 if args.instructions else 20000)
    import multiprocessing

    from nodeagent.trust import pki
    queue: Any = multiprocessing.Queue()
    upstream = multiprocessing.Process(target=run_upstream, args=(queue,), daemon=True)
    upstream.start()
    upstream_port = queue.get(timeout=10)
    trees = {"this": ROOT} | ({"other": args.tree.resolve()} if args.tree else {})
    unit = "instructions_per_request" if args.instructions else "cpu_us_per_request"
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        certs = Path(tmp)
        ca = pki.create_ca("bench")
        cert = pki.issue_server_certificate(ca, ["localhost"], [])
        (certs / "ca.pem").write_bytes(ca.certificate_pem)
        (certs / "cert.pem").write_bytes(cert.certificate_pem)
        (certs / "key.pem").write_bytes(cert.key_pem)
        try:
            for _ in range(args.rounds):
                r: dict[str, float] = {}
                for name, tree in trees.items():
                    if args.instructions:
                        small = requests // 10
                        big = one_run(tree, args, upstream_port, certs, requests, True)
                        little = one_run(tree, args, upstream_port, certs, small, True)
                        per = args.connections
                        done = (requests // per - small // per) * per
                        r[name] = (big - little) / done
                    else:
                        done = requests // args.connections * args.connections
                        r[name] = one_run(tree, args, upstream_port, certs, requests,
                                          False) / done * 1e6
                rounds.append(r)
                print(json.dumps({k: round(v, 1) for k, v in r.items()}), flush=True)
        finally:
            upstream.terminate()
    summary: dict[str, Any] = {"unit": unit, "front_only": args.front_only}
    for name in trees:
        summary[name] = round(statistics.median(r[name] for r in rounds), 1)
    if args.tree:
        ratios = [r["this"] / r["other"] for r in rounds]
        summary |= {"ratio": round(statistics.median(ratios), 3),
                    "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
