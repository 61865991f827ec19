"""The HTTP front's CPU per request over HTTP/2 against HTTP/1.1, the front alone (no tunnel):
h2load → front → backend over loopback TCP, and the `h2` library's own floor.

The machine's load moves req/s; CPU per request of the front process moves much less, and
it is what the h2 path spends beside the HTTP/1.1 path. Four paths, interleaved over
--rounds rounds (median, min-max of the front's CPU µs per request):

  h1          h2load --h1, 16 connections, one request at a time, to an HTTP/1.1 backend
  h2          h2load, 16 connections x 10 streams (h2c prior knowledge), same backend
  h2c         the same to nghttpd serving 1 KiB over h2c (one shared upstream connection)
  h1-h2c      h2load --h1 to the h2c backend (an HTTP/1.1 client translated to h2c)

and `nghttpd`: h2load 16 x 10 straight to nghttpd (no front), nghttpd's CPU per request: what
a compiled HTTP/2 server (nghttp2's C library) spends per request, sockets included, and
`floor`: the `h2` library alone in memory, a client and a server connection passing
the same requests (h2load's request head, 10 per read, a 1 KiB response), the server's and
the client's side timed apart: what any front built on `h2` spends per request at least.

    .venv/bin/python -m scripts.bench.h2_front [--rounds 3] [--requests 20000]
    .venv/bin/python -m scripts.bench.h2_front --profile h2 --requests 20000   # cProfile
    .venv/bin/python -m scripts.bench.h2_front --instructions h2 --requests 300   # callgrind

`--profile PATH` runs the front under cProfile for that path and prints its top functions
(H2_FRONT_KEEP_PROFILE=FILE keeps the pstats file). `--instructions PATH` runs the front
under valgrind's callgrind twice (N and 2N requests, N at most 2,000) and prints the
instructions per request (the difference over N: start-up cancels out), steady where CPU
time is not; ~80x slower, a few minutes per path for N=300. Needs h2load (nghttp2-client)
and nghttpd (nghttp2-server).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from nodeagent.http import Backend, HttpFront, Route, RouteSpec, RouteTable
from nodeagent.testing.standalone import free_port
from scripts.bench.http_front import BODY, _cpu_seconds, _run_upstream, open_direct

PATHS = ("h1", "h2", "h2c", "h1-h2c")


def _run_front(port: int, h1_port: int, h2c_port: int, profile: str | None) -> None:
    h1 = Route("h1", (Backend(None, "127.0.0.1", h1_port),))
    h2c = Route("h2c", (Backend(None, "127.0.0.1", h2c_port),), backend_protocol="h2c")
    table = RouteTable.build([RouteSpec(None, "/", h1), RouteSpec("h2c.test", "/", h2c)])
    front = HttpFront(table=lambda: table, open_upstream=open_direct)
    run_profiled(lambda: front.run("127.0.0.1", port), profile)


def run_profiled(main: Callable[[], Awaitable[object]], profile: str | None) -> None:
    """`trio.run(main)`; with `profile`, under cProfile, its stats written to that path
    when the process is sent SIGTERM (how the benchmarks stop a front)."""
    if profile is None:
        trio.run(main)
        return
    import cProfile

    prof = cProfile.Profile()

    def stop(*_: object) -> None:
        prof.disable()
        prof.dump_stats(profile)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    prof.enable()
    trio.run(main)


def h2load(port: int, path: str, requests: int) -> tuple[float, int]:
    """req/s and requests done."""
    args = ["h2load", "-t1", f"-n{requests}", "-c16"]
    args += ["--h1", "-m1"] if path in ("h1", "h1-h2c") else ["-m10"]
    if path in ("h2c", "h1-h2c"):
        args += ["-H", ":authority: h2c.test"]  # Host on HTTP/1.1
    out = subprocess.run([*args, f"http://127.0.0.1:{port}/bench"], capture_output=True,
                         text=True, check=True).stdout
    rate = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out)
    ok = re.search(r"(\d+) succeeded, (\d+) failed", out)
    if rate is None or ok is None or int(ok.group(2)):
        raise RuntimeError(f"h2load {args} failed:\n{out}")
    return float(rate.group(1)), int(ok.group(1))


def floor(requests: int, batch: int = 10) -> tuple[float, float]:
    """µs of CPU per request the `h2` library spends: server side, client side."""
    import h2.config
    import h2.connection
    import h2.events

    head = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/bench"),
            (b":authority", b"127.0.0.1:8080"), (b"accept", b"*/*"),
            (b"accept-encoding", b"gzip, deflate"), (b"user-agent", b"h2load nghttp2/1.52.0")]
    resp = [(b":status", b"200"), (b"content-type", b"text/plain"),
            (b"content-length", b"1024")]
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None))
    server = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None,
                                  validate_outbound_headers=False,
                                  normalize_outbound_headers=False))
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    pending = client.data_to_send()
    in_server = in_client = 0.0
    clock = time.process_time
    for _ in range(requests // batch):
        t0 = clock()
        for _ in range(batch):
            client.send_headers(client.get_next_available_stream_id(), head, end_stream=True)
        wire = pending + client.data_to_send()
        t1 = clock()
        for ev in server.receive_data(wire):
            if isinstance(ev, h2.events.RequestReceived):
                server.send_headers(ev.stream_id, resp)
                server.send_data(ev.stream_id, BODY, end_stream=True)
        out = server.data_to_send()
        t2 = clock()
        got = 0
        for ev in client.receive_data(out):
            if isinstance(ev, h2.events.DataReceived):
                got += ev.flow_controlled_length
        client.increment_flow_control_window(got)
        pending = client.data_to_send()
        t3 = clock()
        in_server += t2 - t1
        in_client += (t1 - t0) + (t3 - t2)
    n = requests // batch * batch
    return in_server / n * 1e6, in_client / n * 1e6


class Stack:
    """The backends and the front, each a process of its own."""

    def __init__(self, profile: str | None = None, valgrind: Path | None = None) -> None:
        self.h1_port, self.h2c_port, self.port = free_port(), free_port(), free_port()
        self.work = Path(tempfile.mkdtemp(prefix="bench-h2front-"))
        (self.work / "bench").write_bytes(BODY)
        self.h1 = multiprocessing.Process(target=_run_upstream, args=(self.h1_port,),
                                          daemon=True)
        self.h1.start()
        self.nghttpd = subprocess.Popen(
            [shutil.which("nghttpd") or "/usr/sbin/nghttpd", "--no-tls", "-a", "127.0.0.1",
             "-d", str(self.work), str(self.h2c_port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if valgrind is not None:
            code = ("from scripts.bench.h2_front import _run_front; "
                    f"_run_front({self.port}, {self.h1_port}, {self.h2c_port}, None)")
            self.front: subprocess.Popen[bytes] | multiprocessing.Process = subprocess.Popen(
                ["valgrind", "--tool=callgrind", f"--callgrind-out-file={valgrind}",
                 sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE, env=dict(os.environ, PYTHONHASHSEED="0"))
        else:
            self.front = multiprocessing.Process(
                target=_run_front, args=(self.port, self.h1_port, self.h2c_port, profile),
                daemon=True)
            self.front.start()
        deadline = time.monotonic() + (600 if valgrind else 10)  # callgrind: ~80x slower
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=5).close()
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("the front did not start")

    @property
    def pid(self) -> int:
        return self.front.pid or 0

    def stop(self) -> str:
        """Stop everything; callgrind's summary (stderr) when under valgrind."""
        err = ""
        if isinstance(self.front, subprocess.Popen):
            self.front.send_signal(signal.SIGINT)
            try:
                err = self.front.communicate(timeout=300)[1].decode()
            except subprocess.TimeoutExpired:
                # Under callgrind the front sometimes sleeps on after SIGINT (seen on
                # both trees; it exits natively); valgrind still writes the summary, with
                # the instructions so far, when terminated.
                self.front.terminate()
                err = self.front.communicate(timeout=300)[1].decode()
        else:
            self.front.terminate()
            self.front.join(30)
        self.h1.kill()
        self.nghttpd.kill()
        shutil.rmtree(self.work, ignore_errors=True)
        return err


