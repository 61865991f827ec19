"""The intercepted path against direct routing and against sshuttle, in one run.

Four network namespaces joined by veth pairs, as in tests/e2e/test_intercept_netns.py::

    pod 10.88.1.2 ── 10.88.1.1 node 10.88.2.1 ── 10.88.2.2 cloud 10.88.3.1 ── 10.88.3.2 remote

A plain client in `pod` talks to targets in `remote` (iperf3, nginx with a 1 KiB file, a C
echo server). Three ways, one after the other, the client unchanged:

* direct    — plain routing through node and cloud;
* nodeagent — the agent in `node` intercepts the pod's traffic (nftables REDIRECT,
              SO_ORIGINAL_DST) and carries it through its TLS tunnel to the server in
              `cloud`, which dials the destination (egress allow list);
* sshuttle  — Debian's sshuttle in `node` (iptables nat REDIRECT, listening on 0.0.0.0 so
              it also catches forwarded pod traffic) over ssh to an sshd in `cloud`.

Measured from `pod`: single-stream throughput (iperf3), new connections/s (16 clients: connect,
1-byte echo, close), HTTP GETs of 1 KiB through wrk (16 connections) and request/response
latency on one connection (64 bytes). Prints a table with ratios against direct and
against sshuttle, and writes bench-results/intercept.json.

From the repository root:

    sudo .venv/bin/python -m scripts.bench.intercept            # ~1.5 minutes
    sudo .venv/bin/python -m scripts.bench.intercept --quick    # ~40 s

Needs root and: iproute2 nftables iptables iperf3 wrk nginx-light openssh-server
openssh-client sshuttle gcc.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from nodeagent.testing.netns import Topology, netns_available
from scripts import ROOT
from scripts.bench.lib.tools import (
    build_benchtool,
    parse_wrk,
    write_nginx_conf,
    write_sshd_config,
)

POD, NODE_POD, NODE_UP, CLOUD_DOWN, CLOUD_UP, REMOTE = (
    "10.88.1.2", "10.88.1.1", "10.88.2.1", "10.88.2.2", "10.88.3.1", "10.88.3.2")
IPERF, HTTP, ECHO = 5201, 8080, 7000
TOKEN = "bench-intercept-token-0123456789"
NEEDS = ("ip", "nft", "iptables", "iperf3", "wrk", "nginx", "sshd", "ssh", "sshuttle", "cc")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dur = 2 if args.quick else 5
        self.tmp = Path(tempfile.mkdtemp(prefix="nodeagent-bench-intercept-"))
        self.topo = Topology()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.tool = build_benchtool(Path(tempfile.gettempdir()) / "nodeagent-benchtool")
        self.pod_if = ""

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def spawn(self, ns: str, args: list[str], name: str, **kw: Any) -> subprocess.Popen[bytes]:
        out = (self.tmp / f"{name}.log").open("ab")
        proc = self.topo.popen(ns, args, stdout=out, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, **kw)
        self.procs.append(proc)
        return proc

    def run(self, ns: str, args: list[str], timeout: float = 60) -> str:
        proc = subprocess.run(["ip", "netns", "exec", self.topo.ns(ns), *args],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): "
                               f"{proc.stderr.strip()[-1500:]} {proc.stdout.strip()[-1500:]}")
        return proc.stdout

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        for proc in self.procs:
            self.stop(proc)
        self.topo.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        t = self.topo
        for name in ("pod", "node", "cloud", "remote"):
            t.add(name)
        _, self.pod_if = t.link("pod", [f"{POD}/24"], "node", [f"{NODE_POD}/24"])
        t.link("node", [f"{NODE_UP}/24"], "cloud", [f"{CLOUD_DOWN}/24"])
        t.link("cloud", [f"{CLOUD_UP}/24"], "remote", [f"{REMOTE}/24"])
        t.route("pod", "default", NODE_POD)
        t.route("node", "10.88.3.0/24", CLOUD_DOWN)
        t.route("cloud", "10.88.1.0/24", NODE_UP)
        t.route("remote", "default", CLOUD_UP)
        for ns in ("pod", "node", "cloud", "remote"):
            t.exec(ns, ["sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"])
            t.exec(ns, ["sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000"])
            t.exec(ns, ["sysctl", "-qw", "net.core.somaxconn=8192"])
        self.spawn("remote", ["iperf3", "-s", "-p", str(IPERF)], "iperf3")
        self.spawn("remote", write_nginx_conf(self.tmp, HTTP), "nginx")
        self.spawn("remote", [str(self.tool), "echo", str(ECHO)], "echo")
        time.sleep(0.5)

    # ------------------------------------------------------------------ the three paths

    def start_nodeagent(self) -> list[subprocess.Popen[bytes]]:
        from nodeagent.trust import pki
        ca = pki.create_ca("bench-intercept-ca")
        ca.write(self.tmp / "ca.crt", self.tmp / "ca.key")
        pki.issue_server_certificate(ca, [], [CLOUD_DOWN]).write(
            self.tmp / "s.crt", self.tmp / "s.key")
        url = f"tls://{CLOUD_DOWN}:8443"
        server_cfg = {
            "tunnel": url, "tokens": [{"node": "edge-1", "token": TOKEN}],
            "tls": {"cert_file": str(self.tmp / "s.crt"), "key_file": str(self.tmp / "s.key")},
            "egress": [f"10.88.3.0/24:{p}" for p in (IPERF, HTTP, ECHO)],
            "debug_socket": str(self.tmp / "server.sock"),
        }
        agent_cfg = {
            "node": "edge-1", "server": url, "token": TOKEN,
            "tls": {"ca_file": str(self.tmp / "ca.crt")},
            "debug_socket": str(self.tmp / "agent.sock"),
            "intercept": {"rules": [{"name": "to-remote", "destinations": ["10.88.3.0/24"],
                                     "ports": [IPERF, HTTP, ECHO],
                                     "source_interfaces": [self.pod_if]}]},
        }
        procs = []
        for role, ns, cfg in (("server", "cloud", server_cfg), ("agent", "node", agent_cfg)):
            path = self.tmp / f"{role}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            procs.append(self.spawn(ns, [sys.executable, "-m", "nodeagent", "--log-level",
                                         "warning", role, "--config", str(path)],
                                    f"nodeagent-{role}", cwd=str(ROOT),
                                    env={**os.environ, "PYTHONPATH": str(ROOT)}))
            time.sleep(0.5)
        self.wait_path_works("nodeagent", procs)
        return procs

    def start_sshuttle(self) -> list[subprocess.Popen[bytes]]:
        d = self.tmp / "ssh"
        procs = [self.spawn("cloud", write_sshd_config(d, CLOUD_DOWN), "sshd")]
        time.sleep(0.5)
        ssh = (f"ssh -p 2222 -i {d}/id -o StrictHostKeyChecking=no "
               f"-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR")
        procs.append(self.spawn("node", [
            "sshuttle", "--method", "nat", "--listen", "0.0.0.0:12300", "-e", ssh,
            "-r", f"root@{CLOUD_DOWN}", "--python", "python3", "10.88.3.0/24"], "sshuttle"))
        self.wait_path_works("sshuttle", procs)
        return procs

    def wait_path_works(self, name: str, procs: list[subprocess.Popen[bytes]]) -> None:
        """Until a connection from the pod reaches `remote` from the cloud's address, i.e.
        it was intercepted and carried to the cloud side."""
        hold = ("import socket,sys,time; s=socket.create_connection((sys.argv[1], "
                "int(sys.argv[2])), 3); s.sendall(b'x'); s.recv(1); time.sleep(1.5)")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for proc in procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{name}: a process exited; see logs in {self.tmp}")
            client = self.topo.popen("pod", ["python3", "-c", hold, REMOTE, str(ECHO)],
                                     stderr=subprocess.DEVNULL)
            time.sleep(0.7)
            peers = self.run("remote", ["ss", "-Htn", "state", "established",
                                        f"( sport = :{ECHO} )"], timeout=10)
            client.wait()
            if f"{CLOUD_UP}:" in peers:
                return
            time.sleep(0.5)
        raise RuntimeError(f"{name}: the pod's traffic is not intercepted after 30 s "
                           f"(logs in {self.tmp})")

    # ------------------------------------------------------------------ measurements

    def measure(self) -> dict[str, float]:
        dur = self.dur
        res: dict[str, float] = {}
        out = json.loads(self.run("pod", ["iperf3", "-c", REMOTE, "-p", str(IPERF), "-t",
                                          str(dur), "-J"], timeout=dur + 30))
        res["bulk_gbit"] = out["end"]["sum_received"]["bits_per_second"] / 1e9
        cr = json.loads(self.run("pod", [str(self.tool), "connrate", REMOTE, str(ECHO),
                                         str(dur), "16"], timeout=dur + 30))
        res["conn_per_s"] = cr["per_sec"]
        res["conn_errors"] = cr["errors"]
        wrk = parse_wrk(self.run("pod", ["wrk", "-t2", "-c16", f"-d{dur}s", "--latency",
                                         f"http://{REMOTE}:{HTTP}/1k"], timeout=dur + 30))
        res["http_req_per_s"] = wrk["req_per_sec"]
        res["http_errors"] = wrk["non_2xx"] + wrk["socket_errors"]
        res["http_p50_ms"] = wrk["p50_ms"]
        res["http_p99_ms"] = wrk["p99_ms"]
        rr = json.loads(self.run("pod", [str(self.tool), "rr", REMOTE, str(ECHO), str(dur),
                                         "1", "64"], timeout=dur + 30))
        res["rr_p50_us"] = rr["p50_us"]
        res["rr_p99_us"] = rr["p99_us"]
        return res


ROWS = [
    ("single stream", "bulk_gbit", "Gbit/s", True),
    ("new connections", "conn_per_s", "/s", True),
    ("HTTP 1 KiB, 16 conns", "http_req_per_s", "req/s", True),
    ("HTTP p99", "http_p99_ms", "ms", False),
    ("request/response p50", "rr_p50_us", "µs", False),
    ("request/response p99", "rr_p99_us", "µs", False),
]


def table(results: dict[str, dict[str, float]]) -> str:
    head = ("", "direct", "nodeagent", "sshuttle", "na/direct", "na/sshuttle")
    rows = [head]
    for label, key, unit, higher_better in ROWS:
        vals = [results.get(p, {}).get(key) for p in ("direct", "nodeagent", "sshuttle")]
        cells = [f"{v:,.2f} {unit}" if v is not None else "—" for v in vals]
        d, n, s = vals

        def r(a: float | None, b: float | None) -> str:
            return f"{a / b:.2f}x" if a and b else "—"
        rows.append((label, *cells, r(n, d), r(n, s) if higher_better else r(s, n) + " faster"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                     for row in rows)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.intercept",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 s per measurement, not 5")
    parser.add_argument("--skip", action="append", default=[],
                        choices=["direct", "nodeagent", "sshuttle"], help="leave a path out")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "intercept.json")
    args = parser.parse_args()
    reason = netns_available()
    if reason:
        print(f"bench_intercept: {reason}", file=sys.stderr)
        return 2
    missing = [c for c in NEEDS if shutil.which(c, path=os.environ.get("PATH", "") +
                                                ":/usr/sbin:/sbin") is None]
    if missing:
        print(f"bench_intercept: missing commands: {' '.join(missing)} (apt-get install "
              "iperf3 wrk nginx-light openssh-server openssh-client sshuttle nftables "
              "iptables gcc)", file=sys.stderr)
        return 2
    bench = Bench(args)
    results: dict[str, dict[str, float]] = {}
    try:
        bench.setup()
        for path in ("direct", "nodeagent", "sshuttle"):
            if path in args.skip:
                continue
            bench.log(f"{path}: starting")
            procs = {"direct": lambda: [], "nodeagent": bench.start_nodeagent,
                     "sshuttle": bench.start_sshuttle}[path]()
            bench.log(f"{path}: measuring")
            results[path] = bench.measure()
            bench.log(f"{path}: {results[path]}")
            for proc in procs:
                bench.stop(proc)
    finally:
        bench.close()
    print()
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "seconds_per_measurement": bench.dur,
                                    "results": results}, indent=2))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
