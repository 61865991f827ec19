"""The controller's config stream alone: memory per watch, and the cost of a fan-out.

The controller's `ConfigStreamServer` runs in this process over real TLS with a
`ConfigVersions` holding one NodeConfig per node; `scripts.bench.lib.config_clients` (the
agents' own watch code, in another process) opens the watches, `--steps` of them at a
time (default 1,000 then 5,000). At each step, once every watch has its first config and
the heap has settled, it records this process's RSS and a tracemalloc snapshot, and prints
the RSS per watch between steps and (`--tracemalloc`) the largest Python allocations that
grew, by source line (tracemalloc sees Python's allocations only: OpenSSL's
per-connection buffers show in the RSS, not in the list).

Then `--changes` fan-outs: every node's config changes at once (as a ClusterTunnel edit
does), `notify`, and each watch sends its new line. Reported per fan-out: the CPU this
process used (the stream server, plus reading the clients' report lines) per watch, and
the latency from the change to each node's apply (p50, p99). Unlike
`config_propagation`, no API server, informers or recompute: the sending alone, so a
change to it shows. To compare with another checkout, run the same command from that
checkout's directory (with this script copied there): `python -m` imports the tree of
the working directory.

    .venv/bin/python -m scripts.bench.config_fanout [--steps 1000 5000] [--changes 5]
        [--tracemalloc]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import trio

from nodeagent.config import AllowRule, NodeConfig
from nodeagent.controller.compute import ConfigVersions
from nodeagent.controller.configserver import ConfigStreamServer
from nodeagent.runtime.gcfreeze import freeze_survivors_forever
from nodeagent.trust import pki
from scripts import ROOT
from scripts.bench.config_propagation import cpu_seconds


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def snapshot(trace: bool) -> tracemalloc.Snapshot | None:
    return tracemalloc.take_snapshot() if trace else None


def node_config(i: int, change: int) -> NodeConfig:
    """A node's config of a typical size: its two Ingress targets, the node ports."""
    host = f"10.{i // 256 % 256}.{i % 256}"
    return NodeConfig(allow=(AllowRule.model_validate(f"{host}.5:8080"),
                             AllowRule.model_validate(f"{host}.6:8080"),
                             AllowRule.model_validate(f"127.0.0.1:{9000 + change}")),
                      server_replicas=2)


class Applies:
    """The clients' `A <index> <version> <monotonic>` lines: when each node applied
    which version."""

    def __init__(self) -> None:
        self.at: dict[tuple[int, int], float] = {}
        self.count: dict[int, int] = {}  # version → nodes that applied it
        self.changed = trio.Event()

    async def read(self, stream: trio.abc.ReceiveStream) -> None:
        buf = b""
        async for chunk in stream:
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                parts = line.split()
                if len(parts) == 4 and parts[0] == b"A":
                    key = (int(parts[1]), int(parts[2]))
                    if key not in self.at:
                        self.count[key[1]] = self.count.get(key[1], 0) + 1
                    self.at[key] = float(parts[3])
            self.changed.set()
            self.changed = trio.Event()

    async def all_of(self, version: int, nodes: int, within: float) -> list[float]:
        with trio.fail_after(within):
            while self.count.get(version, 0) < nodes:  # cheap: this runs in the measuring
                await self.changed.wait()
        return [self.at[(i, version)] for i in range(nodes)]


