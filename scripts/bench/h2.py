"""HTTP/2 and gRPC through the front and the tunnel, against HTTP/1.1 and `ssh -R` (L4) in
the same run, and how one client connection's gRPC calls spread over three endpoints.

A real `nodeagent server` and `nodeagent agent` on loopback (TLS tunnel); on the "node": a
trio HTTP/1.1 server answering every request with 1 KiB, nghttpd serving 1 KiB over h2c, and
three grpcio servers (bytes in and out, `nodeagent.testing.grpcservice`); `ssh -R` from the
"node" to an sshd on loopback carries the first gRPC server at L4. Measurements,
interleaved over --rounds rounds (median, min-max):

  h2 / h1     h2load, 16 connections x 10 concurrent streams (h2c prior knowledge), against
              h2load --h1 with 16 connections (HTTP/1.1 keep-alive, one request at a time),
              both through the same front and tunnel to the same 1 KiB backend (HTTP/1.1):
              req/s and p99 (from h2load's per-request log), and the ratio; and h2load
              16 x 10 to an h2c backend (nghttpd serving 1 KiB: every request on one shared
              upstream connection). For each, the CPU the server and the agent spent per
              request (/proc, over the run and its warm-up second), steadier than req/s.
  grpc / L4   grpcio unary calls/s, small messages, --grpc-inflight calls in flight on one
              channel, through an h2c route (the front balances each call) against the same
              service through `ssh -R` (L4: ssh carries the client's own h2) and through a
              TCP mapping of the tunnel (L4 too)
  bidi        one bidirectional gRPC stream through the h2c route echoing --bidi-kib KiB
              messages for --seconds: payload Gbit/s each way (and through `ssh -R`, and
              directly: grpcio's client and server share this process, that is the floor)
  balance     --balance-calls calls of one channel through a route with three endpoints:
              each endpoint's share
  budget      what each goal leaves the front and the agent per request on this machine's
              cores, once h2load and the backend (or the gRPC client and servers, which
              share this process) took theirs in this run, against the `h2` library's own
              floor measured in this process between the loads (`scripts.bench.h2_budget`):
              a goal whose floor is over what it leaves is out of reach for any front
              built on `h2` here. ssh's and sshd's CPU per call is measured too: a relay
              as cheap as theirs is added to the floor of the gRPC goal.

Not a test: timings move with the machine; read the ratios and the CPU per request. Needs
root (the agent marks its sockets), h2load (Debian nghttp2-client), nghttpd
(nghttp2-server), sshd and ssh (openssh-server, openssh-client) and grpcio (the test
extra). From the repository root:

    sudo .venv/bin/python -m scripts.bench.h2 [--rounds 3] [--seconds 5]

Prints a table and the goals met or missed, and writes bench-results/h2-DATE-TIME.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import multiprocessing
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import trio

from nodeagent.testing.grpcservice import GrpcEcho, channel, method
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import free_port
from nodeagent.trust import pki
from scripts import ROOT
from scripts.bench import h2_budget
from scripts.bench.http_front import _cpu_seconds
from scripts.bench.lib.tools import summarize_profile, write_sshd_config

TOKEN = "bench-token-0123456789abcdef"
BODY = b"x" * 1024
RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n"
            % len(BODY) + BODY)


async def _h1_conn(stream: trio.SocketStream) -> None:
    buf = b""
    try:
        while data := await stream.receive_some(65536):
            buf += data
            n = buf.count(b"\r\n\r\n")
            if n:
                buf = buf[buf.rfind(b"\r\n\r\n") + 4:]
                await stream.send_all(RESPONSE * n)
    except trio.BrokenResourceError:
        pass


def _run_h1_backend(port: int) -> None:
    trio.run(functools.partial(trio.serve_tcp, _h1_conn, port, host="127.0.0.1"))


def h2load(url: str, *, h1: bool, seconds: float, log: Path) -> dict[str, float]:
    """req/s, and p50/p99 ms from the per-request log."""
    args = ["h2load", "-c16", "-t1", f"-D{seconds:g}", "--warm-up-time=1",
            f"--log-file={log}"]
    args += ["--h1", "-m1"] if h1 else ["-m10"]
    out = subprocess.run([*args, url], capture_output=True, text=True, check=True).stdout
    m = re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out)
    if m is None:
        raise RuntimeError(f"h2load printed no req/s:\n{out}")
    ok = re.search(r"(\d+) succeeded, (\d+) failed", out)
    durations = sorted(int(line.split("\t")[2]) for line in log.read_text().splitlines()
                       if line.count("\t") >= 2)
    log.unlink()
    def pct(p: float) -> float:
        return durations[min(len(durations) - 1, int(len(durations) * p))] / 1000.0
    return {"req_per_sec": float(m.group(1)), "p50_ms": pct(0.50), "p99_ms": pct(0.99),
            "failed": float(ok.group(2)) if ok else -1.0}


def grpc_rate(address: str, authority: str | None, seconds: float, inflight: int) -> float:
    """Unary calls/s of one channel keeping `inflight` calls in flight."""
    return grpc_calls(address, authority, seconds, inflight)[0]


def grpc_calls(address: str, authority: str | None, seconds: float, inflight: int
               ) -> tuple[float, int]:
    """`grpc_rate`'s calls/s, and the calls made (50 warm-up calls included)."""
    ch = channel(address, authority)
    unary = method(ch, "Unary")
    for _ in range(50):
        unary(b"warm", timeout=10)
    done = 0
    lock = threading.Lock()
    stop = time.perf_counter() + seconds
    finished = threading.Event()
    running = [0]

    def launch() -> None:
        future = unary.future(b"ping", timeout=30)
        future.add_done_callback(on_done)

    def on_done(future: Any) -> None:
        nonlocal done
        future.result()
        with lock:
            done += 1
            if time.perf_counter() < stop:
                launch()
                return
            running[0] -= 1
            if running[0] == 0:
                finished.set()

    start = time.perf_counter()
    running[0] = inflight
    for _ in range(inflight):
        launch()
    finished.wait(seconds + 30)
    elapsed = time.perf_counter() - start
    ch.close()
    return done / elapsed, done + 50


