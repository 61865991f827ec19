"""One bidirectional gRPC stream through the HTTP front alone (no tunnel), the front's
HTTP/2 settings varied: what the windows and frame sizes the front announces do to it.

A grpcio echo server (`nodeagent.testing.grpcservice`) in a process of its own, one front
process per variant (an h2c route to that server), the grpcio client in this process:
one stream echoing --kib KiB messages for --seconds, at most 8 messages ahead of their
echoes. Variants, interleaved over --rounds rounds (median, min-max):

  default     the front's settings (`H2Settings`): 4 MiB stream windows within an 8 MiB
              connection window on both legs, frames of up to 256 KiB from both
  old         the settings before: 1 MiB stream windows, 16 KiB frames from the client
              (256 KiB from the backend)
  win32m      4 MiB stream windows, 32 MiB connection windows
  frame1m     1 MiB frames accepted (SETTINGS_MAX_FRAME_SIZE)
  both        both of these
  frame16k    16 KiB frames from the client (4 MiB windows)
  win1m       1 MiB stream windows (256 KiB frames)
  up16k       16 KiB frames from the backend

and `direct`: the client straight to the server (the floor on this machine). Prints the
payload Gbit/s each way and the front's CPU per MiB moved (both ways, /proc).

    .venv/bin/python -m scripts.bench.h2_bidi [--rounds 3] [--seconds 4] [--kib 1024]
    .venv/bin/python -m scripts.bench.h2_bidi --variants default --tree /work/base  # A/B
    .venv/bin/python -m scripts.bench.h2_bidi --profile 4   # cProfile, default variant

`--unary` also makes unary calls through each front (small messages, 16 in flight on one
channel, as `scripts.bench.h2`): calls/s and the front's CPU per call. `--tree PATH` adds
the default variant run from another checkout (its own .venv and code, `PATH` rows),
interleaved with this tree's in each round: before and after a change, in the same run.
`--instructions` counts the front's instructions per MiB moved (per call with `--unary`)
under callgrind, this tree's and --tree's: two runs each (--seconds and three times that,
~50x slower than native), the difference over the difference in work. `--profile SECONDS`
streams for that long (or makes unary calls, with `--unary`) through the default variant
under cProfile and prints the front's top functions.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import trio

from nodeagent.http import Backend, Limits, Route, RouteSpec, RouteTable
from nodeagent.http.balancer import Balancer
from nodeagent.http.connection import GracefulClose
from nodeagent.http.h2connection import H2Connection
from nodeagent.http.h2pool import UPSTREAM_SETTINGS, H2Pool
from nodeagent.http.h2session import PREFACE, H2Settings
from nodeagent.http.stats import HttpStats
from nodeagent.testing.grpcservice import GrpcEcho
from nodeagent.testing.standalone import free_port
from scripts.bench.h2 import bidi_echo, grpc_calls
from scripts.bench.h2_front import run_profiled
from scripts.bench.http_front import _cpu_seconds, open_direct

MIB = 1024 * 1024
VARIANTS: dict[str, dict[str, int]] = {
    "default": {},
    "old": {"stream_window": MIB, "max_frame_size": 16 * 1024,
            "pool_max_frame_size": 256 * 1024},
    "win32m": {"connection_window": 32 * MIB},
    "frame1m": {"max_frame_size": MIB},
    "both": {"connection_window": 32 * MIB, "max_frame_size": MIB},
    "frame16k": {"max_frame_size": 16 * 1024, "pool_max_frame_size": 256 * 1024},
    "win1m": {"stream_window": MIB},
    "up16k": {"pool_max_frame_size": 16 * 1024},
}


def _serve_grpc(port_out: Any) -> None:
    server = GrpcEcho("bench").start()
    port_out.put(server.port)
    threading.Event().wait()


def _run_front(port: int, backend_port: int, overrides: dict[str, int],
               profile: str | None = None) -> None:
    """A front serving h2c only, built from its parts so that its settings can be chosen
    (the product's `HttpFront` uses the defaults)."""
    settings = dataclasses.replace(H2Settings(), **{
        k: v for k, v in overrides.items() if not k.startswith("pool_")})
    pool_settings = dataclasses.replace(UPSTREAM_SETTINGS, **{
        k: v for k, v in overrides.items() if not k.startswith("pool_")})
    pool_settings = dataclasses.replace(pool_settings, **{
        k[5:]: v for k, v in overrides.items() if k.startswith("pool_")})
    route = Route("grpc", (Backend(None, "127.0.0.1", backend_port),),
                  backend_protocol="h2c")
    table = RouteTable.build([RouteSpec(None, "/", route)])
    limits = Limits()
    stats = HttpStats()
    balancer = Balancer(limits.failed_backend_cooldown)
    closing = GracefulClose()

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            pool = H2Pool(nursery, open_direct, limits, settings=pool_settings)

            async def handle(stream: trio.SocketStream) -> None:
                initial = await stream.receive_some(len(PREFACE))
                await H2Connection(stream, lambda: table, open_direct, "http", "bench",
                                   limits, stats, balancer, pool, False, closing,
                                   bytes(initial), settings=settings).run()

            await trio.serve_tcp(handle, port, host="127.0.0.1")

    run_profiled(main, profile)


def _tree_front(tree: str, port: int, backend_port: int, callgrind: str | None = None
                ) -> subprocess.Popen[bytes]:
    """The default variant's front from a checkout (its .venv, its code), under callgrind
    when asked (instructions written to `callgrind`)."""
    code = ("from scripts.bench.h2_bidi import _run_front; "
            f"_run_front({port}, {backend_port}, {{}})")
    argv = [os.path.join(tree, ".venv/bin/python"), "-P", "-c", code]
    if callgrind is not None:
        argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={callgrind}", *argv]
    return subprocess.Popen(argv, cwd=tree, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE if callgrind else None,
                            env=dict(os.environ, PYTHONPATH=tree, PYTHONHASHSEED="0"))


def _instructions(tree: str, grpc_port: int, seconds: float, kib: int, unary: bool
                  ) -> float:
    """Instructions the front spends per MiB moved (both ways), or per unary call: two runs
    under callgrind, `seconds` and three times that, the difference over the difference
    in work (start-up cancels out)."""
    points: list[tuple[int, float]] = []
    for span in (seconds, 3 * seconds):
        with tempfile.TemporaryDirectory() as tmp:
            port = free_port()
            proc = _tree_front(tree, port, grpc_port, os.path.join(tmp, "out"))
            try:
                _wait(port, 600)  # ~50x slower under callgrind
                if unary:
                    work = float(grpc_calls(f"127.0.0.1:{port}", None, span, 16)[1])
                else:
                    work = 2 * bidi_echo(f"127.0.0.1:{port}", span, kib)[1] / MIB
            finally:
                proc.send_signal(signal.SIGINT)
                try:
                    err = proc.communicate(timeout=120)[1].decode()
                except subprocess.TimeoutExpired:
                    proc.terminate()  # valgrind still writes its summary
                    err = proc.communicate(timeout=120)[1].decode()
            found = re.search(r"Collected : (\d+)", err)
            if found is None:
                raise RuntimeError(f"no callgrind summary:\n{err[-2000:]}")
            points.append((int(found.group(1)), work))
    (i1, w1), (i2, w2) = points
    return (i2 - i1) / max(w2 - w1, 1e-9)


def _wait(port: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {port}")


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):,.2f} ({min(values):,.2f}-{max(values):,.2f})"


