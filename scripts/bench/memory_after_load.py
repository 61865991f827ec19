"""Memory of the server and the agent at 1,000 idle connections, before and after load.

Real processes on loopback (the nodeagent CLI: a server and an agent over TLS, a TCP
mapping to a C echo target, an HTTP route to a keep-alive HTTP/1.1 upstream), driven
from this process:

1. before: 1,000 connections through the TCP mapping, each proven by a 1-byte echo, held
   idle; each process's RSS is read once it settles; then they are closed;
2. then `--rounds` rounds of: a bulk phase (`--streams` streams through the mapping,
   `--mib` MiB each way each), an HTTP phase (wrk through the HTTP front for
   `--http-seconds`), and the same 1,000 idle connections measured again.

Reports, per process, RSS at start, at 1,000 idle connections before the load and after
each round, and the after/before ratio: median with min-max over the rounds (with PSS, USS
and RSS's anonymous and file-backed parts at start and after each round:
scripts/bench/lib/procmem.py). The tree's bytecode is written first. The goal
(issue 25): within 10 % of the before figure, and ≤ 40 MiB per process. From the
repository root:

    .venv/bin/python -m scripts.bench.memory_after_load [--rounds 3] [--out FILE]
    .venv/bin/python -m scripts.bench.memory_after_load --tree /tmp/before  # another checkout

Needs wrk and a C compiler (benchtool's echo). About two minutes with the defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from nodeagent.testing.procs import NodeagentProcess, rss_kib
from nodeagent.testing.standalone import (
    Upstream,
    UpstreamHandler,
    agent_config,
    free_port,
    http_port,
    listen_port,
    make_certs,
    server_config,
)
from scripts.bench.lib.procmem import compile_bytecode, smaps
from scripts.bench.lib.tools import build_benchtool

IDLE = 1000
SETTLE = 2.0  # seconds after the last change before RSS is read


class KeepAliveHandler(UpstreamHandler):
    """The sample upstream with HTTP/1.1 keep-alive, as a real backend has."""

    protocol_version = "HTTP/1.1"


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # wrk resets its connections at the end: no traceback per connection


@contextlib.contextmanager
def http_upstream() -> Iterator[int]:
    httpd = QuietServer(("127.0.0.1", 0), KeepAliveHandler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield int(httpd.server_address[1])
    finally:
        httpd.shutdown()
        httpd.server_close()


@contextlib.contextmanager
def echo_target(work: Path) -> Iterator[int]:
    tool = build_benchtool(Path(tempfile.gettempdir()) / "nodeagent-benchtool")
    port = free_port()
    proc = subprocess.Popen([str(tool), "echo", str(port)], stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait()


def open_idle(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"x")
        if sock.recv(1) != b"x":
            raise RuntimeError("an idle connection did not echo")
        socks.append(sock)
    return socks


def bulk(port: int, streams: int, mib: int) -> float:
    """`streams` connections through the mapping, each echoing `mib` MiB; seconds taken."""
    chunk = b"b" * 65536
    total = mib * 2**20
    errors: list[BaseException] = []

    def one() -> None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                def send() -> None:
                    for _ in range(total // len(chunk)):
                        sock.sendall(chunk)
                    sock.shutdown(socket.SHUT_WR)
                sender = threading.Thread(target=send)
                sender.start()
                got = 0
                while data := sock.recv(262144):
                    got += len(data)
                sender.join()
                if got != total:
                    raise RuntimeError(f"bulk: {got} of {total} bytes came back")
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    start = time.monotonic()
    threads = [threading.Thread(target=one) for _ in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.monotonic() - start


def http_load(port: int, seconds: int) -> float:
    """wrk through the HTTP front (Host app.test); requests per second."""
    out = subprocess.run(["wrk", "-t2", "-c32", f"-d{seconds}s", "-H", "Host: app.test",
                          f"http://127.0.0.1:{port}/"], capture_output=True, text=True,
                         check=True).stdout
    for line in out.splitlines():
        if line.startswith("Requests/sec:"):
            return float(line.split()[1])
    raise RuntimeError(f"no wrk figure in:\n{out}")


def rss_mib(procs: dict[str, NodeagentProcess]) -> dict[str, float]:
    return {name: rss_kib(proc.proc.pid) / 1024 for name, proc in procs.items()
            if proc.proc is not None}


def detail(procs: dict[str, NodeagentProcess]) -> dict[str, dict[str, Any]]:
    """RSS, PSS, USS, anonymous and file-backed MiB (scripts/bench/lib/procmem.py)."""
    return {name: smaps(proc.proc.pid) for name, proc in procs.items()
            if proc.proc is not None}


def fmt_detail(mem: dict[str, dict[str, Any]]) -> str:
    return "; ".join(f"{name} RSS {m['rss']:.1f} (anonymous {m['anon']:.1f}, file-backed "
                     f"{m['file']:.1f}) PSS {m['pss']:.1f} USS {m['uss']:.1f}"
                     for name, m in mem.items())


def idle_rss(procs: dict[str, NodeagentProcess], port: int,
             details: list[dict[str, dict[str, Any]]] | None = None) -> dict[str, float]:
    socks = open_idle(port, IDLE)
    try:
        time.sleep(SETTLE)
        if details is not None:
            details.append(detail(procs))
        return rss_mib(procs)
    finally:
        for sock in socks:
            sock.close()
        time.sleep(SETTLE)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("wrk") is None:
        raise SystemExit("needs wrk (apt-get install -y wrk)")
    with tempfile.TemporaryDirectory() as tmp, http_upstream() as http_target, \
            echo_target(Path(tmp)) as echo:
        work = Path(tmp)
        # Bytecode written, as an installed nodeagent has it: without it each start
        # compiles every module, and the compiler's freed memory stays in the heap.
        compile_bytecode((args.tree or Path.cwd()).resolve())
        if args.tree is not None:
            # The processes run the other checkout's code: first on their path, and
            # this tree's (their working directory otherwise) out of the way.
            os.environ["PYTHONPATH"] = str(args.tree.resolve())
            os.chdir(work)
        certs = make_certs(work)
        upstream = Upstream(http_port=http_target, echo_port=echo)
        scfg = server_config(work, certs, upstream)
        scfg["keepalive"] = {"interval": 15, "timeout": 10}
        server = NodeagentProcess("server", scfg, work, "server", log_level="warning")
        acfg = agent_config(work, certs, upstream, scfg["tunnel"])
        acfg["keepalive"] = {"interval": 15, "timeout": 10}
        agent = NodeagentProcess("agent", acfg, work, "agent", log_level="warning")
        procs = {"server": server, "agent": agent}
        try:
            server.start().wait_ready()
            agent.start().wait_ready()
            server.wait_for(lambda s: any(a["node"] == "edge-1" for a in s["agents"]),
                            what="edge-1 connected")
            mapping, front = listen_port(server, 0), http_port(server)
            time.sleep(SETTLE)
            start = rss_mib(procs)
            start_detail = detail(procs)
            print(f"RSS at start: {fmt(start)}\n  MiB: {fmt_detail(start_detail)}", flush=True)
            before = idle_rss(procs, mapping)
            print(f"at {IDLE:,} idle connections, before any load: {fmt(before)}", flush=True)
            idle_details: list[dict[str, dict[str, Any]]] = []
            rounds = []
            for i in range(args.rounds):
                took = bulk(mapping, args.streams, args.mib)
                rps = http_load(front, args.http_seconds)
                peak = rss_mib(procs)
                after = idle_rss(procs, mapping, idle_details)
                rounds.append({"bulk_seconds": took, "http_rps": rps, "after_load": peak,
                               "idle_after": after})
                print(f"round {i + 1}: bulk {args.streams}x{args.mib} MiB in {took:.1f} s, "
                      f"HTTP {rps:,.0f} req/s, right after the load {fmt(peak)}; "
                      f"at {IDLE:,} idle connections {fmt(after)}\n"
                      f"  MiB: {fmt_detail(idle_details[-1])}", flush=True)
        finally:
            for proc in (agent, server):  # both, even when one would not stop
                try:
                    proc.stop()
                except AssertionError as exc:  # killed; say so, do not hide the rest
                    print(f"{proc.name} did not stop on SIGTERM: {str(exc)[:200]}")
    summary = {}
    for name in procs:
        ratios = [r["idle_after"][name] / before[name] for r in rounds]
        summary[name] = {
            "start_mib": start[name], "idle_before_mib": before[name],
            "idle_after_mib": statistics.median(r["idle_after"][name] for r in rounds),
            "ratio_median": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios)}
        s = summary[name]
        print(f"{name}: {s['idle_before_mib']:.1f} MiB before, "
              f"{s['idle_after_mib']:.1f} MiB after (median), after/before "
              f"{s['ratio_median']:.3f} [{s['ratio_min']:.3f}-{s['ratio_max']:.3f}]")
    return {"idle": IDLE, "start": start, "before": before, "rounds": rounds,
            "summary": summary, "start_detail": start_detail, "idle_details": idle_details}


def fmt(rss: dict[str, float]) -> str:
    return ", ".join(f"{name} {mib:.1f} MiB" for name, mib in rss.items())


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.memory_after_load",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8, help="bulk streams at once")
    parser.add_argument("--mib", type=int, default=64, help="MiB each bulk stream echoes")
    parser.add_argument("--http-seconds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    parser.add_argument("--tree", type=Path, default=None,
                        help="run the server and agent from this checkout instead "
                             "(e.g. `git worktree add /tmp/before main`), for a before/after")
    args = parser.parse_args()
    result = run(args)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