def bidi_rate(address: str, seconds: float, kib: int) -> float:
    """Payload Gbit/s each way of one bidirectional stream echoing `kib` KiB messages, at
    most 8 messages ahead of their echoes (the window grpcio keeps anyway)."""
    return bidi_echo(address, seconds, kib)[0]


def bidi_echo(address: str, seconds: float, kib: int) -> tuple[float, int]:
    """`bidi_rate`'s Gbit/s each way, and the bytes echoed."""
    ch = channel(address)
    stream = method(ch, "Bidi", "stream_stream")
    message = b"b" * (kib * 1024)
    ahead = threading.Semaphore(8)
    stop = time.perf_counter() + seconds

    def requests() -> Any:
        while time.perf_counter() < stop:
            ahead.acquire()
            yield message

    start = time.perf_counter()
    got = 0
    for reply in stream(requests(), timeout=seconds + 60):
        got += len(reply)
        ahead.release()
    elapsed = time.perf_counter() - start
    ch.close()
    return got * 8 / elapsed / 1e9, got


def balance(address: str, authority: str, calls: int) -> dict[str, int]:
    ch = channel(address, authority)
    who = method(ch, "Who")
    counts: dict[str, int] = {}
    for _ in range(calls):
        name = who(b"", timeout=10).decode()
        counts[name] = counts.get(name, 0) + 1
    ch.close()
    return counts


def _wait_listening(port: int, timeout: float = 20.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port}")


