"""WebSocket implementations for the tunnel transport, measured against raw TLS.

Sends N MiB in fixed-size messages over loopback, client → server ("upload": what agents
mostly do) and server → client ("download"), each with the receiver in its own process
(so the two ends do not share one core), for:

  tls-stream / tcp-stream   tunnel.transports.StreamTransport (the reference)
  ours:websockets           tunnel's WebSocketTransport on websockets' sans-IO core
  ours:wsproto              tunnel's WebSocketTransport on wsproto (trio-websocket's core)
  lib:websockets.trio       the websockets library's own trio connection
  lib:trio-websocket        trio-websocket, receive buffer and queue raised for bulk

Prints MB/s and the ratio to raw TLS (and to the reference with the same security: wss
vs tls-stream, ws vs tcp-stream) and writes JSON to bench-results/websocket.json.

From the repository root:

    .venv/bin/python -m scripts.bench.websocket_transports             # 512 MiB per case
    .venv/bin/python -m scripts.bench.websocket_transports --mib 64    # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from nodeagent.trust import pki
from scripts import ROOT
from tunnel.accept import serve
from tunnel.dial import dial
from tunnel.transports import (
    MAX_MESSAGE_SIZE,
    WEBSOCKET_RECEIVE_SIZE,
    Endpoint,
    Transport,
)

IMPLS = ("tls-stream", "tcp-stream", "ours:websockets", "ours:wsproto",
         "lib:websockets.trio", "lib:trio-websocket")
PATH = "/tunnel"


@dataclass
class Case:
    impl: str
    tls: bool
    direction: str  # "upload" (client → server) | "download"

    @property
    def label(self) -> str:
        if self.impl.endswith("-stream"):
            return self.impl
        return f"{'wss' if self.tls else 'ws'} {self.impl}"


class Conn:
    """The least common denominator of every implementation: messages of bytes."""

    def __init__(self, send: Callable[[bytes], Awaitable[None]],
                 receive: Callable[[], Awaitable[bytes]]) -> None:
        self.send = send
        self.receive = receive


def _transport_conn(t: Transport) -> Conn:
    return Conn(t.send, t.receive)


# ----------------------------------------------------------------- server and client ends


@asynccontextmanager
async def serve_one(case: Case, ctx: Any) -> AsyncIterator[tuple[int, trio.Event, list[Conn]]]:
    """Listen on 127.0.0.1:0; yields (port, got-a-connection event, [conn])."""
    got = trio.Event()
    conns: list[Conn] = []
    done = trio.Event()

    async with trio.open_nursery() as nursery:
        if case.impl.endswith("-stream") or case.impl.startswith("ours:"):
            scheme = {"tls-stream": "tls", "tcp-stream": "tcp"}.get(
                case.impl, "wss" if case.tls else "ws")
            impl = case.impl.split(":", 1)[1] if case.impl.startswith("ours:") else "auto"

            async def handler(t: Transport) -> None:
                conns.append(_transport_conn(t))
                got.set()
                await done.wait()

            path = PATH if scheme.startswith("ws") else ""
            bound: list[Endpoint] = await nursery.start(partial(
                serve, f"{scheme}://127.0.0.1:0{path}", handler,
                ssl_context=ctx if case.tls else None, websocket_impl=impl))
            port = bound[0].port
        elif case.impl == "lib:websockets.trio":
            import websockets.exceptions
            import websockets.trio.server

            async def ws_handler(ws: Any) -> None:
                async def recv() -> bytes:
                    try:
                        return bytes(await ws.recv())
                    except websockets.exceptions.ConnectionClosed:
                        return b""
                conns.append(Conn(ws.send, recv))
                got.set()
                await done.wait()

            server = await nursery.start(partial(
                websockets.trio.server.serve, ws_handler, 0, host="127.0.0.1",
                ssl=ctx if case.tls else None, compression=None, max_size=MAX_MESSAGE_SIZE,
                ping_interval=None))
            port = server.listeners[0].socket.getsockname()[1]
        else:
            import trio_websocket

            async def tw_handler(request: Any) -> None:
                ws = await request.accept()

                async def recv() -> bytes:
                    try:
                        return bytes(await ws.get_message())
                    except trio_websocket.ConnectionClosed:
                        return b""
                conns.append(Conn(ws.send_message, recv))
                got.set()
                await done.wait()

            server = await nursery.start(partial(
                trio_websocket.serve_websocket, tw_handler, "127.0.0.1", 0,
                ctx if case.tls else None, message_queue_size=16,
                max_message_size=MAX_MESSAGE_SIZE, receive_buffer_size=WEBSOCKET_RECEIVE_SIZE))
            port = server.port
        try:
            yield port, got, conns
        finally:
            done.set()
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def connect(case: Case, port: int, ctx: Any) -> AsyncIterator[Conn]:
    if case.impl.endswith("-stream") or case.impl.startswith("ours:"):
        scheme = {"tls-stream": "tls", "tcp-stream": "tcp"}.get(
            case.impl, "wss" if case.tls else "ws")
        impl = case.impl.split(":", 1)[1] if case.impl.startswith("ours:") else "auto"
        path = PATH if scheme.startswith("ws") else ""
        t = await dial(f"{scheme}://127.0.0.1:{port}{path}",
                       ssl_context=ctx if case.tls else None, websocket_impl=impl)
        try:
            yield _transport_conn(t)
        finally:
            await t.aclose()
    elif case.impl == "lib:websockets.trio":
        import websockets.exceptions
        import websockets.trio.client

        async with websockets.trio.client.connect(
                f"{'wss' if case.tls else 'ws'}://127.0.0.1:{port}{PATH}",
                ssl=ctx if case.tls else None, compression=None, max_size=MAX_MESSAGE_SIZE,
                ping_interval=None, proxy=None) as ws:
            async def recv() -> bytes:
                try:
                    return bytes(await ws.recv())
                except websockets.exceptions.ConnectionClosed:
                    return b""
            yield Conn(ws.send, recv)
    else:
        import trio_websocket

        async with trio_websocket.open_websocket(
                "127.0.0.1", port, PATH, use_ssl=ctx if case.tls else False,
                message_queue_size=16, max_message_size=MAX_MESSAGE_SIZE,
                receive_buffer_size=WEBSOCKET_RECEIVE_SIZE) as ws:
            async def recv() -> bytes:
                try:
                    return bytes(await ws.get_message())
                except trio_websocket.ConnectionClosed:
                    return b""
            yield Conn(ws.send_message, recv)


async def pump(conn: Conn, total: int, message: bytes) -> None:
    sent = 0
    while sent < total:
        chunk = message if total - sent >= len(message) else message[:total - sent]
        await conn.send(chunk)
        sent += len(chunk)


async def drain(conn: Conn, total: int) -> None:
    got = 0
    while got < total:
        data = await conn.receive()
        if not data:
            raise RuntimeError(f"connection ended after {got} of {total} bytes")
        got += len(data)


# ------------------------------------------------------------------------------- roles


async def run_server(case: Case, total: int, message_size: int, cert: str, key: str) -> None:
    ctx = pki.server_ssl_context(cert, key) if case.tls else None
    message = os.urandom(message_size)
    async with serve_one(case, ctx) as (port, got, conns):
        print(port, flush=True)
        await got.wait()
        conn = conns[0]
        if case.direction == "upload":
            data = await conn.receive()
            cpu = time.process_time()  # from the first message on
            await drain(conn, total - len(data))
            cpu = time.process_time() - cpu
            await conn.send(b"k")
        else:
            await conn.receive()  # "go"
            cpu = time.process_time()
            await pump(conn, total, message)
            cpu = time.process_time() - cpu
        print(f"cpu {cpu:.6f}", flush=True)
        # Wait for the client to hang up.
        with trio.move_on_after(30):
            while await conn.receive():
                pass


async def run_client(case: Case, port: int, total: int, message_size: int,
                     ca: str) -> tuple[float, float]:
    """(wall seconds, client CPU seconds) for the transfer."""
    ctx = pki.client_ssl_context(ca) if case.tls else None
    message = os.urandom(message_size)
    async with connect(case, port, ctx) as conn:
        start = time.perf_counter()
        cpu = time.process_time()
        if case.direction == "upload":
            await pump(conn, total, message)
            cpu = time.process_time() - cpu
            ack = await conn.receive()
            if ack != b"k":
                raise RuntimeError(f"expected the server's ack, got {ack[:20]!r}")
        else:
            await conn.send(b"g")
            await drain(conn, total)
            cpu = time.process_time() - cpu
        return time.perf_counter() - start, cpu


@dataclass
class Measured:
    seconds: float
    client_cpu: float
    server_cpu: float


def measure(case: Case, total: int, message_size: int, files: dict[str, str]) -> Measured:
    server = subprocess.Popen(
        [sys.executable, "-m", "scripts.bench.websocket_transports", "--serve", case.impl,
         "--direction", case.direction,
         "--bytes", str(total), "--message-kib", str(message_size // 1024),
         "--cert", files["cert"], "--key", files["key"]] + (["--tls"] if case.tls else []),
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())
        seconds, client_cpu = trio.run(run_client, case, port, total, message_size,
                                       files["ca"])
        out, _ = server.communicate(timeout=60)
        if server.returncode:
            raise RuntimeError(f"server for {case.label} exited with {server.returncode}")
        server_cpu = float(out.split()[-1])
        return Measured(seconds, client_cpu, server_cpu)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.websocket_transports",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="data per case (MiB)")
    parser.add_argument("--message-kib", type=int, default=64, help="message size (KiB)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; best is kept")
    parser.add_argument("--impl", action="append", choices=IMPLS,
                        help="only these implementations (repeatable)")
    parser.add_argument("--json", default=str(ROOT / "bench-results" / "websocket.json"))
    # Internal: the server end of one case.
    parser.add_argument("--serve", choices=IMPLS, help=argparse.SUPPRESS)
    parser.add_argument("--direction", help=argparse.SUPPRESS)
    parser.add_argument("--bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tls", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cert", help=argparse.SUPPRESS)
    parser.add_argument("--key", help=argparse.SUPPRESS)
    args = parser.parse_args()
    message_size = args.message_kib * 1024

    if args.serve:
        trio.run(run_server, Case(args.serve, args.tls, args.direction), args.bytes,
                 message_size, args.cert, args.key)
        return 0

    total = args.mib * 1024 * 1024
    impls = args.impl or list(IMPLS)
    cases: list[Case] = []
    for direction in ("upload", "download"):
        for impl in impls:
            if impl == "tls-stream":
                cases.append(Case(impl, True, direction))
            elif impl == "tcp-stream":
                cases.append(Case(impl, False, direction))
            else:
                cases += [Case(impl, True, direction), Case(impl, False, direction)]

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        ca = pki.create_ca()
        server_cert = pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"])
        files = {"ca": f"{tmp}/ca.pem", "cert": f"{tmp}/cert.pem", "key": f"{tmp}/key.pem"}
        pki.write_certificate(files["ca"], ca.certificate)
        server_cert.write(files["cert"], files["key"])
        print(f"{args.mib} MiB per case in {args.message_kib} KiB messages, loopback, "
              f"receiver in its own process; best of {args.repeat}", flush=True)
        # Rounds over all cases (not N runs of one case after another), so a burst of
        # load from elsewhere on the machine does not land on one implementation only.
        runs: dict[int, list[Measured]] = {i: [] for i in range(len(cases))}
        for round_ in range(args.repeat):
            for i, case in enumerate(cases):
                m = measure(case, total, message_size, files)
                runs[i].append(m)
                print(f"  [{round_ + 1}/{args.repeat}] {case.direction:8} {case.label:22} "
                      f"{total / m.seconds / 1e6:8.1f} MB/s", flush=True)
        mib = total / 2**20
        for i, case in enumerate(cases):
            best = min(runs[i], key=lambda m: m.seconds)
            client_cpu = min(m.client_cpu for m in runs[i])
            server_cpu = min(m.server_cpu for m in runs[i])
            results.append({
                **asdict(case), "label": case.label, "seconds": round(best.seconds, 3),
                "mb_per_s": round(total / best.seconds / 1e6, 1),
                "sender_cpu_ms_per_mib": round(1e3 * (
                    client_cpu if case.direction == "upload" else server_cpu) / mib, 3),
                "receiver_cpu_ms_per_mib": round(1e3 * (
                    server_cpu if case.direction == "upload" else client_cpu) / mib, 3),
                # What the slower end could do with a core to itself: robust to other
                # load on the machine, unlike the wall-clock rate.
                "cpu_bound_mb_per_s": round(total / max(client_cpu, server_cpu) / 1e6, 1),
            })

    def rate_of(impl: str, direction: str) -> float | None:
        return next((r["mb_per_s"] for r in results
                     if r["impl"] == impl and r["direction"] == direction), None)

    print()
    print(f"{'direction':9} {'implementation':26} {'MB/s':>8} {'Gbit/s':>7} "
          f"{'vs tls':>7} {'vs same':>8} {'send ms/MiB':>12} {'recv ms/MiB':>12} "
          f"{'CPU-bound MB/s':>15}")
    for r in results:
        tls_ref = rate_of("tls-stream", r["direction"])
        same_ref = rate_of("tls-stream" if r["tls"] else "tcp-stream", r["direction"])
        r["ratio_vs_tls_stream"] = round(r["mb_per_s"] / tls_ref, 3) if tls_ref else None
        r["ratio_vs_same_security_stream"] = (
            round(r["mb_per_s"] / same_ref, 3) if same_ref else None)
        fmt = lambda x: f"{x:.2f}x" if x is not None else "-"  # noqa: E731
        print(f"{r['direction']:9} {r['label']:26} {r['mb_per_s']:8.1f} "
              f"{r['mb_per_s'] * 8 / 1000:7.2f} {fmt(r['ratio_vs_tls_stream']):>7} "
              f"{fmt(r['ratio_vs_same_security_stream']):>8} "
              f"{r['sender_cpu_ms_per_mib']:12.2f} {r['receiver_cpu_ms_per_mib']:12.2f} "
              f"{r['cpu_bound_mb_per_s']:15.1f}")

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "benchmark": "websocket",
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
        "params": {"mib": args.mib, "message_kib": args.message_kib, "repeat": args.repeat},
        "results": results,
    }, indent=2) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
