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
* dnsperf (Debian's), twice per path: saturated with a bounded number of queries in
  flight (`--dns-clients` x `--dns-in-flight`, default 1 x 16, as a resolver's forwarder
  keeps them: queries per second and p99; by Little's law the latency is the number in
  flight over the rate, so 8 x 64 measures mostly its own queue) and at an offered rate
  of `--dns-rate` queries/s (10,000, open loop: up to 2,000 in flight, so a stall of the
  path grows a queue the p99 shows), through the mapping and asking dnsmasq directly;
* CPU per datagram: the server's and the agent's CPU time (user + system, /proc) per
  datagram carried at a fixed 150 Mbit/s, and per DNS query at the fixed rate: no
  scheduling delay in it, but batches grow with the machine's load, so compare trees
  with it within one run (`--tree`);
* memory per idle flow: the server's and the agent's RSS growth over a second batch of N
  flows opened through the echo mapping (one datagram each, then idle), divided by N
  (the first batch pays the one-off costs).

`--tree PATH` adds a second server and agent run from another checkout (e.g. `git
worktree add --detach /tmp/before main`), measured in the same rounds: a change's effect
beside the machine's load of the moment.

From the repository root:

    sudo .venv/bin/python -m scripts.bench.udp            # ~8 minutes, 3 rounds
    sudo .venv/bin/python -m scripts.bench.udp --quick    # ~2 minutes, 1 round

Needs root (the agent marks its sockets) and: iperf3 socat dnsperf dnsmasq (dnsmasq-base).
A step that fails (iperf3 or dnsperf with no result or no end in time: iperf3 has been
seen to hang past what a path carries) is killed, counted in a row of its own that says
what happened, and the run goes on (the iperf3 server is restarted). Prints the figures
(median, min-max over the rounds, the ratios, the load average) and writes
bench-results/udp.json.
"""

from __future__ import annotations

import argparse
import json
import math
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeagent.testing.procs import NodeagentProcess, rss_kib
from nodeagent.testing.standalone import TOKEN, free_port, make_certs
from nodeagent.testing.udp import run_udp_echo
from scripts import ROOT

NEEDS = ("iperf3", "socat", "dnsperf", "dnsmasq")
RATES_MBIT = (10, 25, 50, 100, 150, 200, 250, 300, 400, 500, 600, 800, 1000, 1200)
DATAGRAM = 1400
CPU_RATE_MBIT = 150  # the offered rate of the CPU-per-datagram runs: every path carries it
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
    """Median, min and max of the rounds that gave a figure (a failed step is NaN)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return {"median": math.nan, "min": math.nan, "max": math.nan}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@dataclass
class Stack:
    """One nodeagent server and agent, with their mappings' public ports."""

    name: str
    server: NodeagentProcess
    agent: NodeagentProcess
    mapped_iperf: int
    mapped_dns: int
    mapped_echo: int


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="nodeagent-bench-udp-"))
        self.procs: list[subprocess.Popen[bytes]] = []
        self.stacks: list[Stack] = []
        # What went wrong, by path: "iperf3 timed out at 800 Mbit/s", ...
        self.failures: dict[str, list[str]] = {}

    def spawn(self, args: list[str]) -> subprocess.Popen[bytes]:
        # A process group of its own: socat's fork children (one per client address)
        # outlive their parent and never time out, so close() ends the whole group.
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def close(self) -> None:
        for stack in self.stacks:
            stack.server.kill()
            stack.agent.kill()
        for proc in self.procs:
            self.kill(proc)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def start_iperf_server(self) -> None:
        # --idle-timeout: a server stuck in a test whose client vanished starts over.
        self.iperf_server = self.spawn(["iperf3", "-s", "-B", "127.0.0.1", "-p",
                                        str(self.iperf_port), "--idle-timeout", "10"])

    def restart_iperf_server(self) -> None:
        self.kill(self.iperf_server)
        self.procs.remove(self.iperf_server)
        self.start_iperf_server()
        time.sleep(0.5)

    def setup(self) -> None:
        self.iperf_port = free_both()
        self.dns_port = free_udp_port()
        self.start_iperf_server()
        self.spawn(["dnsmasq", "--no-daemon", "--no-resolv", "--no-hosts", "--port",
                    str(self.dns_port), "--listen-address", "127.0.0.1", "--bind-interfaces",
                    f"--address=/{ZONE}/10.20.30.40", "--cache-size=0",
                    "--dns-forward-max=10000", "--pid-file="])
        self.echo_ctx = run_udp_echo()
        self.echo = self.echo_ctx.__enter__()
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
        self.certs = make_certs(self.tmp)
        self.start_stack("nodeagent", None)
        if self.args.tree is not None:
            self.start_stack("other", self.args.tree.resolve())
        self.queries = self.tmp / "queries.txt"
        self.queries.write_text("".join(f"host{i}.{ZONE} A\n" for i in range(1000)))
        time.sleep(0.5)

    def start_stack(self, name: str, tree: Path | None) -> Stack:
        """A server and an agent (from `tree`, or this checkout) with the three mappings."""
        certs = self.certs
        target = f"127.0.0.1:{self.iperf_port}"
        tunnel = f"tls://127.0.0.1:{free_port()}"
        mapped_iperf, mapped_dns, mapped_echo = free_both(), free_udp_port(), free_udp_port()
        many = {"max_flows": 100_000, "max_flows_per_client": 100_000}
        server = NodeagentProcess("server", {
            "server_id": "bench", "tunnel": tunnel,
            "tls": {"cert_file": str(certs.server_cert), "key_file": str(certs.server_key)},
            "tokens": [{"node": "edge-1", "token": TOKEN}],
            "tcp": [{"name": "iperf-control", "listen": f"127.0.0.1:{mapped_iperf}",
                     "node": "edge-1", "target": target}],
            "udp": [{"name": "iperf", "listen": f"127.0.0.1:{mapped_iperf}",
                     "node": "edge-1", "target": target, **many},
                    {"name": "dns", "listen": f"127.0.0.1:{mapped_dns}",
                     "node": "edge-1", "target": f"127.0.0.1:{self.dns_port}",
                     "idle_timeout": 30, **many},
                    {"name": "echo", "listen": f"127.0.0.1:{mapped_echo}",
                     "node": "edge-1", "target": f"127.0.0.1:{self.echo.port}",
                     "idle_timeout": 600, **many}],
            "debug_socket": str(self.tmp / f"{name}-server.sock"),
        }, self.tmp, f"{name}-server", extra_args=(), log_level="info", cwd=tree)
        agent = NodeagentProcess("agent", {
            "node": "edge-1", "server": tunnel, "token": TOKEN,
            "tls": {"ca_file": str(certs.ca)},
            "allow": [target, f"udp/{target}", f"udp/127.0.0.1:{self.dns_port}",
                      f"udp/127.0.0.1:{self.echo.port}"],
            "debug_socket": str(self.tmp / f"{name}-agent.sock"),
        }, self.tmp, f"{name}-agent", log_level="info", cwd=tree)
        stack = Stack(name, server, agent, mapped_iperf, mapped_dns, mapped_echo)
        self.stacks.append(stack)  # killed by close() even if it never gets ready
        server.start().wait_ready()
        agent.start().wait_ready()
        server.wait_for(lambda s: any(a["node"] == "edge-1" for a in s["agents"]),
                        what=f"{name}: edge-1 connected")
        return stack

    def failed(self, path: str, what: str) -> None:
        self.failures.setdefault(path, []).append(what)
        print(f"  {path}: {what}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ iperf3

    def iperf(self, path: str, port: int, mbit: int, seconds: float,
              ) -> dict[str, float] | None:
        """One iperf3 -u test; None if it failed (no result, or no end in time: past
        what a path carries the client has been seen to wait for the end of the test
        forever, whichever the path). A client that hangs is killed and the server
        restarted, so the next test starts clean. A server still busy with the last
        test (it ends its side a little after the client) is asked again, twice."""
        for _ in range(3):
            result = self.iperf_once(path, port, mbit, seconds)
            if result != "busy":
                return result
            time.sleep(1.0)
        self.failed(path, f"iperf3 at {mbit} Mbit/s: the server stayed busy: restarted")
        self.restart_iperf_server()
        return None

    def iperf_once(self, path: str, port: int, mbit: int, seconds: float,
                   ) -> dict[str, float] | str | None:
        try:
            out = subprocess.run(
                ["iperf3", "-c", "127.0.0.1", "-p", str(port), "-u", "-l", str(DATAGRAM),
                 "-b", f"{mbit}M", "-t", f"{seconds:g}", "-J", "--connect-timeout", "3000",
                 # the same receive buffer at the iperf3 server whichever path: socket
                 # buffers, not the path, would otherwise decide the loss
                 "-w", "4M"],
                capture_output=True, text=True, timeout=seconds + 20)
        except subprocess.TimeoutExpired:  # run() has killed the client
            self.failed(path, f"iperf3 at {mbit} Mbit/s did not end within "
                              f"{seconds + 20:g} s: killed, server restarted")
            self.restart_iperf_server()
            return None
        try:
            doc = json.loads(out.stdout)
            total = doc["end"]["sum"]
        except (ValueError, KeyError):
            try:
                error = str(json.loads(out.stdout).get("error", ""))
            except (ValueError, AttributeError):
                error = (out.stdout.strip() or out.stderr.strip())[-200:]
            if "busy" in error:
                return "busy"
            self.failed(path, f"iperf3 at {mbit} Mbit/s gave no result"
                              f"{': ' + error if error else ''}")
            return None
        return {"lost_percent": float(total["lost_percent"]),
                "mbit": float(total["bits_per_second"]) / 1e6,
                "datagrams": float(total["packets"]) - float(total["lost_packets"])}

    def highest_rate(self, path: str, port: int) -> float:
        """The receive rate (Mbit/s) at the highest offered rate with < 1 % loss (in
        either of two tries)."""
        seconds = 1.0 if self.args.quick else 2.0
        best = 0.0
        for mbit in RATES_MBIT:
            # Two tries per rate: on a shared machine one try can lose 1 % to another
            # process's burst at any rate, which would end the ladder at a random step.
            for _ in range(2):
                result = self.iperf(path, port, mbit, seconds)
                if result is not None and result["lost_percent"] < 1.0:
                    break
            if result is None or result["lost_percent"] >= 1.0:
                break
            best = result["mbit"]
        return best

    def cpu_per_datagram(self, stack: Stack, mbit: int) -> dict[str, float]:
        """The server's and the agent's CPU time (user + system, from /proc) per datagram
        carried at a fixed offered rate: no scheduling delay in it, but more datagrams per
        wake-up (so less CPU each) when the machine is loaded: compare within a run."""
        seconds = 2.0 if self.args.quick else 3.0
        before = self.cpu(stack)
        result = self.iperf(stack.name, stack.mapped_iperf, mbit, seconds)
        after = self.cpu(stack)
        carried = result["datagrams"] if result is not None else 0.0
        if not carried:
            nan = float("nan")
            return {"server_us": nan, "agent_us": nan}
        return {"server_us": (after[0] - before[0]) / carried * 1e6,
                "agent_us": (after[1] - before[1]) / carried * 1e6}

    @staticmethod
    def cpu(stack: Stack) -> tuple[float, float]:
        """CPU seconds (user + system) the stack's server and agent have used."""
        def used(proc: subprocess.Popen[bytes] | None) -> float:
            assert proc is not None
            fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return used(stack.server.proc), used(stack.agent.proc)

    # ------------------------------------------------------------------ DNS

    def dnsperf_cpu(self, stack: Stack, rate: int) -> dict[str, float]:
        """dnsperf at `rate` through `stack`, with the server's and agent's CPU time
        (user + system) per query answered."""
        before = self.cpu(stack)
        got = self.dnsperf(stack.name, stack.mapped_dns, rate)
        after = self.cpu(stack)
        answered = got["qps"] * (3 if self.args.quick else 5)
        got["cpu_us"] = (sum(after) - sum(before)) / answered * 1e6 if answered else \
            float("nan")
        return got

    def dnsperf(self, path: str, port: int, rate: int | None) -> dict[str, float]:
        """dnsperf for a few seconds: saturated (rate None: --dns-clients x
        --dns-in-flight queries in flight) or offering `rate` queries/s (up to 2,000 in
        flight). Queries answered per second, p50 and p99 (ms), lost."""
        seconds = 3 if self.args.quick else 5
        nan = float("nan")
        try:
            out = subprocess.run(
                ["dnsperf", "-s", "127.0.0.1", "-p", str(port), "-d", str(self.queries),
                 "-l", str(seconds), "-t", "2", "-v",
                 # at a fixed rate, room for every query in flight: a cap of 64 would
                 # throttle the offered rate as soon as latency passes 6 ms
                 *(["-c", str(self.args.dns_clients), "-q", str(self.args.dns_in_flight)]
                   if rate is None else ["-c", "8", "-q", "2000", "-Q", str(rate)])],
                capture_output=True, text=True, timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            self.failed(path, f"dnsperf {'at ' + str(rate) if rate else 'saturated'} "
                              "did not end: killed")
            return {"qps": nan, "p50_ms": nan, "p99_ms": nan, "lost_percent": nan}
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
        if not latencies:
            self.failed(path, f"dnsperf {'at ' + str(rate) if rate else 'saturated'} "
                              f"answered nothing (exit {out.returncode})")
        latencies.sort()

        def pct(q: float) -> float:
            return latencies[int(len(latencies) * q)] * 1000 if latencies else nan

        return {"qps": qps, "p50_ms": pct(0.5), "p99_ms": pct(0.99), "lost_percent": lost}

    # ------------------------------------------------------------------ memory

    def open_idle_flows(self, port: int, count: int, socks: list[socket.socket]) -> int:
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
                fresh[i].sendto(b"idle-%d" % i, ("127.0.0.1", port))
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

    def idle_flow_memory(self, stack: Stack, count: int) -> dict[str, float]:
        """RSS growth per idle flow, from a second batch of `count` flows: the first batch
        pays the one-off costs (the allocator's arenas grown for the transient peak of
        opening many flows at once), the second shows what an idle flow keeps."""
        assert stack.server.proc is not None and stack.agent.proc is not None
        pids = stack.server.proc.pid, stack.agent.proc.pid
        socks: list[socket.socket] = []
        try:
            first = self.open_idle_flows(stack.mapped_echo, count, socks)
            time.sleep(1.0)
            before = [rss_kib(pid) for pid in pids]
            second = self.open_idle_flows(stack.mapped_echo, count, socks)
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
        rate = self.args.dns_rate
        results: dict[str, list[float]] = {}
        loads: list[float] = []

        def record(key: str, value: float) -> None:
            results.setdefault(key, []).append(value)

        def iperf_via(name: str, port: int) -> Callable[[], None]:
            return lambda: record(f"{name}_mbit", self.highest_rate(name, port))

        def dns_via(name: str, port: int, at: int | None) -> Callable[[], None]:
            def step() -> None:
                stack = next((s for s in self.stacks if s.name == name), None)
                if stack is not None and at:
                    got = self.dnsperf_cpu(stack, at)
                    record(f"{name}_at{at}_cpu_us", got["cpu_us"])
                else:
                    got = self.dnsperf(name, port, at)
                mode = f"at{at}" if at else "sat"
                for key in ("qps", "p50_ms", "p99_ms", "lost_percent"):
                    record(f"{name}_{mode}_{key}", got[key])
            return step

        def cpu_via(stack: Stack) -> Callable[[], None]:
            def step() -> None:
                got = self.cpu_per_datagram(stack, CPU_RATE_MBIT)
                record(f"{stack.name}_server_us_per_datagram", got["server_us"])
                record(f"{stack.name}_agent_us_per_datagram", got["agent_us"])
            return step

        steps: list[tuple[str, Callable[[], None]]] = []
        for _ in range(rounds):
            steps.append(("load average", lambda: loads.append(os.getloadavg()[0])))
            for stack in self.stacks if not self.args.dns_only else ():
                steps.append((f"iperf3 via {stack.name}",
                              iperf_via(stack.name, stack.mapped_iperf)))
            for stack in self.stacks if not self.args.dns_only else ():
                steps.append((f"CPU per datagram via {stack.name} at {CPU_RATE_MBIT} Mbit/s",
                              cpu_via(stack)))
            if not self.args.dns_only:
                steps += [("iperf3 via socat", iperf_via("socat", self.socat_iperf)),
                          ("iperf3 via a bare trio relay",
                           iperf_via("floor", self.floor_iperf))]
            for at in (None, rate):
                for stack in self.stacks:
                    steps.append((f"dnsperf via {stack.name}"
                                  f"{f' at {at} q/s' if at else ' saturated'}",
                                  dns_via(stack.name, stack.mapped_dns, at)))
                steps.append((f"dnsperf direct{f' at {at} q/s' if at else ' saturated'}",
                              dns_via("direct", self.dns_port, at)))
        steps.append(("load average", lambda: loads.append(os.getloadavg()[0])))
        for index, (name, step) in enumerate(steps):
            print(f"[{index + 1}/{len(steps)}] {name}", file=sys.stderr, flush=True)
            step()
        flows = 1000 if self.args.quick else self.args.flows
        memory = {stack.name: self.idle_flow_memory(stack, flows) for stack in self.stacks}

        def ratio(a: str, b: str) -> list[float]:
            return [x / y if y else float("nan")
                    for x, y in zip(results.get(a, []), results.get(b, []), strict=False)]

        def total(name: str) -> list[float]:
            return [a + b for a, b in zip(results.get(f"{name}_server_us_per_datagram", []),
                                          results.get(f"{name}_agent_us_per_datagram", []),
                                          strict=False)]

        for stack in self.stacks:
            results[f"{stack.name}_us_per_datagram"] = total(stack.name)
        summary = {key: spread(values) for key, values in results.items() if values}
        ratios = {"udp_vs_socat": ratio("nodeagent_mbit", "socat_mbit"),
                  "udp_vs_floor": ratio("nodeagent_mbit", "floor_mbit"),
                  "dns_qps_vs_direct": ratio("nodeagent_sat_qps", "direct_sat_qps")}
        if len(self.stacks) > 1:
            ratios |= {"udp_vs_other": ratio("nodeagent_mbit", "other_mbit"),
                       "dns_qps_vs_other": ratio("nodeagent_sat_qps", "other_sat_qps"),
                       "cpu_per_datagram_vs_other": ratio("nodeagent_us_per_datagram",
                                                          "other_us_per_datagram"),
                       f"dns_cpu_at{rate}_vs_other": ratio(f"nodeagent_at{rate}_cpu_us",
                                                           f"other_at{rate}_cpu_us"),
                       f"dns_p99_at{rate}_vs_other": ratio(f"nodeagent_at{rate}_p99_ms",
                                                           f"other_at{rate}_p99_ms")}
        return {"rounds": rounds, "datagram_bytes": DATAGRAM, "dns_rate": rate,
                "dns_in_flight": f"{self.args.dns_clients} x {self.args.dns_in_flight}",
                "tree": str(self.args.tree) if self.args.tree else None,
                "stacks": [stack.name for stack in self.stacks], "raw": results,
                "summary": summary, "load_average": loads,
                "ratios": {k: spread(v) for k, v in ratios.items() if v},
                "failures": self.failures, "idle_flow_memory": memory}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one short round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flows", type=int, default=3000,
                        help="idle flows per batch for the memory figure (default 3000)")
    parser.add_argument("--dns-rate", type=int, default=10_000,
                        help="the offered rate (queries/s) of the fixed-rate DNS runs")
    parser.add_argument("--dns-clients", type=int, default=1,
                        help="dnsperf clients (-c) of the saturated DNS runs (default 1)")
    parser.add_argument("--dns-in-flight", type=int, default=16,
                        help="queries each client keeps in flight (-q) in the saturated "
                             "runs (default 16): by Little's law the latency they see is "
                             "clients x in-flight / rate, so this sets the p99 as much as "
                             "the path does")
    parser.add_argument("--dns-only", action="store_true",
                        help="only the DNS runs (and memory), no iperf3")
    parser.add_argument("--tree", type=Path,
                        help="another checkout whose server and agent run beside this one's")
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
    print_table(result)
    print(f"wrote {out}")
    return 0


def print_table(result: dict[str, Any]) -> None:
    s, r = result["summary"], result["ratios"]
    rate = result["dns_rate"]
    names = {"nodeagent": "nodeagent", "other": "nodeagent (--tree)", "socat": "socat",
             "floor": "trio relay", "direct": "dnsmasq direct"}

    def line(label: str, key: str, unit: str, digits: int = 1) -> None:
        v = s.get(key)
        if v is None:
            return
        print(f"  {label:42} {v['median']:10.{digits}f} {unit:6} "
              f"({v['min']:.{digits}f}-{v['max']:.{digits}f})")

    def ratio(label: str, key: str) -> None:
        v = r.get(key)
        if v is not None:
            print(f"  {label:42} {v['median']:10.2f}        "
                  f"({v['min']:.2f}-{v['max']:.2f})")

    loads = result["load_average"]
    print(f"UDP, {result['rounds']} round(s), median (min-max); load average "
          f"{min(loads):.1f}-{max(loads):.1f}")
    for path in ("nodeagent", "other", "socat", "floor"):
        line(f"iperf3 -u 1400 B, <1% loss, {names[path]}", f"{path}_mbit", "Mbit/s")
    ratio("ratio nodeagent / socat", "udp_vs_socat")
    ratio("ratio nodeagent / trio relay", "udp_vs_floor")
    ratio("ratio nodeagent / --tree", "udp_vs_other")
    for path in ("nodeagent", "other"):
        line(f"CPU us/datagram at {CPU_RATE_MBIT} Mbit/s, {names[path]}",
             f"{path}_us_per_datagram", "us", 2)
        line("  server", f"{path}_server_us_per_datagram", "us", 2)
        line("  agent", f"{path}_agent_us_per_datagram", "us", 2)
    ratio("ratio CPU per datagram nodeagent / --tree", "cpu_per_datagram_vs_other")
    for path in ("nodeagent", "other", "direct"):
        line(f"dnsperf, {result.get('dns_in_flight', '')} in flight, {names[path]}",
             f"{path}_sat_qps", "q/s", 0)
        line("  p99", f"{path}_sat_p99_ms", "ms", 2)
    ratio("ratio nodeagent / direct, q/s", "dns_qps_vs_direct")
    ratio("ratio nodeagent / --tree, q/s", "dns_qps_vs_other")
    for path in ("nodeagent", "other", "direct"):
        line(f"dnsperf at {rate} q/s, {names[path]}", f"{path}_at{rate}_qps", "q/s", 0)
        line("  p50", f"{path}_at{rate}_p50_ms", "ms", 2)
        line("  p99", f"{path}_at{rate}_p99_ms", "ms", 2)
        line("  lost", f"{path}_at{rate}_lost_percent", "%", 2)
        line("  CPU per query, server + agent", f"{path}_at{rate}_cpu_us", "us", 1)
    ratio("ratio p99 nodeagent / --tree", f"dns_p99_at{rate}_vs_other")
    ratio("ratio CPU per query nodeagent / --tree", f"dns_cpu_at{rate}_vs_other")
    for name, m in result["idle_flow_memory"].items():
        print(f"  idle flows ({names[name]}): {m['flows']}, server "
              f"{m['server_bytes_per_flow']:.0f} B/flow, agent "
              f"{m['agent_bytes_per_flow']:.0f} B/flow")
    for path, what in result["failures"].items():
        print(f"  FAILED steps, {names.get(path, path)}: {len(what)}: {'; '.join(what)}")


if __name__ == "__main__":
    sys.exit(main())
