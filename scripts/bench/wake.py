"""Benchmark of scale to zero on the server: how fast a held request goes once its route
wakes, what a held request costs, and whether holding many slows the awake routes.

From the repository root:

    .venv/bin/python -m scripts.bench.wake [--wakes 100] [--rounds 3] [--held 10000]

One HTTP front with `HeldRequests` (the server's), a trio upstream, over loopback TCP:

- **wake → forwarded**: a request for a sleeping route is held; then the route table
  gains a backend (what the server does when the controller's config brings the woken
  endpoints) and the time until the upstream receives the request is measured, `--wakes`
  times per round. Baseline in the same round: a request to an awake route, from the
  client's send to the upstream's receive. `--rounds` interleaved rounds; p50 and p99
  per round, median and min-max across rounds.
- **memory per held request**: a child process opens `--held` connections, each sending
  one request to the sleeping route; the front process's Python heap (tracemalloc) grows
  by this much per held request: its connection task, socket, parser and buffers (the
  kernel's socket buffers not counted: they are not the process's). RSS growth is
  printed beside it (only the first round grows the heap; later rounds reuse it).
- **awake routes while holding**: p99 of 300 sequential requests to an awake route with
  no request held, then with `--held` held, interleaved `--rounds` times.

This measures the server's part only. The whole path with real processes (the fake API
server's simulated workloads, controllers, servers, agents: EndpointSlice ready → held
request answered, p50/p99 over 100 wakes) is printed by a slow end-to-end test (root):

    .venv/bin/python -m pytest tests/e2e/test_scale_to_zero.py -m slow -s -k hundred_wakes
"""

from __future__ import annotations

import argparse
import functools
import gc
import multiprocessing
import os
import resource
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import trio

from nodeagent.http import (
    Backend,
    HeldRequests,
    HttpFront,
    Limits,
    Route,
    RouteSpec,
    RouteTable,
    UpstreamUnavailable,
    WakeSpec,
)
from tunnel.tcp import DialFailed, connect_tcp

RESPONSE = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
WAKE = WakeSpec("bench/sleepy", timeout=600.0, max_pending=1_000_000)
REQUEST = b"GET / HTTP/1.1\r\nhost: %s\r\n\r\n"


async def open_direct(backend: Backend, route: Route, client: str = "") -> trio.SocketStream:
    try:
        return await connect_tcp(backend.host, backend.port, connect_timeout=10.0)
    except DialFailed as exc:
        raise UpstreamUnavailable(502, f"cannot connect to {backend}: {exc.message}") from None


class Upstream:
    """Answers every request with 200; notes when each request's head arrived."""

    def __init__(self) -> None:
        self.received: list[float] = []
        self.arrived = trio.Event()

    async def handle(self, stream: trio.SocketStream) -> None:
        buffer = b""
        try:
            while data := await stream.receive_some(65536):
                buffer += data
                while b"\r\n\r\n" in buffer:
                    _, buffer = buffer.split(b"\r\n\r\n", 1)
                    self.received.append(trio.current_time())
                    self.arrived.set()
                    await stream.send_all(RESPONSE)
        except trio.BrokenResourceError:
            pass


def tables(upstream_port: int) -> tuple[RouteTable, RouteTable]:
    """(asleep, awake): sleepy.test without and with its backend; awake.test always up."""
    backend = (Backend(None, "127.0.0.1", upstream_port),)
    always = RouteSpec("awake.test", "/", Route("bench/awake", backend))
    asleep = RouteTable.build([RouteSpec("sleepy.test", "/", Route("bench/sleepy", (),
                                                                  wake=WAKE)), always])
    awake = RouteTable.build([RouteSpec("sleepy.test", "/", Route("bench/sleepy", backend,
                                                                 wake=WAKE)), always])
    return asleep, awake


async def exchange(port: int, host: bytes, sent: list[float] | None = None) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        if sent is not None:
            sent.append(trio.current_time())
        await stream.send_all(REQUEST % host)
        out = b""
        while b"\r\n\r\n" not in out or not out.endswith(b"ok"):
            data = await stream.receive_some(65536)
            if not data:
                break
            out += data
        return out


async def until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(60):
        while not predicate():  # noqa: ASYNC110 (plain data: polled)
            await trio.sleep(0.0005)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def wake_round(front_port: int, up: Upstream, current: list[RouteTable],
                     holds: HeldRequests, asleep: RouteTable, awake: RouteTable, n: int
                     ) -> tuple[list[float], list[float]]:
    """(wake → forwarded, baseline send → received) latencies, n of each, interleaved."""
    woken, direct = [], []
    for _ in range(n):
        current[0] = asleep
        holds.routes_changed()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(exchange, front_port, b"sleepy.test")
            await until(lambda: bool(holds.pending))
            before = len(up.received)
            start = trio.current_time()
            current[0] = awake
            holds.routes_changed()
            await until(lambda before=before: len(up.received) > before)
            woken.append(up.received[before] - start)
        sent: list[float] = []
        before = len(up.received)
        await exchange(front_port, b"awake.test", sent)
        direct.append(up.received[before] - sent[0])
    return woken, direct


def _hold_many(port: int, count: int, ready: Any, go: Any, result: Any) -> None:
    """Child process: `count` connections each sending one request; report how many got
    200 once the parent wakes the route."""
    import socket

    resource.setrlimit(resource.RLIMIT_NOFILE, (count + 100, count + 100))
    socks = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(REQUEST % b"sleepy.test")
        socks.append(s)
    ready.set()
    go.wait()
    ok = 0
    for s in socks:
        s.settimeout(60)
        data = b""
        while b"\r\n\r\n" not in data or len(data) < _answer_length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        ok += data.startswith(b"HTTP/1.1 200")
        s.close()
    result.put(ok)


