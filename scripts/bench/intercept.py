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
1-byte echo, close) with the CPU time the processes in `node` and `cloud` used per
connection meanwhile (user + system from /proc: the agent and the server, or sshuttle's
client and ssh, sshd and sshuttle's server; not the kernel's softirq work), HTTP GETs of
1 KiB through wrk (16 connections) and request/response latency on one connection (64
bytes). Prints a table with ratios against direct and against sshuttle, and writes
bench-results/intercept.json.

With `--rounds N` every path is measured N times, the paths interleaved (round 1: direct,
nodeagent, sshuttle; round 2: ...; the two trees of `--tree` in alternating order), and
the table shows medians with their min-max, the ratios taken within each round. With
`--tree PATH` the agent and server of another checkout run as a fourth path,
`nodeagent@tree`, in the same rounds (A/B).

From the repository root:

    sudo .venv/bin/python -m scripts.bench.intercept            # ~1.5 minutes
    sudo .venv/bin/python -m scripts.bench.intercept --quick    # ~40 s
    sudo .venv/bin/python -m scripts.bench.intercept --quick --rounds 3 --only connrate \
        --tree /path/to/other/checkout                           # ~4 minutes

Needs root and: iproute2 nftables iptables iperf3 wrk nginx-light openssh-server
openssh-client sshuttle gcc.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
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
        self.sshd: list[str] | None = None
        # Under --callgrind: the namespace's process whose instructions are counted.
        self.counted: dict[str, subprocess.Popen[bytes]] = {}

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
                # Under callgrind the exit (which writes its counts) takes a while.
                proc.wait(120 if self.args.callgrind else 10)
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

    def start_nodeagent(self, tree: Path = ROOT) -> list[subprocess.Popen[bytes]]:
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
            profile = ([] if self.args.profile is None or tree != ROOT else
                       ["-m", "cProfile", "-o", str(self.args.profile / f"{role}.prof")])
            # Under callgrind, counting only while asked (connrate): see `instructions`.
            valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                        f"--callgrind-out-file={self.tmp}/callgrind.{role}.%p"] \
                if self.args.callgrind else []
            procs.append(self.spawn(ns, [*valgrind, sys.executable, *profile, "-m",
                                         "nodeagent", "--log-level", "warning", role,
                                         "--config", str(path)],
                                    f"nodeagent-{role}", cwd=str(tree),
                                    env={**os.environ, "PYTHONPATH": str(tree)}))
            time.sleep(0.5)
        self.wait_path_works("nodeagent", procs)
        self.counted = dict(zip(("cloud", "node"), procs, strict=True)) \
            if self.args.callgrind else {}
        return procs

    def start_sshuttle(self) -> list[subprocess.Popen[bytes]]:
        d = self.tmp / "ssh"
        if self.sshd is None:  # once: its keys stay for the later rounds
            self.sshd = write_sshd_config(d, CLOUD_DOWN)
        procs = [self.spawn("cloud", self.sshd, "sshd")]
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
        deadline = time.monotonic() + (300 if self.args.callgrind else 60)
        while time.monotonic() < deadline:
            for proc in procs:
                if proc.poll() is not None:
                    for other in procs:
                        self.stop(other)
                    raise RuntimeError(f"{name}: a process exited{self.logs()}")
            client = self.topo.popen("pod", ["python3", "-c", hold, REMOTE, str(ECHO)],
                                     stderr=subprocess.DEVNULL)
            time.sleep(0.7)
            peers = self.run("remote", ["ss", "-Htn", "state", "established",
                                        f"( sport = :{ECHO} )"], timeout=10)
            client.wait()
            if f"{CLOUD_UP}:" in peers:
                return
            time.sleep(0.5)
        for proc in procs:
            self.stop(proc)
        raise RuntimeError(f"{name}: the pod's traffic is not intercepted in time"
                           f"{self.logs()}")

    def logs(self) -> str:
        """The tail of every log this run wrote (they go when the run ends)."""
        return "".join(f"\n--- {log.name}:\n{log.read_text(errors='replace')[-1500:]}"
                       for log in sorted(self.tmp.glob("*.log")))

    # ------------------------------------------------------------------ measurements

    def instructions(self) -> dict[str, float]:
        """After the processes under callgrind exited: what each counted while asked."""
        counts = {}
        for ns, proc in self.counted.items():
            out = next(self.tmp.glob(f"callgrind.*.{proc.pid}"))
            totals = [line for line in out.read_text().splitlines()
                      if line.startswith(("summary:", "totals:"))]
            counts[ns] = float(totals[-1].split()[1])
        return counts

    def cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) the processes in `node` and `cloud` have used."""
        return {ns: sum(cpu_of(int(pid)) for pid in subprocess.run(
                    ["ip", "netns", "pids", self.topo.ns(ns)], capture_output=True,
                    text=True, check=False).stdout.split())
                for ns in ("node", "cloud")}

    def measure(self) -> dict[str, float]:
        dur = self.dur
        only = set(self.args.only or MEASUREMENTS)
        res: dict[str, float] = {}
        if "bulk" in only:
            out = json.loads(self.run("pod", ["iperf3", "-c", REMOTE, "-p", str(IPERF), "-t",
                                              str(dur), "-J"], timeout=dur + 30))
            res["bulk_gbit"] = out["end"]["sum_received"]["bits_per_second"] / 1e9
        if "connrate" in only and self.counted:
            # One client, one connection at a time: the per-connection work alone, not
            # how many connections a wake-up finds (which moves with the load).
            for proc in self.counted.values():
                subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)],
                               capture_output=True, check=True, timeout=60)
            cr = json.loads(self.run("pod", [str(self.tool), "connrate", REMOTE, str(ECHO),
                                             str(self.args.callgrind), "1"],
                                     timeout=self.args.callgrind + 60))
            for proc in self.counted.values():
                subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)],
                               capture_output=True, check=True, timeout=60)
            res["conn_count"] = cr["count"]
            only.discard("connrate")
        if "connrate" in only:
            before = self.cpu()
            cr = json.loads(self.run("pod", [str(self.tool), "connrate", REMOTE, str(ECHO),
                                             str(dur), "16"], timeout=dur + 30))
            after = self.cpu()
            res["conn_per_s"] = cr["per_sec"]
            res["conn_errors"] = cr["errors"]
            if cr["count"]:
                for ns in ("node", "cloud"):
                    res[f"conn_cpu_us_{ns}"] = (after[ns] - before[ns]) / cr["count"] * 1e6
        if "http" in only:
            wrk = parse_wrk(self.run("pod", ["wrk", "-t2", "-c16", f"-d{dur}s", "--latency",
                                             f"http://{REMOTE}:{HTTP}/1k"], timeout=dur + 30))
            res["http_req_per_s"] = wrk["req_per_sec"]
            res["http_errors"] = wrk["non_2xx"] + wrk["socket_errors"]
            res["http_p50_ms"] = wrk["p50_ms"]
            res["http_p99_ms"] = wrk["p99_ms"]
        if "rr" in only:
            rr = json.loads(self.run("pod", [str(self.tool), "rr", REMOTE, str(ECHO), str(dur),
                                             "1", "64"], timeout=dur + 30))
            res["rr_p50_us"] = rr["p50_us"]
            res["rr_p99_us"] = rr["p99_us"]
        return res


def cpu_of(pid: int) -> float:
    """User + system CPU seconds a process has used (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


MEASUREMENTS = ("bulk", "connrate", "http", "rr")
ROWS = [
    ("single stream", "bulk_gbit", "Gbit/s", True),
    ("new connections", "conn_per_s", "/s", True),
    ("CPU per connection, node", "conn_cpu_us_node", "µs", False),
    ("CPU per connection, cloud", "conn_cpu_us_cloud", "µs", False),
    ("instructions per connection, node", "conn_instructions_node", "", False),
    ("instructions per connection, cloud", "conn_instructions_cloud", "", False),
    ("HTTP 1 KiB, 16 conns", "http_req_per_s", "req/s", True),
    ("HTTP p99", "http_p99_ms", "ms", False),
    ("request/response p50", "rr_p50_us", "µs", False),
    ("request/response p99", "rr_p99_us", "µs", False),
]


def spread(values: list[float], fmt: str) -> str:
    """The median, and its min-max when there are several."""
    if not values:
        return "—"
    mid = format(statistics.median(values), fmt)
    if len(values) == 1:
        return mid
    return f"{mid} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def ratio(rounds: list[dict[str, dict[str, float]]], key: str, other: str,
          higher_better: bool) -> str:
    values = []
    for r in rounds:
        n, o = r.get("nodeagent", {}).get(key), r.get(other, {}).get(key)
        if n and o:
            values.append(n / o if higher_better else o / n)
    return spread(values, ".2f") + "x" if values else "—"