def _children_cpu() -> float:
    """CPU seconds of this process's children that have ended (h2load, once waited for)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _tree_cpu(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants alive now (sshd's
    per-connection children do the relaying)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        with contextlib.suppress(OSError):
            total += _cpu_seconds(current)
        todo += children.get(current, [])
    return total


def summary(values: list[float]) -> str:
    return (f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"
            if max(values) >= 10 else
            f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")


class _VariantProcess(NodeagentProcess):
    """A server whose front announces other HTTP/2 settings, or a server or agent with
    other tunnel settings (`scripts.bench.h2_settings_run`)."""

    overrides: dict[str, int] = {}

    def start(self) -> NodeagentProcess:
        self.write_config()
        cmd = [sys.executable, "-m", "scripts.bench.h2_settings_run", json.dumps(self.overrides),
               "--log-level", self.log_level, self.role, "--config", str(self.config_path)]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self


@dataclasses.dataclass
class _Pair:
    """A server and its agent: the front's listeners, the CPU of both processes."""

    server: NodeagentProcess
    agent: NodeagentProcess
    ports: dict[str, int]

    def cpu(self) -> dict[str, float]:
        return {k: _cpu_seconds(p.proc.pid)  # type: ignore[union-attr]
                for k, p in (("server", self.server), ("agent", self.agent))}

    def kill(self) -> None:
        for proc in (self.server, self.agent):
            proc.kill()


def _start_pair(work: Path, name: str, backends: dict[str, Any],
                overrides: dict[str, int] | None, tree: Path | None) -> _Pair:
    """A server (this tree's, with `overrides` of its HTTP/2 settings, or `tree`'s) and an
    agent connected to it (the same tree's), routes to `backends`."""
    ports = {k: free_port() for k in ("tunnel", "web", "web_h2c", "grpc", "balanced", "l4")}
    target = backends["grpc"]
    config = {
        "tunnel": f"tls://127.0.0.1:{ports['tunnel']}",
        "tls": {"cert_file": str(work / "server.crt"), "key_file": str(work / "server.key")},
        "tokens": [{"node": "edge-1", "token": TOKEN}],
        "http": [
            {"name": "web", "listen": f"127.0.0.1:{ports['web']}", "routes": [
                {"node": "edge-1", "target": backends["h1"]}]},
            {"name": "web-h2c", "listen": f"127.0.0.1:{ports['web_h2c']}", "routes": [
                {"node": "edge-1", "target": backends["h2c"], "backend_protocol": "h2c"}]},
            {"name": "grpc", "listen": f"127.0.0.1:{ports['grpc']}", "routes": [
                {"node": "edge-1", "target": target[0], "backend_protocol": "h2c"}]},
        ],
        "tcp": [{"name": "grpc-l4", "listen": f"127.0.0.1:{ports['l4']}", "node": "edge-1",
                 "target": target[0]}],
        "ingress_http": f"127.0.0.1:{ports['balanced']}",
        "ingress": {"rules": [{"name": "bench/grpc", "host": "balanced.test",
                               "backend_protocol": "h2c", "backends": [
                                   {"node": "edge-1", "target": t} for t in target]}]},
        "debug_socket": str(work / f"{name}-server.sock"),
    }
    # Info, not debug: a debug line per stream would be part of the CPU per call.
    server: NodeagentProcess
    if overrides:
        server = _VariantProcess("server", config, work, f"{name}-server", log_level="info")
        server.overrides = overrides
    else:
        server = NodeagentProcess("server", config, work, f"{name}-server", log_level="info",
                                  cwd=tree)
    agent_config = {
        "node": "edge-1", "server": f"tls://127.0.0.1:{ports['tunnel']}", "token": TOKEN,
        "tls": {"ca_file": str(work / "ca.crt")},
        "allow": [backends["h1"], backends["h2c"], *target],
        "debug_socket": str(work / f"{name}-agent.sock"),
    }
    agent: NodeagentProcess
    if overrides and any(k.startswith("tunnel_") for k in overrides):
        agent = _VariantProcess("agent", agent_config, work, f"{name}-agent", log_level="info")
        agent.overrides = {k: v for k, v in overrides.items() if k.startswith("tunnel_")}
    else:
        agent = NodeagentProcess("agent", agent_config, work, f"{name}-agent",
                                 log_level="info", cwd=tree)
    server.start().wait_ready()
    agent.start().wait_ready()
    server.wait_for(lambda s: s["agents"], what="agent connected")
    return _Pair(server, agent, ports)


