"""Benchmark of the HTTP front alone: wrk → front → upstream, over loopback TCP.

From the repository root (needs wrk):

    .venv/bin/python -m scripts.bench.http_front [--seconds 5] [--connections 16]

Runs a minimal upstream (a trio server answering every request with a fixed 1 KiB
response) in one process, the front in another, and wrk (keep-alive, 1 KiB GETs) against
the upstream directly, through a bare trio byte relay (the floor for any trio proxy: no
HTTP parsing), and through the front; prints req/s and latency for each, and the CPU the
relay and front processes spent per request (steadier than req/s on a shared machine).
Also times the route table: build with 10,000 hosts / 20,000 paths, and lookups.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import random
import re
import statistics
import subprocess
import sys
import time

import trio

from nodeagent.http import (
    Backend,
    HttpFront,
    PathType,
    Route,
    RouteSpec,
    RouteTable,
    UpstreamUnavailable,
)
from tunnel.protocol import StreamReason
from tunnel.tcp import DialFailed, connect_tcp

BODY = b"x" * 1024
RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n" % len(BODY) + BODY
)


async def _upstream_conn(stream: trio.SocketStream) -> None:
    buf = b""
    try:
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            buf += data
            n = buf.count(b"\r\n\r\n")
            if n:
                buf = buf[buf.rfind(b"\r\n\r\n") + 4 :]
                await stream.send_all(RESPONSE * n)
    except trio.BrokenResourceError:
        pass


def _run_upstream(port: int) -> None:
    trio.run(functools.partial(trio.serve_tcp, _upstream_conn, port, host="127.0.0.1"))


async def open_direct(backend: Backend, route: Route, client: str = "") -> trio.SocketStream:
    """The front's upstream opener: dial the backend over TCP, failures mapped as the
    server maps them (the tests' opener does the same; a script does not import tests)."""
    try:
        return await connect_tcp(backend.host, backend.port, connect_timeout=10.0)
    except DialFailed as exc:
        status = 504 if exc.reason is StreamReason.TIMEOUT else 502
        raise UpstreamUnavailable(status, f"cannot connect to {backend}: {exc.message}") from None


def _run_front(port: int, upstream_port: int) -> None:
    route = Route("bench", (Backend(None, "127.0.0.1", upstream_port),))
    table = RouteTable.build([RouteSpec(None, "/", route)])
    front = HttpFront(table=lambda: table, open_upstream=open_direct)
    trio.run(front.run, "127.0.0.1", port)


async def _relay_conn(stream: trio.SocketStream, upstream_port: int) -> None:
    up = await trio.open_tcp_stream("127.0.0.1", upstream_port)

    async def pump(a: trio.SocketStream, b: trio.SocketStream) -> None:
        try:
            while data := await a.receive_some(65536):
                await b.send_all(data)
        except trio.BrokenResourceError:
            pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump, stream, up)
        nursery.start_soon(pump, up, stream)


def _run_relay(port: int, upstream_port: int) -> None:
    """The floor: trio relaying bytes with no HTTP parsing at all."""
    handler = functools.partial(_relay_conn, upstream_port=upstream_port)
    trio.run(functools.partial(trio.serve_tcp, handler, port, host="127.0.0.1"))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wrk(port: int, seconds: int, connections: int) -> tuple[float, str]:
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{seconds}s",
            "--latency",
            f"http://127.0.0.1:{port}/bench",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    lat = " ".join(f"{p}={v}" for p, v in re.findall(r"^\s+(50|99)%\s+(\S+)", out, re.MULTILINE))
    return rps, lat


def bench_routes() -> None:
    rng = random.Random(1)
    hosts = [f"svc{i}.tenant{i % 97}.example.com" for i in range(10_000)]
    specs = []
    for i, h in enumerate(hosts):
        r = Route(f"r{i}", (Backend("node1", "10.0.0.1", 80),))
        specs.append(RouteSpec(h, "/", r))
        kind = PathType.PREFIX if i % 3 else PathType.EXACT
        specs.append(RouteSpec(h, f"/api/v{i % 5}/items", r, kind))
    builds = []
    for _ in range(5):
        t = time.perf_counter()
        table = RouteTable.build(specs)
        builds.append(time.perf_counter() - t)
    paths = ["/", "/api/v1/items/42?x=1", "/api/v3/items", "/static/a/b/c.js"]
    queries = [(rng.choice(hosts) + ":8080", rng.choice(paths)) for _ in range(50_000)]
    lat = []
    for h, p in queries:
        t0 = time.perf_counter_ns()
        table.lookup(h, p)
        lat.append(time.perf_counter_ns() - t0)
    lat.sort()
    print(
        f"route table, {len(specs)} rules on {len(hosts)} hosts: "
        f"build median {statistics.median(builds) * 1000:.1f} ms (max {max(builds) * 1000:.1f}); "
        f"lookup median {statistics.median(lat) / 1000:.2f} µs, "
        f"p99 {lat[int(len(lat) * 0.99)] / 1000:.2f} µs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.http_front",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--connections", type=int, default=16)
    args = parser.parse_args()
    bench_routes()
    up_port, front_port, relay_port = 18081, 18080, 18082
    procs = [
        multiprocessing.Process(target=_run_upstream, args=(up_port,), daemon=True),
        multiprocessing.Process(target=_run_front, args=(front_port, up_port), daemon=True),
        multiprocessing.Process(target=_run_relay, args=(relay_port, up_port), daemon=True),
    ]
    for p in procs:
        p.start()
    time.sleep(1.0)
    try:
        direct, dlat = _wrk(up_port, args.seconds, args.connections)
        cpu = _cpu_seconds(procs[2].pid or 0)
        relay, rlat = _wrk(relay_port, args.seconds, args.connections)
        relay_us = (_cpu_seconds(procs[2].pid or 0) - cpu) / (relay * args.seconds) * 1e6
        cpu = _cpu_seconds(procs[1].pid or 0)
        front, flat = _wrk(front_port, args.seconds, args.connections)
        front_us = (_cpu_seconds(procs[1].pid or 0) - cpu) / (front * args.seconds) * 1e6
    finally:
        for p in procs:
            p.terminate()
    print(f"direct to upstream: {direct:,.0f} req/s  latency {dlat}")
    print(
        f"bare trio relay:    {relay:,.0f} req/s  latency {rlat}  ({relay / direct:.0%})"
        f"  {relay_us:.0f} µs CPU/request"
    )
    print(
        f"through the front:  {front:,.0f} req/s  latency {flat}  ({front / direct:.0%})"
        f"  {front_us:.0f} µs CPU/request"
    )


if __name__ == "__main__":
    sys.exit(main())