def table(rounds: list[dict[str, dict[str, float]]], paths: list[str]) -> str:
    """Medians [min-max] over the rounds; each ratio is taken within a round, then its
    median [min-max] shown: nodeagent against direct and sshuttle (how many times more;
    for the lower-is-better rows, how many times less), and against `nodeagent@tree`."""
    ab = "nodeagent@tree" in paths
    head = ["", *paths, "na/direct", "na/sshuttle"] + (["na/tree"] if ab else [])
    rows = [head]
    for label, key, unit, higher_better in ROWS:
        if not any(key in r.get(path, {}) for r in rounds for path in paths):
            continue
        cells = [spread([r[path][key] for r in rounds if key in r.get(path, {})], ",.2f")
                 + f" {unit}" for path in paths]
        others = ["direct", "sshuttle"] + (["nodeagent@tree"] if ab else [])
        rows.append([label, *cells, *(ratio(rounds, key, other, higher_better)
                                      for other in others)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True))
                     for row in rows)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.intercept",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 s per measurement, not 5")
    parser.add_argument("--skip", action="append", default=[],
                        choices=["direct", "nodeagent", "sshuttle"], help="leave a path out")
    parser.add_argument("--only", action="append", choices=MEASUREMENTS,
                        help="only these measurements (repeat; default: all)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure every path this many times, interleaved")
    parser.add_argument("--tree", type=Path, default=None,
                        help="also run the agent and server of this checkout "
                             "(path nodeagent@tree), in the same rounds")
    parser.add_argument("--profile", type=Path, default=None,
                        help="run this tree's agent and server under cProfile, writing "
                             "agent.prof and server.prof into this directory (the last "
                             "round's; read them with `python -m pstats`)")
    parser.add_argument("--callgrind", type=float, default=0, metavar="SECONDS",
                        help="run nodeagent's agent and server under valgrind's callgrind "
                             "and count their instructions per new connection, one client "
                             "for SECONDS, instead of the connections/s and CPU figures "
                             "(with --skip direct --skip sshuttle --only connrate)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "intercept.json")
    args = parser.parse_args()
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
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
    paths = [path for path in ("direct", "nodeagent", "sshuttle") if path not in args.skip]
    if args.tree is not None:
        paths.insert(paths.index("nodeagent") + 1 if "nodeagent" in paths else 0,
                     "nodeagent@tree")
    rounds: list[dict[str, dict[str, float]]] = []
    load = []
    try:
        bench.setup()
        for number in range(1, args.rounds + 1):
            results: dict[str, dict[str, float]] = {}
            rounds.append(results)
            order = list(paths)
            if number % 2 == 0 and "nodeagent@tree" in order and "nodeagent" in order:
                # The two trees' order alternates round by round: whichever runs first
                # in a round can come out slower (splice_bulk saw it in fixed order).
                i, j = order.index("nodeagent"), order.index("nodeagent@tree")
                order[i], order[j] = order[j], order[i]
            for path in order:
                bench.log(f"round {number}, {path}: starting")
                start = {"direct": lambda: [], "nodeagent": bench.start_nodeagent,
                         "nodeagent@tree": lambda: bench.start_nodeagent(args.tree),
                         "sshuttle": bench.start_sshuttle}[path]
                try:
                    procs = start()
                except RuntimeError as exc:  # sshuttle has been seen to exit at start
                    bench.log(f"round {number}, {path}: did not start, left out: {exc}")
                    continue
                load.append(os.getloadavg()[0])
                bench.log(f"round {number}, {path}: measuring (load average {load[-1]:.2f})")
                results[path] = bench.measure()
                for proc in procs:
                    bench.stop(proc)
                if bench.counted:
                    count = results[path].pop("conn_count")
                    for ns, total in bench.instructions().items():
                        results[path][f"conn_instructions_{ns}"] = total / count
                    bench.counted = {}
                bench.log(f"round {number}, {path}: {results[path]}")
    finally:
        bench.close()
    print()
    print(table(rounds, paths))
    print(f"\nload average (1 min) while measuring: {spread(load, '.2f')}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                    "seconds_per_measurement": bench.dur,
                                    "tree": str(args.tree) if args.tree else None,
                                    "load_average": load, "rounds": rounds}, indent=2))
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