def _profile(grpc_port: int, seconds: float, kib: int,
             server: multiprocessing.Process, unary: bool) -> int:
    import pstats

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "front.prof")
        port = free_port()
        proc = multiprocessing.Process(target=_run_front, args=(port, grpc_port, {}, out),
                                       daemon=True)
        proc.start()
        try:
            _wait(port)
            if unary:
                rate, calls = grpc_calls(f"127.0.0.1:{port}", None, seconds, 16)
            else:
                rate, moved = bidi_echo(f"127.0.0.1:{port}", seconds, kib)
        finally:
            proc.terminate()
            proc.join(30)
            server.kill()
        print(f"{rate:,.0f} calls/s, {calls} calls" if unary else
              f"{rate:.2f} Gbit/s each way, {moved / MIB:,.0f} MiB echoed")
        pstats.Stats(out).sort_stats("tottime").print_stats(45)
        if os.environ.get("H2_BIDI_KEEP_PROFILE"):
            import shutil

            shutil.copy(out, os.environ["H2_BIDI_KEEP_PROFILE"])
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.h2_bidi", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--kib", type=int, default=1024)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tree", help="another checkout: its default variant beside ours")
    parser.add_argument("--profile", type=float, metavar="SECONDS")
    parser.add_argument("--unary", action="store_true",
                        help="also unary calls (16 in flight, one channel) through each "
                             "front for --seconds: calls/s and the front's CPU per call")
    parser.add_argument("--instructions", action="store_true",
                        help="callgrind: instructions per MiB (per call with --unary) of "
                             "this tree's front and --tree's, one run each")
    args = parser.parse_args()
    ports: multiprocessing.Queue[int] = multiprocessing.Queue()
    server = multiprocessing.Process(target=_serve_grpc, args=(ports,), daemon=True)
    server.start()
    grpc_port = ports.get(timeout=20)
    if args.instructions:
        try:
            here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            unit = "call" if args.unary else "MiB moved"
            for tree in (here, *([args.tree] if args.tree else [])):
                count = _instructions(tree, grpc_port, args.seconds, args.kib, args.unary)
                print(f"{tree}: {count:,.0f} instructions per {unit} (front, callgrind)")
        finally:
            server.kill()
        return 0
    if args.profile:
        return _profile(grpc_port, args.profile, args.kib, server, args.unary)
    fronts: dict[str, tuple[int, multiprocessing.Process | subprocess.Popen[bytes]]] = {}
    rows: dict[str, list[float]] = {}
    try:
        for name in args.variants.split(","):
            port = free_port()
            proc: multiprocessing.Process | subprocess.Popen[bytes] = multiprocessing.Process(
                target=_run_front, args=(port, grpc_port, VARIANTS[name]), daemon=True)
            proc.start()
            fronts[name] = (port, proc)
        if args.tree:
            port = free_port()
            fronts[args.tree] = (port, _tree_front(args.tree, port, grpc_port))
        for port, _ in fronts.values():
            _wait(port)
        bidi_echo(f"127.0.0.1:{grpc_port}", 1, args.kib)  # warm
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
            rate, _ = bidi_echo(f"127.0.0.1:{grpc_port}", args.seconds, args.kib)
            rows.setdefault("direct Gbit/s", []).append(rate)
            for name, (port, proc) in fronts.items():
                cpu = _cpu_seconds(proc.pid or 0)
                rate, moved = bidi_echo(f"127.0.0.1:{port}", args.seconds, args.kib)
                used = _cpu_seconds(proc.pid or 0) - cpu
                rows.setdefault(f"{name} Gbit/s", []).append(rate)
                rows.setdefault(f"{name} front CPU ms/MiB", []).append(
                    used * 1e3 / max(1, 2 * moved / MIB))
                if args.unary:
                    cpu = _cpu_seconds(proc.pid or 0)
                    rate, calls = grpc_calls(f"127.0.0.1:{port}", None, args.seconds, 16)
                    used = _cpu_seconds(proc.pid or 0) - cpu
                    rows.setdefault(f"{name} unary calls/s", []).append(rate)
                    rows.setdefault(f"{name} unary front µs/call", []).append(
                        used * 1e6 / max(1, calls))
    finally:
        for _, proc in fronts.values():
            proc.kill()
        server.kill()
    print(f"\n{'measure':30} median (min-max) over {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, values in rows.items():
        print(f"{name:30} {summary(values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
