"""Soak (not CI): two server replicas, one agent, mixed load, a server rollout and a path
flap every few minutes; RSS and open descriptors of every process sampled throughout.

Topology (one host, real processes and sockets): replica-a and replica-b (`replicas: 2`)
behind a TCP balancer for the tunnel (the agent dials it; it reaches every running
replica) and others for the public side (TCP mapping and HTTP listener: the load dials
those; they send only to replicas whose /readyz passed within 0.2 s, as a Service's ready
endpoints, and skip a backend that refuses). Every `--period` seconds, in turn:
  - rollout: SIGTERM to one replica (`--drain-seconds 5`), a new process with the same
    config once it has exited;
  - path flap: the tunnel balancer cuts every connection and refuses new ones for
    `--flap-seconds` (the agent loses both tunnels; the public side answers 502 meanwhile).
This stands in for `ip link set down` (which needs network namespaces, see
tests/e2e/test_failures.py for that); it cuts the agent's path, not its link.

Load: `--workers` threads, each alternating a TCP echo (64 KiB, checked byte for byte) and
an HTTP GET through the public balancer. Failures are counted by phase (steady, rollout,
flap): failures are expected only while a flap cuts the path.

Printed at the end: per process, RSS and descriptors after warm-up vs at the end and their
growth; requests by phase. Growth is taken two ways: from the first sample after warm-up to
the last (one sample each: a 64 KiB transfer's buffers in flight at either moment move it
by ~1 %), and between the medians of the first and the last `--window` seconds after
warm-up (what the process holds, not what it was doing at one instant). Every sample goes
to `--out` (JSON) for the curve.

From the repository root:

    sudo .venv/bin/python -m scripts.bench.soak                  # 30 minutes, period 180 s
    sudo .venv/bin/python -m scripts.bench.soak --minutes 4 --period 60 --warmup 30
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    Certs,
    QuietHTTPServer,
    Upstream,
    UpstreamHandler,
    agent_config,
    free_port,
    serve_echo,
    server_config,
)
from nodeagent.trust import pki
from scripts import ROOT


class Balancer:
    """New connections to the next backend that accepts; `cut()` closes every spliced
    connection and its listener (new connections are refused, as from a host whose path
    is gone after the kernel gave up) until `resume()`."""

    def __init__(self, backends: list[int],
                 ready: Callable[[int], bool] | None = None) -> None:
        self.backends = backends
        # The health check (the public side: a replica's /readyz); None: every backend.
        self.ready = ready
        self._turn = itertools.cycle(range(len(backends)))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.paused = False
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            if self.paused:
                client.close()
                continue
            backend = None
            for _ in self.backends:
                port = self.backends[next(self._turn)]
                if self.ready is not None and not self.ready(port):
                    continue
                try:
                    backend = socket.create_connection(("127.0.0.1", port), timeout=2)
                    break
                except OSError:
                    continue
            if backend is None:
                client.close()
                continue
            backend.settimeout(None)
            with self._lock:
                self._open |= {client, backend}
            done: list[int] = []
            for a, b in ((client, backend), (backend, client)):
                threading.Thread(target=self._pipe, args=(a, b, done), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, done: list[int]) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            for s in (src, dst):  # one direction broke: end both (the other recv wakes)
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        with self._lock:
            done.append(1)
            if len(done) < 2:
                return  # the other direction still runs
            self._open -= {src, dst}
        src.close()
        dst.close()

    def cut(self) -> None:
        self.paused = True
        self.sock.close()
        with self._lock:
            sockets, self._open = list(self._open), set()
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def resume(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", self.port))
        self.paused = False
        threading.Thread(target=self._accept, daemon=True).start()


class HealthCheck:
    """The public balancers' health check: GET /readyz of each replica every 0.2 s (as
    kube-proxy follows a Service's ready endpoints), by the replica's public port."""

    def __init__(self) -> None:
        self.health: dict[int, int] = {}  # public port -> its replica's health port
        self.ready: set[int] = set()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        with httpx.Client(timeout=0.5) as client:
            while True:
                for public, health in list(self.health.items()):
                    try:
                        ok = client.get(f"http://127.0.0.1:{health}/readyz").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    (self.ready.add if ok else self.ready.discard)(public)
                time.sleep(0.2)

    def __call__(self, port: int) -> bool:
        return port in self.ready


def sample(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open descriptors) of a live process."""
    rss = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


