"""What an idle relayed stream costs in memory today, and how much of it is its task.

One trio process holds both tunnel endpoints (as `tunnel_cpu` does, over loopback TCP):
the acceptor plays the agent, relaying each stream the dialer opens to a TCP echo
target in another process (benchtool's C echo) with the production path
(`tunnel.relay.relay_incoming` → `splice`, whose tunnel → socket direction needs no
task); the dialer plays the server's side of the tunnel and just holds its streams.
`--streams` streams are opened, each proven by a 1-byte echo, and left idle, twice:
the first batch for the RSS per stream (tracemalloc off: its bookkeeping would dwarf
it), the second between two tracemalloc snapshots for the Python memory per idle
stream, grouped:

- task: what exists because a task carries the stream: trio's Task and its trap
  objects, and every coroutine frame of the chain it waits in, from the handler down to
  the socket read (a frame is allocated at the `await` line that calls its coroutine);
- socket: the upstream socket, its trio wrappers and its epoll registration;
- stream: the tunnel stream's own state (on both endpoints, so per side about half);
- other: everything else, by source line with `--top`.

tracemalloc sees Python's allocations only; the RSS delta per stream is printed beside
it (both endpoints' share; the kernel's socket buffers are in neither). From the
repository root:

    .venv/bin/python -m scripts.bench.idle_stream_cost [--streams 2000] [--top 12]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import linecache
import socket
import subprocess
import tempfile
import tracemalloc
from pathlib import Path
from typing import Any

import trio

from scripts.bench.lib.loopback import allow_any_peer, tcp_pair
from scripts.bench.lib.tools import build_benchtool
from tunnel import protocol as p
from tunnel.endpoint import EndpointSettings, IncomingStream, TunnelConnection
from tunnel.relay import relay_incoming
from tunnel.transports import PeerInfo, StreamTransport

# The task's share: trio's own objects for a waiting task, and every coroutine frame of
# the chain it waits in (a coroutine's frame is allocated at the line that calls it: an
# `await` line, or the task's start).
TASK_FILES = ("trio/_core/_run.py", "trio/_core/_traps.py", "outcome/", "trio/_util.py",
              "<attrs generated")
GROUPS = (
    ("socket", ("trio/_socket.py", "trio/_highlevel_socket.py", "trio/_highlevel_open_tcp",
                "/socket.py", "trio/_core/_io_epoll.py")),
    ("stream", ("tunnel/stream.py", "tunnel/endpoint.py", "tunnel/protocol",
                "tunnel/flow.py")),
)


def group_of(filename: str, lineno: int) -> str:
    if any(part in filename for part in TASK_FILES) or \
            "await " in linecache.getline(filename, lineno):
        return "task"
    for name, parts in GROUPS:
        if any(part in filename for part in parts):
            return name
    return "other"


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ignore(result: object) -> None:
    pass


async def measure(streams: int, top: int, awaited: bool = False) -> dict[str, Any]:
    tool = build_benchtool(Path(tempfile.gettempdir()) / "nodeagent-benchtool")
    port = free_port()
    echo = await trio.lowlevel.open_process([str(tool), "echo", str(port)],
                                            stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                await trio.sleep(0.05)

        async def relay(incoming: IncomingStream) -> None:
            # As the agent does: handed over to the connection's splice loop, so the
            # handler's task ends (--awaited: the handler waits for the end, as before).
            await relay_incoming(incoming, functools.partial(trio.open_tcp_stream,
                                                             "127.0.0.1", port),
                                 on_finished=None if awaited else _ignore)

        a, b = tcp_pair()
        settings = EndpointSettings(ping_interval=0, open_rate=1e9)
        dialer = TunnelConnection(StreamTransport(trio.SocketStream(
            trio.socket.from_stdlib_socket(a)), PeerInfo("server")), p.Role.DIALER,
            settings, None)
        agent = TunnelConnection(StreamTransport(trio.SocketStream(
            trio.socket.from_stdlib_socket(b)), PeerInfo("agent")), p.Role.ACCEPTOR,
            settings, relay)
        held = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent.accept_handshake, allow_any_peer)
            await dialer.dial_handshake(p.Hello(identity={"node": "micro"}))
            await nursery.start(dialer.run)
            await nursery.start(agent.run)

            async def open_one() -> Any:
                stream = await dialer.open_stream(p.Target("127.0.0.1", port), {})
                await stream.send_all(b"x")
                assert await stream.receive_some(1) == b"x"
                return stream

            for _ in range(20):  # warm up: first-use allocations are not per stream
                held.append(await open_one())
            gc.collect()
            await trio.sleep(0.5)
            # RSS first, without tracemalloc (its bookkeeping would be most of the delta)
            rss_before = rss()
            for _ in range(streams):
                held.append(await open_one())
            await trio.sleep(0.5)
            gc.collect()
            rss_after = rss()
            tracemalloc.start(25)
            before = tracemalloc.take_snapshot()
            for _ in range(streams):
                held.append(await open_one())
            await trio.sleep(0.5)
            gc.collect()
            after = tracemalloc.take_snapshot()
            tracemalloc.stop()
            nursery.cancel_scope.cancel()
    finally:
        echo.terminate()
        await echo.wait()
    groups: dict[str, float] = {}
    lines: dict[str, float] = {}
    for diff in after.compare_to(before, "traceback"):
        frame = diff.traceback[-1] if diff.traceback else None
        # The innermost frame that is not the bench itself names the owner.
        frames = [f for f in reversed(diff.traceback) if "scripts/bench" not in f.filename]
        frame = frames[0] if frames else frame
        where = f"{frame.filename}:{frame.lineno}" if frame else "?"
        group = group_of(frame.filename, frame.lineno) if frame else "other"
        groups[group] = groups.get(group, 0.0) + diff.size_diff / streams
        lines[where] = lines.get(where, 0.0) + diff.size_diff / streams
    total = sum(groups.values())
    result = {"streams": streams, "python_bytes_per_stream": total,
              "rss_bytes_per_stream": (rss_after - rss_before) / streams,
              "groups": groups,
              "top": sorted(lines.items(), key=lambda kv: -kv[1])[:top]}
    print(f"{streams:,} idle relayed streams, both tunnel endpoints in this process:")
    print(f"  Python objects per stream: {total:,.0f} B "
          f"(RSS delta {result['rss_bytes_per_stream']:,.0f} B)")
    for name, size in sorted(groups.items(), key=lambda kv: -kv[1]):
        print(f"    {name:8} {size:8,.0f} B  {100 * size / total:4.0f} %")
    print("  largest, by the innermost frame that allocated:")
    for where, size in result["top"]:
        print(f"    {size:8,.0f} B  {where.split('site-packages/')[-1]}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.idle_stream_cost",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--awaited", action="store_true",
                        help="the handler task waits for the splice's end (the old way)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = parser.parse_args()
    result = trio.run(measure, args.streams, args.top, args.awaited)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