def _collected(summary: str) -> int:
    match = re.search(r"Collected : (\d+)", summary)
    if match is None:
        raise RuntimeError(f"no callgrind summary:\n{summary}")
    return int(match.group(1))


def instructions(path: str, requests: int) -> float:
    """Instructions the front spends per request on `path` (2N run minus N run, over N)."""
    counts = []
    for n in (requests, 2 * requests):
        with tempfile.TemporaryDirectory() as tmp:
            stack = Stack(valgrind=Path(tmp) / "callgrind.out")
            try:
                h2load(stack.port, path, 50)  # connections and dynamic tables warm
                h2load(stack.port, path, n)
            finally:
                counts.append(_collected(stack.stop()))
    return (counts[1] - counts[0]) / requests


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):,.1f} ({min(values):,.1f}-{max(values):,.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.h2_front", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--paths", default=",".join(PATHS),
                        help=f"comma-separated, of {', '.join(PATHS)}")
    parser.add_argument("--profile", choices=PATHS)
    parser.add_argument("--instructions", choices=PATHS)
    args = parser.parse_args()
    if args.instructions:
        n = min(args.requests, 2000)
        print(f"{args.instructions}: {instructions(args.instructions, n):,.0f} "
              f"instructions per request (front, callgrind, {n} vs {2 * n} requests)")
        return 0
    if args.profile:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "front.prof"
            stack = Stack(profile=str(out))
            try:
                h2load(stack.port, args.profile, args.requests)
            finally:
                stack.stop()
            import pstats

            pstats.Stats(str(out)).sort_stats("tottime").print_stats(45)
            if os.environ.get("H2_FRONT_KEEP_PROFILE"):
                shutil.copy(out, os.environ["H2_FRONT_KEEP_PROFILE"])
        return 0
    paths = args.paths.split(",")
    rows: dict[str, list[float]] = {}
    stack = Stack()
    try:
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
            for path in paths:
                h2load(stack.port, path, 200)
                cpu = _cpu_seconds(stack.pid)
                rate, done = h2load(stack.port, path, args.requests)
                used = _cpu_seconds(stack.pid) - cpu
                rows.setdefault(f"{path} front µs/request", []).append(used / done * 1e6)
                rows.setdefault(f"{path} req/s", []).append(rate)
            cpu = _cpu_seconds(stack.nghttpd.pid)
            _, done = h2load(stack.h2c_port, "h2", args.requests)
            used = _cpu_seconds(stack.nghttpd.pid) - cpu
            rows.setdefault("nghttpd alone µs/request", []).append(used / done * 1e6)
            server, client = floor(args.requests)
            rows.setdefault("floor: h2 server side µs/request", []).append(server)
            rows.setdefault("floor: h2 client side µs/request", []).append(client)
    finally:
        stack.stop()
    print(f"\n{'measure':36} median (min-max) over {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, values in rows.items():
        print(f"{name:36} {summary(values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