async def measure(steps: list[int], top: int, trace: bool, changes: int,
                  profile: Path | None = None) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="nodeagent-cfgmem-"))
    ca = pki.create_ca("bench")
    ca.write(tmp / "ca.crt", tmp / "ca.key")
    leaf = pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"])
    context = pki.server_ssl_context(leaf.certificate, leaf.key_pem, ca.certificate)

    async def tls() -> Any:
        return context

    versions = ConfigVersions()
    for i in range(max(steps)):
        versions.update(f"node/n{i}", node_config(i, 0))
    server = ConfigStreamServer(versions, tls=tls)
    result: dict[str, Any] = {"steps": []}
    clients: list[trio.Process] = []
    applies = Applies()
    async with trio.open_nursery() as nursery:
        try:
            listeners = await nursery.start(server.run, "127.0.0.1", 0)
            port = listeners[0].socket.getsockname()[1]
            # As the `nodeagent controller` process does (gcfreeze.py): without it, full
            # collections walking the watches' objects make a large, random share of the CPU.
            nursery.start_soon(freeze_survivors_forever)
            gc.collect()
            if trace:
                tracemalloc.start(1)
            before, snap = rss(), snapshot(trace)
            opened = 0
            for step in steps:
                proc = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "scripts.bench.lib.config_clients", "--port", str(port),
                     "--ca-cert", str(tmp / "ca.crt"), "--ca-key", str(tmp / "ca.key"),
                     "--first", str(opened), "--count", str(step - opened)],
                    cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                clients.append(proc)
                assert proc.stdout is not None
                nursery.start_soon(applies.read, proc.stdout)
                with trio.fail_after(600):
                    while len(server.subscribers) < step:  # noqa: ASYNC110 (polls another process)
                        await trio.sleep(0.2)
                await trio.sleep(2)  # their first lines sent, handshakes' garbage freed
                gc.collect()
                now, now_snap = rss(), snapshot(trace)
                grew = now_snap.compare_to(snap, "lineno") if now_snap and snap else []
                python = sum(d.size_diff for d in grew)
                row = {"watches": step, "rss_mib": now / 2**20,
                       "rss_per_watch_bytes": (now - before) / (step - opened),
                       "python_per_watch_bytes": python / (step - opened),
                       "top": [{"where": str(d.traceback[0]), "bytes_per_watch":
                                d.size_diff / (step - opened), "count_diff": d.count_diff}
                               for d in grew[:top]]}
                result["steps"].append(row)
                print(f"{step:,} watches: RSS {row['rss_mib']:.1f} MiB, "
                      f"{row['rss_per_watch_bytes']:,.0f} B per added watch" + (
                          f" (tracemalloc: {row['python_per_watch_bytes']:,.0f} B of Python "
                          "objects)" if trace else ""), flush=True)
                for t in row["top"]:
                    print(f"    {t['bytes_per_watch']:8,.0f} B  {t['where']}", flush=True)
                before, snap, opened = now, now_snap, step
            if trace:
                tracemalloc.stop()
            nodes = max(steps)
            await applies.all_of(1, nodes, 600)
            result["fanouts"] = []
            profiler = cProfile.Profile() if profile else None
            for change in range(1, changes + 1):
                await trio.sleep(1)
                configs = [node_config(i, change) for i in range(nodes)]  # as compute made them
                if profiler is not None:
                    profiler.enable()
                cpu, start = time.process_time(), time.monotonic()
                clients_cpu = sum(cpu_seconds(p.pid) for p in clients)
                for i, config in enumerate(configs):
                    versions.update(f"node/n{i}", config)
                server.notify([f"node/n{i}" for i in range(nodes)])
                times = sorted(t - start for t in await applies.all_of(change + 1, nodes, 600))
                used = time.process_time() - cpu
                clients_used = sum(cpu_seconds(p.pid) for p in clients) - clients_cpu
                if profiler is not None:
                    profiler.disable()
                row = {"cpu_us_per_watch": 1e6 * used / nodes,
                       "clients_cpu_us_per_watch": 1e6 * clients_used / nodes,
                       "p50_ms": 1e3 * times[len(times) // 2],
                       "p99_ms": 1e3 * times[int(len(times) * 0.99) - 1], "max_ms": 1e3 * times[-1]}
                result["fanouts"].append(row)
                print(f"fan-out {change} to {nodes:,} watches: {row['cpu_us_per_watch']:.0f} us of "
                      f"CPU per watch (the watchers: {row['clients_cpu_us_per_watch']:.0f} us "
                      f"each), applied p50 {row['p50_ms']:.0f} ms, p99 "
                      f"{row['p99_ms']:.0f} ms", flush=True)
            if profiler is not None and profile is not None:
                profiler.dump_stats(profile)
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
            if result["fanouts"]:
                result["median"] = {k: statistics.median(r[k] for r in result["fanouts"])
                                    for k in result["fanouts"][0]}
                print("median: " + ", ".join(f"{k} {v:,.1f}" for k, v in result["median"].items()),
                      flush=True)
        finally:  # the clients never outlive a failed run (they would reconnect for ever)
            for proc in clients:
                if proc.returncode is None:
                    proc.terminate()
            with trio.move_on_after(10):
                for proc in clients:
                    await proc.wait()
        nursery.cancel_scope.cancel()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.config_fanout",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--changes", type=int, default=5, help="fan-outs to measure")
    parser.add_argument("--tracemalloc", action="store_true",
                        help="also list the Python allocations that grew (slower, and "
                             "tracemalloc's own bookkeeping inflates the RSS figures)")
    parser.add_argument("--profile", type=Path, metavar="FILE",
                        help="cProfile the fan-outs (this process: the stream server and "
                             "the reading of the clients' report lines) into FILE, and "
                             "print the functions that took most")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench-results" / "config_fanout.json")
    args = parser.parse_args()
    started = time.monotonic()
    result = trio.run(measure, sorted(args.steps), args.top, args.tracemalloc,
                      args.changes, args.profile)
    result["seconds"] = time.monotonic() - started
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