class Load:
    def __init__(self, tcp_port: int, http_port: int) -> None:
        self.tcp_port, self.http_port = tcp_port, http_port
        self.phase = "warmup"
        self.counts: Counter[tuple[str, str]] = Counter()
        self.stop = threading.Event()
        self.payload = os.urandom(64 * 1024)

    def echo(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.tcp_port), timeout=10) as sock:
            sock.sendall(self.payload)
            sock.shutdown(socket.SHUT_WR)
            got = bytearray()
            while chunk := sock.recv(65536):
                got += chunk
        return bytes(got) == self.payload

    def get(self, client: httpx.Client) -> bool:
        r = client.get(f"http://127.0.0.1:{self.http_port}/soak", headers={"host": "app.test"})
        return r.status_code == 200 and "hello from upstream" in r.text

    def worker(self) -> None:
        with httpx.Client(timeout=10) as client:
            for i in itertools.count():
                if self.stop.is_set():
                    return
                phase = self.phase
                try:
                    ok = self.echo() if i % 2 == 0 else self.get(client)
                except (OSError, httpx.HTTPError):
                    ok = False
                self.counts[(phase, "ok" if ok else "failed")] += 1
                if not ok:
                    time.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.soak",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--period", type=float, default=180.0,
                        help="seconds between disruptions (rollout and flap alternate)")
    parser.add_argument("--flap-seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=60.0,
                        help="growth is measured from the first sample after this")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--window", type=float, default=180.0,
                        help="seconds of samples whose median is compared (default 180)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "soak.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ca = pki.create_ca("soak-ca")
        ca.write(tmp / "ca.crt", tmp / "ca.key")
        cert = pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"])
        cert.write(tmp / "server.crt", tmp / "server.key")
        certs = Certs(tmp / "ca.crt", tmp / "server.crt", tmp / "server.key",
                      tmp / "server.crt", tmp / "server.key")
        echo = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=serve_echo, args=(echo,), daemon=True).start()
        http = QuietHTTPServer(("127.0.0.1", 0), UpstreamHandler)
        threading.Thread(target=http.serve_forever, daemon=True).start()
        upstream = Upstream(http.server_address[1], echo.getsockname()[1])

        configs: dict[str, dict[str, Any]] = {}
        for name in ("replica-a", "replica-b"):
            cfg = server_config(tmp, certs, upstream)
            cfg.update(server_id=name, replicas=2, debug_socket=str(tmp / f"{name}.sock"),
                       metrics_listen=f"127.0.0.1:{free_port()}")
            configs[name] = cfg

        def port(cfg: dict[str, Any], key: str) -> int:
            value = cfg["tunnel"] if key == "tunnel" else (
                cfg["tcp"][0]["listen"] if key == "tcp" else cfg["http"][0]["listen"])
            return int(value.rsplit(":", 1)[1])

        # The tunnel balancer reaches every running replica (agents must reach a new one
        # before it can be ready); the public ones only replicas whose /readyz passes.
        check = HealthCheck()
        for cfg in configs.values():
            health = int(cfg["metrics_listen"].rsplit(":", 1)[1])
            check.health[port(cfg, "tcp")] = check.health[port(cfg, "http")] = health
        tunnel_lb = Balancer([port(c, "tunnel") for c in configs.values()])
        tcp_lb = Balancer([port(c, "tcp") for c in configs.values()], ready=check)
        http_lb = Balancer([port(c, "http") for c in configs.values()], ready=check)
        procs: dict[str, NodeagentProcess] = {}
        generation: Counter[str] = Counter()

        def start_server(name: str) -> None:
            generation[name] += 1
            proc = NodeagentProcess("server", configs[name], tmp, f"{name}-{generation[name]}",
                                    extra_args=["--drain-seconds", "5"])
            procs[name] = proc.start()
            proc.wait_ready()

        try:
            for name in configs:
                start_server(name)
            acfg = agent_config(tmp, certs, upstream, f"tls://127.0.0.1:{tunnel_lb.port}")
            acfg["reconnect"] = {}  # the defaults, as shipped
            procs["agent"] = NodeagentProcess("agent", acfg, tmp, "agent").start()
            procs["agent"].wait_ready()
            procs["agent"].wait_for(lambda s: len(s["tunnels"]) == 2, timeout=20,
                                    what="a tunnel to each replica")
        except BaseException:
            for proc in procs.values():  # a failed start must not leave servers running
                proc.kill()
            raise

        load = Load(tcp_lb.port, http_lb.port)
        workers = [threading.Thread(target=load.worker, daemon=True)
                   for _ in range(args.workers)]
        for w in workers:
            w.start()
        # (process instance name) -> [(t, rss KiB, fds)]
        samples: dict[str, list[tuple[float, int, int]]] = {}
        started = time.monotonic()
        end = started + args.minutes * 60
        next_event = started + args.period
        next_sample = started
        events = itertools.cycle(["rollout-a", "flap", "rollout-b", "flap"])
        load.phase = "warmup"
        try:
            while time.monotonic() < end:
                now = time.monotonic()
                if now >= started + args.warmup and load.phase == "warmup":
                    load.phase = "steady"
                if now >= next_sample:
                    for proc in procs.values():
                        if proc.proc is not None and proc.proc.poll() is None:
                            rss, fds = sample(proc.proc.pid)
                            samples.setdefault(proc.name, []).append((now - started, rss, fds))
                    next_sample += args.sample_every
                if now >= next_event:
                    event = next(events)
                    if event.startswith("rollout"):
                        name = "replica-" + event[-1]
                        load.phase = "rollout"
                        old = procs[name]
                        assert old.proc is not None
                        old.signal(signal.SIGTERM)
                        old.proc.wait(30)
                        start_server(name)
                        print(f"[{now - started:6.0f}s] rolled {name}", flush=True)
                    else:
                        load.phase = "flap"
                        tunnel_lb.cut()
                        time.sleep(args.flap_seconds)
                        tunnel_lb.resume()
                        procs["agent"].wait_for(lambda s: len(s["tunnels"]) == 2,
                                                timeout=60, what="tunnels back")
                        print(f"[{now - started:6.0f}s] path flap {args.flap_seconds:g}s, "
                              f"agent back at {time.monotonic() - started:.0f}s", flush=True)
                    # Requests a moment after the disruption still count to it.
                    time.sleep(2)
                    load.phase = "steady" if now >= started + args.warmup else "warmup"
                    next_event += args.period
                time.sleep(0.2)
        finally:
            load.stop.set()
            for w in workers:
                w.join(15)
            for proc in procs.values():
                proc.kill()
            traces = sum(p.logs().count("Traceback") for p in procs.values())

        print(f"\nsoak {args.minutes:g} min, disruption every {args.period:g} s, "
              f"{args.workers} workers; warm-up {args.warmup:g} s")
        print(f"{'process':16} {'rss after warm-up':>18} {'rss end':>10} {'growth':>7} "
              f"{'medians':>17} {'growth':>7} {'fds after warm-up':>18} {'fds end':>8}")
        for name, rows in samples.items():
            after = [r for r in rows if r[0] >= args.warmup] or rows
            if len(after) < 2:
                continue
            first, last = after[0], after[-1]
            growth = (last[1] - first[1]) / first[1] * 100
            early = statistics.median(
                r[1] for r in after if r[0] < after[0][0] + args.window)
            late = statistics.median(
                r[1] for r in after if r[0] > after[-1][0] - args.window)
            median_growth = (late - early) / early * 100
            print(f"{name:16} {first[1] / 1024:15.1f} MiB {last[1] / 1024:6.1f} MiB "
                  f"{growth:+6.1f}% {early / 1024:6.1f} -> {late / 1024:4.1f} MiB "
                  f"{median_growth:+6.1f}% {first[2]:18} {last[2]:8}  ({len(after)} "
                  f"samples, {after[-1][0] - after[0][0]:.0f} s)")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "minutes": args.minutes, "period": args.period, "warmup": args.warmup,
            "window": args.window, "samples": {
                name: [{"t": round(t, 1), "rss_kib": rss, "fds": fds} for t, rss, fds in rows]
                for name, rows in samples.items()}}, indent=1))
        print(f"samples: {args.out}")
        print("\nrequests by phase:")
        for phase in ("warmup", "steady", "rollout", "flap"):
            ok, failed = load.counts[(phase, "ok")], load.counts[(phase, "failed")]
            if ok or failed:
                print(f"  {phase:8} ok {ok:7}  failed {failed:5}")
        print(f"tracebacks in the logs: {traces}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