@contextlib.contextmanager
def _spied(pair: _Pair, name: str, seconds: float) -> Iterator[None]:
    """py-spy records `pair`'s server and agent for `seconds` (none: nothing), and prints
    and keeps each one's summary (bench-results/profile-h2-NAME-ROLE.txt)."""
    if not seconds:
        yield
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    procs = []
    for role, proc in (("server", pair.server), ("agent", pair.agent)):
        out = ROOT / "bench-results" / f"profile-h2-{name}-{role}.raw"
        out.parent.mkdir(exist_ok=True)
        procs.append((role, out, subprocess.Popen(
            [spy, "record", "--pid", str(proc.proc.pid),  # type: ignore[union-attr]
             "--duration", str(max(1, int(seconds) - 1)), "--rate", "250", "--format", "raw",
             "--output", str(out), "--nonblocking"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
    try:
        yield
    finally:
        for role, out, spying in procs:
            try:
                spying.wait(seconds + 20)
            except subprocess.TimeoutExpired:
                spying.kill()
            summary = summarize_profile(out) if out.exists() else "(py-spy failed)"
            out.with_suffix(".txt").write_text(summary + "\n")
            print(f"--- profile {name} {role} ---\n{summary}\n", flush=True)


MIB = 1024 * 1024
# Settings of the front tried by --variants (through the tunnel): see scripts.bench.h2_bidi.
VARIANTS: dict[str, dict[str, int]] = {
    "default": {},
    "win4m": {"stream_window": 4 * MIB, "connection_window": 32 * MIB},
    "win4m-conn8m": {"stream_window": 4 * MIB},
    "win2m": {"stream_window": 2 * MIB},
    "frame64k": {"max_frame_size": 64 * 1024},
    "frame256k": {"max_frame_size": 256 * 1024},
    "frame1m": {"max_frame_size": MIB},
    "win4m-conn8m-frame256k": {"stream_window": 4 * MIB, "max_frame_size": 256 * 1024},
    "both": {"stream_window": 4 * MIB, "connection_window": 32 * MIB, "max_frame_size": MIB},
    "tunnel4m": {"tunnel_initial_stream_window": 4 * MIB},
    "tunnel8m": {"tunnel_initial_stream_window": 8 * MIB},
    "old": {"stream_window": MIB, "max_frame_size": 16 * 1024,
            "pool_max_frame_size": 256 * 1024},
}
PARTS = ("load", "grpc", "bidi", "balance")


def print_budget(med: dict[str, float], parts: set[str]) -> None:
    """What each goal leaves the front and the agent per request on this machine's cores,
    once the load generator and the backend took theirs (this run's medians), against
    the `h2` library's own floor (`scripts.bench.h2_budget`)."""
    cores = len(os.sched_getaffinity(0))
    print(f"\nthe CPU the goals leave the front and the agent ({cores} cores), against what "
          "the h2 library alone spends (its cheapest configuration, in memory):")

    def line(goal: str, rate: float, others: float, floor: float, floor_what: str) -> None:
        left = h2_budget.left_per_request(cores, rate, others)
        verdict = "out of reach with h2" if floor > left else "within reach of h2's floor"
        print(f"  {goal}: {rate:,.0f}/s leaves {left:,.0f} µs per request once the others "
              f"took {others:,.0f} µs; {floor_what} {floor:,.0f} µs: {verdict}")

    if "load" in parts:
        others = med["h2 CPU µs/req h2load"] + med["h2 CPU µs/req backend"]
        server_side = med["floor: h2 server side µs/request"]
        # Little's law: 16 x 10 streams always in flight take 160 / rate seconds each on
        # average, and a p99 within 10 ms needs an average within it.
        line("p99 <= 10 ms with 160 in flight (Little's law)", 160 / 0.010, others,
             server_side, "h2's server side alone")
        line("h2 >= 1.5x h1", 1.5 * med["h1 req/s"], others, server_side,
             "h2's server side alone")
        others_h2c = (med["h2 -> h2c backend CPU µs/req h2load"]
                      + med["h2 -> h2c backend CPU µs/req backend"])
        line("the same to an h2c backend", 1.5 * med["h1 req/s"], others_h2c,
             server_side + med["floor: h2 client side µs/request"], "h2's two sides alone")
    if "grpc" in parts:
        both = (med["floor: h2 server side µs/unary call"]
                + med["floor: h2 client side µs/unary call"])
        relay = med["grpc ssh+sshd CPU µs/call"]
        rate = med["grpc calls/s via ssh -R (L4)"]
        line("gRPC unary >= ssh -R, the client and servers at their cost through ssh -R",
             rate, med["grpc client+servers CPU µs/call via ssh -R"], both + relay,
             "h2's two sides alone and a relay as cheap as ssh's")
        line("the same, the client and servers at their cost through the front",
             rate, med["grpc client+servers CPU µs/call via the front"], both + relay,
             "h2's two sides alone and a relay as cheap as ssh's")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.h2", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--grpc-inflight", type=int, default=16)
    parser.add_argument("--balance-calls", type=int, default=3000)
    parser.add_argument("--bidi-kib", type=int, default=1024)
    parser.add_argument("--only", default=",".join(PARTS),
                        help=f"the parts to run, of {','.join(PARTS)}")
    parser.add_argument("--variants", default="",
                        help="bidi and unary gRPC through a server per variant of the front's "
                             f"HTTP/2 settings too, of {','.join(VARIANTS)}")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy record this tree's server and agent during the unary "
                             "calls and the bidi stream (bench-results/profile-h2-*.txt)")
    parser.add_argument("--tree", type=Path,
                        help="bidi and unary gRPC through a server and agent from another "
                             "checkout too, interleaved: before and after, in one run")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    for tool, package in (("h2load", "nghttp2-client"), ("nghttpd", "nghttp2-server"),
                          ("sshd", "openssh-server"), ("ssh", "openssh-client")):
        if shutil.which(tool) is None and shutil.which(tool, path="/usr/sbin") is None:
            print(f"needs {tool}: apt-get install -y {package}", file=sys.stderr)
            return 2

    work = Path(tempfile.mkdtemp(prefix="bench-h2-"))
    ca = pki.create_ca("bench")
    ca.write(work / "ca.crt", work / "ca.key")
    pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"]).write(
        work / "server.crt", work / "server.key")
    h1_port = free_port()
    h1_backend = multiprocessing.Process(target=_run_h1_backend, args=(h1_port,), daemon=True)
    h1_backend.start()
    echoes = [GrpcEcho(f"g{i}").start() for i in range(3)]
    htdocs = work / "htdocs"
    htdocs.mkdir()
    (htdocs / "bench").write_bytes(BODY)
    h2c_port = free_port()
    nghttpd = subprocess.Popen([shutil.which("nghttpd") or "/usr/sbin/nghttpd", "--no-tls",
                                "-a", "127.0.0.1", "-d", str(htdocs), str(h2c_port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = [f"127.0.0.1:{e.port}" for e in echoes]
    backends = {"h1": f"127.0.0.1:{h1_port}", "h2c": f"127.0.0.1:{h2c_port}", "grpc": target}
    sshd_port, ssh_r = free_port(), free_port()
    sshd = subprocess.Popen(write_sshd_config(work / "ssh", "127.0.0.1", sshd_port),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ssh: subprocess.Popen[bytes] | None = None
    rows: dict[str, list[float]] = {}
    pairs: dict[str, _Pair] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    try:
        pairs["this tree"] = _start_pair(work, "main", backends, None, None)
        for name in filter(None, args.variants.split(",")):
            pairs[name] = _start_pair(work, name, backends, VARIANTS[name] or None, None)
        if args.tree:
            pairs[str(args.tree)] = _start_pair(work, "tree", backends, None, args.tree)
        main_pair = pairs["this tree"]
        ports = main_pair.ports
        ssh = subprocess.Popen([
            "ssh", "-N", "-i", str(work / "ssh" / "id"), "-p", str(sshd_port),
            "-c", "aes256-gcm@openssh.com", "-o", "StrictHostKeyChecking=no",
            "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
            "-o", "ExitOnForwardFailure=yes", "-o", "LogLevel=ERROR",
            "-R", f"127.0.0.1:{ssh_r}:{target[0]}", "root@127.0.0.1"])
        _wait_listening(ssh_r)

        def load(name: str, url: str, h1: bool, backend_pid: int) -> dict[str, float]:
            """h2load, and the CPU µs per request over its run of the server, the agent,
            h2load itself and the backend."""
            before = main_pair.cpu()
            before |= {"h2load": _children_cpu(), "backend": _cpu_seconds(backend_pid)}
            out = h2load(url, h1=h1, seconds=args.seconds, log=work / f"{name}.log")
            requests = out["req_per_sec"] * (args.seconds + 1)  # + the warm-up second
            after = main_pair.cpu()
            after |= {"h2load": _children_cpu(), "backend": _cpu_seconds(backend_pid)}
            for k, used in after.items():
                out[f"{k} µs/req"] = (used - before[k]) / requests * 1e6
            add(f"{name} req/s", out["req_per_sec"])
            add(f"{name} p99 ms", out["p99_ms"])
            add(f"{name} failed", out["failed"])
            add(f"{name} CPU µs/req server", out["server µs/req"])
            add(f"{name} CPU µs/req agent", out["agent µs/req"])
            add(f"{name} CPU µs/req h2load", out["h2load µs/req"])
            add(f"{name} CPU µs/req backend", out["backend µs/req"])
            return out

        def through(label: str, pair: _Pair) -> tuple[float, float]:
            """Unary calls/s and bidi Gbit/s through `pair`'s h2c route, and the CPU each
            process spent per call and per MiB moved (both ways)."""
            address = f"127.0.0.1:{pair.ports['grpc']}"
            spy = args.profile and pair is main_pair
            before = pair.cpu()
            own = time.process_time()
            with _spied(pair, "unary", args.seconds if spy else 0):
                rate, calls = grpc_calls(address, None, args.seconds, args.grpc_inflight)
            for k, used in pair.cpu().items():
                add(f"{label} unary CPU µs/call {k}", (used - before[k]) / calls * 1e6)
            if pair is main_pair:
                add("grpc client+servers CPU µs/call via the front",
                    (time.process_time() - own) / calls * 1e6)
            before = pair.cpu()
            with _spied(pair, "bidi", args.seconds if spy else 0):
                gbit, moved = bidi_echo(address, args.seconds, args.bidi_kib)
            for k, used in pair.cpu().items():
                add(f"{label} bidi CPU ms/MiB {k}", (used - before[k]) * 1e3 / (2 * moved / MIB))
            return rate, gbit

        url = f"http://127.0.0.1:{ports['web']}/bench"
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
            if "load" in parts:
                h2 = load("h2", url, h1=False, backend_pid=h1_backend.pid or 0)
                h1 = load("h1", url, h1=True, backend_pid=h1_backend.pid or 0)
                add("h2/h1 ratio", h2["req_per_sec"] / h1["req_per_sec"])
                h2c = load("h2 -> h2c backend", f"http://127.0.0.1:{ports['web_h2c']}/bench",
                           h1=False, backend_pid=nghttpd.pid)
                add("h2 -> h2c / h1 ratio", h2c["req_per_sec"] / h1["req_per_sec"])
            if "grpc" in parts:
                via_front, gbit = through("front", main_pair)
                assert ssh is not None
                own, relay = time.process_time(), _tree_cpu(ssh.pid) + _tree_cpu(sshd.pid)
                via_ssh, ssh_calls = grpc_calls(f"127.0.0.1:{ssh_r}", None, args.seconds,
                                                args.grpc_inflight)
                add("grpc client+servers CPU µs/call via ssh -R",
                    (time.process_time() - own) / ssh_calls * 1e6)
                add("grpc ssh+sshd CPU µs/call",
                    (_tree_cpu(ssh.pid) + _tree_cpu(sshd.pid) - relay) / ssh_calls * 1e6)
                via_l4 = grpc_rate(f"127.0.0.1:{ports['l4']}", None, args.seconds,
                                   args.grpc_inflight)
                add("grpc calls/s via the front", via_front)
                add("grpc calls/s via ssh -R (L4)", via_ssh)
                add("grpc calls/s via a TCP mapping (L4)", via_l4)
                add("grpc front/ssh -R ratio", via_front / via_ssh)
                add("grpc front/TCP mapping ratio", via_front / via_l4)
            if "bidi" in parts:
                if "grpc" not in parts:
                    via_front, gbit = through("front", main_pair)
                add("grpc bidi Gbit/s via the front", gbit)
                add("grpc bidi Gbit/s via ssh -R",
                    bidi_rate(f"127.0.0.1:{ssh_r}", args.seconds, args.bidi_kib))
                add("grpc bidi Gbit/s direct (the floor)",
                    bidi_rate(target[0], args.seconds, args.bidi_kib))
            for label, pair in pairs.items():
                if pair is not main_pair:
                    calls, gbit = through(label, pair)
                    add(f"{label} unary calls/s", calls)
                    add(f"{label} bidi Gbit/s", gbit)
            if parts & {"load", "grpc"}:
                # The floors in this process, between the loads: the same machine and load.
                request = h2_budget.best_of(h2_budget.h2load_floor, 20000)
                call = h2_budget.best_of(h2_budget.unary_floor, 20000)
                add("floor: h2 server side µs/request", request.server_side)
                add("floor: h2 client side µs/request", request.client_side)
                add("floor: h2 server side µs/unary call", call.server_side)
                add("floor: h2 client side µs/unary call", call.client_side)
            if "balance" in parts:
                shares = balance(f"127.0.0.1:{ports['balanced']}", "balanced.test",
                                 args.balance_calls)
                for name in ("g0", "g1", "g2"):
                    add(f"balance share {name} %",
                        100.0 * shares.get(name, 0) / args.balance_calls)
        cpu = {p.name: p.status().get("uptime_seconds") for p in (main_pair.server,
                                                                  main_pair.agent)}
    finally:
        for pair in pairs.values():
            pair.kill()
        for child in (ssh, sshd):
            if child is not None:
                child.kill()
        for echo in echoes:
            echo.stop()
        h1_backend.kill()
        nghttpd.kill()
    print(f"\n{'measure':44} median (min-max) over {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, values in rows.items():
        print(f"{name:44} {summary(values)}")
    med = {name: statistics.median(values) for name, values in rows.items()}
    print("\ngoals (issue 21), on the medians:")
    goals: list[tuple[bool, str]] = []
    if "load" in parts:
        goals += [
            (med["h2/h1 ratio"] >= 1.5 and med["h2 p99 ms"] <= 10,
             f"h2 >= 1.5x h1 req/s, p99 <= 10 ms: {med['h2/h1 ratio']:.2f}x, "
             f"p99 {med['h2 p99 ms']:.1f} ms"),
            (med["h2 -> h2c / h1 ratio"] >= 1.5 and med["h2 -> h2c backend p99 ms"] <= 10,
             f"the same to an h2c backend: {med['h2 -> h2c / h1 ratio']:.2f}x, "
             f"p99 {med['h2 -> h2c backend p99 ms']:.1f} ms")]
    if "grpc" in parts:
        goals.append((med["grpc front/ssh -R ratio"] >= 1,
                      "gRPC unary via the front >= ssh -R: "
                      f"{med['grpc front/ssh -R ratio']:.2f}x"))
    if "bidi" in parts:
        goals.append((med["grpc bidi Gbit/s via the front"] >= 1,
                      "a bidi stream >= 1 Gbit/s: "
                      f"{med['grpc bidi Gbit/s via the front']:.2f} Gbit/s"))
    if "balance" in parts:
        split = [med[f"balance share g{i} %"] for i in range(3)]
        goals.append((all(abs(x - 100 / 3) <= 5 for x in split),
                      "balance 33 % +- 5 %: " + " / ".join(f"{x:.1f} %" for x in split)))
    for ok, text in goals:
        print(f"  {'met   ' if ok else 'MISSED'} {text}")
    if parts & {"load", "grpc"}:
        print_budget(med, parts)
    out = ROOT / "bench-results" / time.strftime("h2-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                               "rows": rows, "uptime": cpu}, indent=1))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
