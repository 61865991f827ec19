"""UDP through the tunnel: a public UDP mapping against a `socat` UDP relay and against
DNS asked directly, in one run.

Real processes on loopback: `nodeagent server` with a `udp:` mapping (and a `tcp:` one on
the same port number, for iperf3's control connection), `nodeagent agent` dialing it, and
behind the agent iperf3 (UDP), dnsmasq (a DNS server fast enough not to be the limit) and
a UDP echo. The baselines, measured in the same run and interleaved round by round:

* iperf3 -u with 1,400-byte datagrams: the highest offered rate (a ladder of rates) whose
  loss stays under 1 %, through the mapping, through `socat UDP4-LISTEN,fork` (plus a
  TCP socat for iperf3's control connection), and through `scripts.bench.udp_relay`, the
  least a trio program can do to relay UDP (one process, no tunnel): the Python floor;
* dnsperf (Debian's): queries per second and p99 latency through the mapping and asking
  dnsmasq directly;
* memory per idle flow: the server's and the agent's RSS growth over a second batch of N
  flows opened through the echo mapping (one datagram each, then idle), divided by N
  (the first batch pays the one-off costs).

From the repository root:

    sudo .venv/bin/python -m scripts.bench.udp            # ~4 minutes, 3 rounds
    sudo .venv/bin/python -m scripts.bench.udp --quick    # ~1 minute, 1 round

Needs root (the agent marks its sockets) and: iperf3 socat dnsperf dnsmasq (dnsmasq-base).
Prints the figures (median, min-max over the rounds, and the ratios) and writes
bench-results/udp.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nodeagent.testing.procs import NodeagentProcess, rss_kib
from nodeagent.testing.standalone import TOKEN, free_port, make_certs
from nodeagent.testing.udp import run_udp_echo
from scripts import ROOT

NEEDS = ("iperf3", "socat", "dnsperf", "dnsmasq")
RATES_MBIT = (10, 25, 50, 100, 150, 200, 250, 300, 400, 500, 600, 800, 1000, 1200)
DATAGRAM = 1400
ZONE = "svc.cloud.internal"


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_both() -> int:
    """A port number free for TCP and UDP on 127.0.0.1 (iperf3 uses both)."""
    while True:
        port = free_port()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def rmem_max() -> int:
    """The largest receive buffer a process may ask for without CAP_NET_ADMIN."""
    try:
        return int(Path("/proc/sys/net/core/rmem_max").read_text())
    except (OSError, ValueError):
        return 212_992


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="nodeagent-bench-udp-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stack: list[NodeagentProcess] = []

    def spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        # A process group of its own: socat's fork children (one per client address)
        # outlive their parent and never time out, so close() ends the whole group.
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for nodeagent in self.stack:
            nodeagent.kill()
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def setup(self) -> None:
        self.iperf_port = free_both()
        self.dns_port = free_udp_port()
        self.spawn(["iperf3", "-s", "-B", "127.0.0.1", "-p", str(self.iperf_port)])
        self.spawn(["dnsmasq", "--no-daemon", "--no-resolv", "--no-hosts", "--port",
                    str(self.dns_port), "--listen-address", "127.0.0.1", "--bind-interfaces",
                    f"--address=/{ZONE}/10.20.30.40", "--cache-size=0",
                    "--dns-forward-max=10000", "--pid-file="])
        self.echo_ctx = run_udp_echo()
        self.echo = self.echo_ctx.__enter__()
        self.mapped_iperf = free_both()
        self.mapped_dns = free_udp_port()
        self.mapped_echo = free_udp_port()
        self.socat_iperf = free_both()
        self.floor_iperf = free_both()
        target = f"127.0.0.1:{self.iperf_port}"
        self.spawn(["socat", f"TCP4-LISTEN:{self.socat_iperf},bind=127.0.0.1,fork,reuseaddr",
                    f"TCP4:{target}"])
        # socat's receive buffer as large as rmem_max allows (it cannot force past it):
        # with the default ~208 KiB it loses datagrams whenever it is not scheduled.
        self.spawn(["socat", f"UDP4-LISTEN:{self.socat_iperf},bind=127.0.0.1,fork,reuseaddr,"
                    f"rcvbuf={rmem_max()}", f"UDP4:{target}"])
        self.spawn(["socat", f"TCP4-LISTEN:{self.floor_iperf},bind=127.0.0.1,fork,reuseaddr",
                    f"TCP4:{target}"])
        self.spawn([sys.executable, "-m", "scripts.bench.udp_relay",
                    f"127.0.0.1:{self.floor_iperf}", target])
        certs = make_certs(self.tmp)
        tunnel = f"tls://127.0.0.1:{free_port()}"
        many = {"max_flows": 100_000, "max_flows_per_client": 100_000}
        server = NodeagentProcess("server", {
            "server_id": "bench", "tunnel": tunnel,
            "tls": {"cert_file": str(certs.server_cert), "key_file": str(certs.server_key)},
            "tokens": [{"node": "edge-1", "token": TOKEN}],
            "tcp": [{"name": "iperf-control", "listen": f"127.0.0.1:{self.mapped_iperf}",
                     "node": "edge-1", "target": target}],
            "udp": [{"name": "iperf", "listen": f"127.0.0.1:{self.mapped_iperf}",
                     "node": "edge-1", "target": target, **many},
                    {"name": "dns", "listen": f"127.0.0.1:{self.mapped_dns}",
                     "node": "edge-1", "target": f"127.0.0.1:{self.dns_port}",
                     "idle_timeout": 30, **many},
                    {"name": "echo", "listen": f"127.0.0.1:{self.mapped_echo}",
                     "node": "edge-1", "target": f"127.0.0.1:{self.echo.port}",
                     "idle_timeout": 600, **many}],
            "debug_socket": str(self.tmp / "server.sock"),
        }, self.tmp, "server", extra_args=())
        agent = NodeagentProcess("agent", {
            "node": "edge-1", "server": tunnel, "token": TOKEN,
            "tls": {"ca_file": str(certs.ca)},
            "allow": [target, f"udp/{target}", f"udp/127.0.0.1:{self.dns_port}",
                      f"udp/127.0.0.1:{self.echo.port}"],
            "debug_socket": str(self.tmp / "agent.sock"),
        }, self.tmp, "agent")
        self.stack = [server, agent]
        server.start().wait_ready()
        agent.start().wait_ready()
        server.wait_for(lambda s: any(a["node"] == "edge-1" for a in s["agents"]),
                        what="edge-1 connected")
        self.server, self.agent = server, agent
        self.queries = self.tmp / "queries.txt"
        self.queries.write_text("".join(f"host{i}.{ZONE} A\n" for i in range(1000)))
        time.sleep(0.5)

    # ------------------------------------------------------------------ iperf3

    def iperf(self, port: int, mbit: int, seconds: float) -> dict[str, float] | None:
        """One iperf3 -u test; None if it failed (no result, or no end within 30 s: at
        rates past what a path carries the client has been seen to wait for the end of
        the test forever, whichever the path)."""
        try:
            out = subprocess.run(
                ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-u", "-l", str(DATAGRAM),
                 "-b", f"{mbit}M", "-t", f"{seconds:g}", "-J", "--connect-timeout", "3000",
                 # the same receive buffer at the iperf3 server whichever path: socket
                 # buffers, not the path, would otherwise decide the loss
                 "-w", "4M"],
                capture_output=True, text=True, timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            time.sleep(2)  # let the iperf3 server give up on that test
            return None
        try:
            doc = json.loads(out.stdout)
            total = doc["end"]["sum"]
        except (ValueError, KeyError):
            return None
        return {"lost_percent": float(total["lost_percent"]),
                "mbit": float(total["bits_per_second"]) / 1e6}

    def highest_rate(self, port: int) -> float:
        """The receive rate (Mbit/s) at the highest offered rate with < 1 % loss (in
        either of two tries)."""
        seconds = 1.0 if self.args.quick else 2.0
        best = 0.0
        for mbit in RATES_MBIT:
            # Two tries per rate: on a shared machine one try can lose 1 % to another
            # process's burst at any rate, which would end the ladder at a random step.
            for _ in range(2):
                result = self.iperf(port, mbit, seconds)
                if result is not None and result["lost_percent"] < 1.0:
                    break
            if result is None or result["lost_percent"] >= 1.0:
                break
            best = result["mbit"]
        return best

    # ------------------------------------------------------------------ DNS

    def dnsperf(self, port: int) -> dict[str, float]:
        seconds = 3 if self.args.quick else 5
        out = subprocess.run(
            ["dnsperf", "-s", "127.0.0.1", "-p", str(port), "-d", str(self.queries), "-l",
             str(seconds), "-c", "8", "-q", "64", "-v"],
            capture_output=True, text=True, timeout=seconds + 30)
        latencies = []
        qps = 0.0
        lost = 0.0
        for line in out.stdout.splitlines():
            if line.startswith("> "):
                try:  # "> NOERROR name A 0.000123"; a timed-out query has no latency
                    latencies.append(float(line.split()[-1]))
                except ValueError:
                    pass
            elif "Queries per second:" in line:
                qps = float(line.split(":")[1])
            elif "Queries lost:" in line:
                lost = float(line.split("(")[1].split("%")[0])
        latencies.sort()
        p99 = latencies[int(len(latencies) * 0.99)] * 1000 if latencies else float("nan")
        return {"qps": qps, "p99_ms": p99, "lost_percent": lost}

    # ------------------------------------------------------------------ memory

    def open_idle_flows(self, count: int, socks: list[socket.socket]) -> int:
        """Open `count` flows through the echo mapping (one datagram each, answered, then
        idle), keeping their client sockets in `socks`; returns how many were answered."""
        fresh = []
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.setblocking(False)
            fresh.append(sock)
            socks.append(sock)
        pending = set(range(count))
        deadline = time.monotonic() + 60
        while pending and time.monotonic() < deadline:
            for n, i in enumerate(sorted(pending)):  # (re)send to those not answered yet
                fresh[i].sendto(b"idle-%d" % i, ("127.0.0.1", self.mapped_echo))
                if n % 200 == 199:
                    time.sleep(0.02)
            time.sleep(0.5)
            for i in list(pending):
                try:
                    fresh[i].recv(100)
                    pending.discard(i)
                except BlockingIOError:
                    pass
        return count - len(pending)

    def idle_flow_memory(self, count: int) -> dict[str, float]:
        """RSS growth per idle flow, from a second batch of `count` flows: the first batch
        pays the one-off costs (the allocator's arenas grown for the transient peak of
        opening many flows at once), the second shows what an idle flow keeps."""
        assert self.server.proc is not None and self.agent.proc is not None
        pids = self.server.proc.pid, self.agent.proc.pid
        socks: list[socket.socket] = []
        try:
            first = self.open_idle_flows(count, socks)
            time.sleep(1.0)
            before = [rss_kib(pid) for pid in pids]
            second = self.open_idle_flows(count, socks)
            time.sleep(1.0)
            after = [rss_kib(pid) for pid in pids]
        finally:
            for sock in socks:
                sock.close()
        return {"flows": first + second,
                "server_bytes_per_flow": (after[0] - before[0]) * 1024 / max(1, second),
                "agent_bytes_per_flow": (after[1] - before[1]) * 1024 / max(1, second)}

    # ------------------------------------------------------------------ run

    def run(self) -> dict[str, Any]:
        rounds = 1 if self.args.quick else self.args.rounds
        results: dict[str, list[float]] = {k: [] for k in (
            "nodeagent_mbit", "socat_mbit", "floor_mbit", "nodeagent_qps", "direct_qps",
            "nodeagent_p99_ms", "direct_p99_ms")}
        steps: list[tuple[str, Callable[[], None]]] = []

        def iperf_via(name: str, port: int) -> Callable[[], None]:
            return lambda: results[f"{name}_mbit"].append(self.highest_rate(port))

        def dns_via(name: str, port: int) -> Callable[[], None]:
            def step() -> None:
                got = self.dnsperf(port)
                results[f"{name}_qps"].append(got["qps"])
                results[f"{name}_p99_ms"].append(got["p99_ms"])
            return step

        for _ in range(rounds):
            steps += [("iperf3 via nodeagent", iperf_via("nodeagent", self.mapped_iperf)),
                      ("iperf3 via socat", iperf_via("socat", self.socat_iperf)),
                      ("iperf3 via a bare trio relay", iperf_via("floor", self.floor_iperf)),
                      ("dnsperf via nodeagent", dns_via("nodeagent", self.mapped_dns)),
                      ("dnsperf direct", dns_via("direct", self.dns_port))]
        for index, (name, step) in enumerate(steps):
            print(f"[{index + 1}/{len(steps)}] {name}", file=sys.stderr, flush=True)
            step()
        memory = self.idle_flow_memory(1000 if self.args.quick else self.args.flows)
        summary = {key: spread(values) for key, values in results.items() if values}
        ratios = {
            "udp_vs_socat": [a / b if b else float("nan") for a, b in
                             zip(results["nodeagent_mbit"], results["socat_mbit"], strict=True)],
            "udp_vs_floor": [a / b if b else float("nan") for a, b in
                             zip(results["nodeagent_mbit"], results["floor_mbit"], strict=True)],
            "dns_qps_vs_direct": [a / b if b else float("nan") for a, b in
                                  zip(results["nodeagent_qps"], results["direct_qps"],
                                      strict=True)],
        }
        return {"rounds": rounds, "datagram_bytes": DATAGRAM, "raw": results,
                "summary": summary, "ratios": {k: spread(v) for k, v in ratios.items()},
                "idle_flow_memory": memory}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flows", type=int, default=3000,
                        help="idle flows per batch for the memory figure (default 3000)")
    args = parser.parse_args()
    missing = [tool for tool in NEEDS if shutil.which(tool) is None]
    if missing:
        print(f"missing: {' '.join(missing)} (apt-get install iperf3 socat dnsperf "
              f"dnsmasq-base)", file=sys.stderr)
        return 2
    bench = Bench(args)
    try:
        bench.setup()
        result = bench.run()
    finally:
        bench.close()
    out = ROOT / "bench-results" / "udp.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    s, r, m = result["summary"], result["ratios"], result["idle_flow_memory"]

    def line(label: str, key: str, unit: str) -> str:
        v = s[key]
        return f"  {label:34} {v['median']:10.1f} {unit}  ({v['min']:.1f}-{v['max']:.1f})"

    print(f"UDP, {result['rounds']} round(s), median (min-max):")
    print(line("iperf3 -u 1400 B, <1% loss, nodeagent", "nodeagent_mbit", "Mbit/s"))
    print(line("iperf3 -u 1400 B, <1% loss, socat", "socat_mbit", "Mbit/s"))
    print(line("iperf3 -u 1400 B, <1% loss, trio relay", "floor_mbit", "Mbit/s"))
    print(f"  {'ratio nodeagent / socat':34} {r['udp_vs_socat']['median']:10.2f}")
    print(f"  {'ratio nodeagent / trio relay':34} {r['udp_vs_floor']['median']:10.2f}")
    print(line("dnsperf via nodeagent", "nodeagent_qps", "q/s"))
    print(line("dnsperf direct", "direct_qps", "q/s"))
    print(f"  {'ratio nodeagent / direct':34} {r['dns_qps_vs_direct']['median']:10.2f}")
    print(line("dns p99 via nodeagent", "nodeagent_p99_ms", "ms"))
    print(line("dns p99 direct", "direct_p99_ms", "ms"))
    print(f"  idle flows: {m['flows']}, server {m['server_bytes_per_flow']:.0f} B/flow, "
          f"agent {m['agent_bytes_per_flow']:.0f} B/flow")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