def _answer_length(data: bytes) -> int:
    """The length of the whole answer whose head `data` starts with (head and body)."""
    head, _, _ = data.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(head) + 4 + int(value)
    return len(head) + 4


def tracemalloc_start() -> int:
    """Trace Python allocations from now on; the bytes traced so far (none)."""
    tracemalloc.start()
    return tracemalloc.get_traced_memory()[0]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def awake_p99(front_port: int, n: int = 300) -> float:
    took = []
    for _ in range(n):
        start = time.perf_counter()
        await exchange(front_port, b"awake.test")
        took.append(time.perf_counter() - start)
    return percentile(took, 99)


async def main(args: argparse.Namespace) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.held * 3 + 200)),
                                                hard))
    # Forwarding every held request at once takes 3 sockets each in this process (the
    # client's, the front's upstream, the upstream's): beyond the fd limit they are
    # released by removing the route instead (404, no upstream).
    forward_all = args.held * 3 + 200 <= hard
    up = Upstream()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(functools.partial(
            trio.serve_tcp, up.handle, 0, host="127.0.0.1"))
        asleep, awake = tables(listeners[0].socket.getsockname()[1])
        gone = RouteTable.build([])
        current = [asleep]
        holds = HeldRequests()
        front = HttpFront(table=lambda: current[0], open_upstream=open_direct, holds=holds,
                          limits=Limits(max_connections=None, max_connections_per_client=None))
        await nursery.start(front.run, "127.0.0.1", 0)
        port = front.port

        print(f"wake → forwarded, {args.wakes} wakes per round, {args.rounds} rounds "
              f"(baseline: an awake route's send → upstream receive)")
        p99s, p50s, base99, base50 = [], [], [], []
        await wake_round(port, up, current, holds, asleep, awake, 10)  # warm up
        for r in range(args.rounds):
            woken, direct = await wake_round(port, up, current, holds, asleep, awake,
                                             args.wakes)
            p50s.append(statistics.median(woken))
            p99s.append(percentile(woken, 99))
            base50.append(statistics.median(direct))
            base99.append(percentile(direct, 99))
            print(f"  round {r + 1}: wake p50 {p50s[-1] * 1e3:.2f} ms p99 "
                  f"{p99s[-1] * 1e3:.2f} ms | baseline p50 {base50[-1] * 1e3:.2f} ms p99 "
                  f"{base99[-1] * 1e3:.2f} ms")

        def line(name: str, values: list[float]) -> str:
            return (f"  {name}: {statistics.median(values) * 1e3:.2f} ms "
                    f"({min(values) * 1e3:.2f}-{max(values) * 1e3:.2f})")
        print(line("wake → forwarded p99, median (min-max)", p99s))
        print(line("wake → forwarded p50", p50s))
        print(line("baseline p99", base99))
        print(f"  ratio of p99s (wake / baseline), median: "
              f"{statistics.median(a / b for a, b in zip(p99s, base99, strict=True)):.2f}")

        # Memory per held request, then the awake route with and without them held.
        current[0] = asleep
        holds.routes_changed()
        ctx = multiprocessing.get_context("spawn")
        quiet, loaded = [], []
        per_request: list[float] = []
        rss_growth: list[float] = []
        for r in range(args.rounds):
            quiet.append(await awake_p99(port))
            gc.collect()
            before, rss_before = tracemalloc_start(), rss()
            ready, go, result = ctx.Event(), ctx.Event(), ctx.Queue()
            child = ctx.Process(target=_hold_many, args=(port, args.held, ready, go, result))
            child.start()
            await trio.to_thread.run_sync(ready.wait)
            await until(lambda: sum(holds.pending.values()) >= args.held)
            gc.collect()
            per_request.append((tracemalloc.get_traced_memory()[0] - before) / args.held)
            tracemalloc.stop()
            rss_growth.append((rss() - rss_before) / args.held)
            loaded.append(await awake_p99(port))
            current[0] = awake if forward_all else gone
            holds.routes_changed()
            go.set()
            ok = await trio.to_thread.run_sync(result.get)
            await trio.to_thread.run_sync(child.join)
            current[0] = asleep
            holds.routes_changed()
            print(f"  round {r + 1}: {args.held} held, Python heap +{per_request[-1]:.0f} B "
                  f"each (RSS +{rss_growth[-1]:.0f} B each: the first round grows the heap, "
                  f"later rounds reuse it); "
                  f"awake route p99 {quiet[-1] * 1e3:.2f} ms idle, {loaded[-1] * 1e3:.2f} ms "
                  f"holding; " + (f"{ok}/{args.held} answered 200 after the wake"
                                  if forward_all else "released by removing the route"))
        print(f"memory per held request, median (min-max): "
              f"{statistics.median(per_request) / 1024:.1f} KiB "
              f"({min(per_request) / 1024:.1f}-{max(per_request) / 1024:.1f})")
        print(f"awake route p99 holding / idle, median: "
              f"{statistics.median(b / a for a, b in zip(quiet, loaded, strict=True)):.2f}")
        nursery.cancel_scope.cancel()


def cli() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.wake",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--wakes", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--held", type=int, default=10_000)
    trio.run(main, parser.parse_args())


if __name__ == "__main__":
    cli()
