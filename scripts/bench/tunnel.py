"""nodeagent benchmark: a direct connection, nodeagent and `ssh -R` in one run.

Builds three network namespaces joined by veth pairs::

    client 10.77.1.1 ── 10.77.1.2 cloud 10.77.2.1 ── 10.77.2.2 edge

The client reaches the edge directly through the cloud namespace (the "direct"
baseline). The nodeagent server runs in cloud (public ports on 10.77.1.2, the tunnel on
10.77.2.1), the agent in edge dials it; targets (iperf3, nginx with a 1 KiB file, a C
echo server, a reader that never reads) listen in edge. OpenSSH's `ssh -R` from edge to
an sshd bound to 10.77.2.1 is the peer to beat. Everything runs as real processes (the
nodeagent CLI), so each gets its own core; wrk, iperf3 and a small C tool
(scripts/bench/lib/benchtool.c) generate load.

From the repository root:

    sudo .venv/bin/python -m scripts.bench.tunnel                    # full run, 3 rounds, ~12 min
    sudo .venv/bin/python -m scripts.bench.tunnel --quick --no-wss --only http --rounds 3
    sudo .venv/bin/python -m scripts.bench.tunnel --quick            # smoke run, ~1 minute
    sudo .venv/bin/python -m scripts.bench.tunnel --only bulk --only http
    sudo .venv/bin/python -m scripts.bench.tunnel --only bulk --profile   # py-spy summaries
    sudo .venv/bin/python -m scripts.bench.tunnel --only http --workers 2  # server: 2 processes
    sudo .venv/bin/python -m scripts.bench.tunnel --quick --no-wss --only connrate --c-relay

`--c-relay` adds the C prototype of the tunnel's data path (scripts/bench/bulk_relay.c:
a TCP mapping's connections and the HTTP front routing by Host, both endpoints in C) to
the connrate and http tests, run in each round between nodeagent and `ssh -R`, its CPU
per connection and per request from /proc as nodeagent's (docs/performance.md, "A
compiled connection and request path, measured"). `--c-agent` adds nodeagent's server
with the C prototype as its agent (the protocol's HELLO, the same frames): one endpoint
compiled. Both need libssl-dev and libhttp-parser-dev.

Needs root and: iproute2 wrk iperf3 nginx-light openssh-server openssh-client gcc.
Prints a table per round and, over the rounds, each headline ratio's median with its
min-max; writes bench-results/bench.json (every round's raw figures under "rounds", the
medians under "summary"). Namespaces and processes are removed
on exit, Ctrl-C included.

One module although it is long: it is one run over one topology, and every measurement
shares its namespaces, processes and result table (the load tools live in lib/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from nodeagent.testing.netns import Topology, in_netns, netns_available
from scripts import ROOT
from scripts.bench.lib.tools import (
    build_benchtool,
    missing_commands,
    parse_wrk,
    summarize_profile,
    write_nginx_conf,
    write_sshd_config,
)

CLIENT, PUBLIC, CLOUD, EDGE = "10.77.1.1", "10.77.1.2", "10.77.2.1", "10.77.2.2"
TOKEN = "bench-token-0123456789abcdef"
IPERF, HTTP, ECHO, SINK = 5201, 8080, 7000, 7001  # targets in edge
ECHO_CLOSE = 7002  # an echo server that closes each connection after its first echo
TESTS = ("bulk", "parallel", "http", "connrate", "fairness", "idle", "stall")
SSH_OFFSET, NA_OFFSET, WSS_OFFSET = 30000, 10000, 20000  # public port = target + offset
C_OFFSET = 40000  # --c-relay: the C prototype's public ports
C_AGENT_OFFSET = 50000  # --c-agent: a nodeagent server whose agent is the C prototype's


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick: bool = args.quick
        self.dur = 2 if self.quick else 6  # seconds per measurement
        self.tmp = Path(tempfile.mkdtemp(prefix="nodeagent-bench-"))
        self.topo = Topology()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.results: dict[str, Any] = {}
        self.notes: list[str] = []
        self.tool = build_benchtool(Path(tempfile.gettempdir()) / "nodeagent-benchtool")
        self.stack: dict[str, Stack] = {}
        self.crelay: CRelay | None = None
        self.cagent: CAgentStack | None = None

    # ------------------------------------------------------------------ plumbing

    def log(self, msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def spawn(self, ns: str, args: list[str], name: str, **kw: Any) -> subprocess.Popen[bytes]:
        out = (self.tmp / f"{name}.log").open("ab")
        proc = self.topo.popen(ns, args, stdout=out, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, **kw)
        self.procs.append(proc)
        return proc

    def run(self, ns: str, args: list[str], timeout: float) -> str:
        proc = subprocess.run(["ip", "netns", "exec", self.topo.ns(ns), *args],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): "
                               f"{proc.stderr.strip()[-2000:]} {proc.stdout.strip()[-2000:]}")
        return proc.stdout

    def wait_listening(self, ns: str, port: int, host: str | None = None,
                       timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(ns, ["ss", "-Hltn"], timeout=5)
            for line in out.splitlines():
                local = line.split()[3]
                h, _, p = local.rpartition(":")
                if int(p) == port and (host is None or h in (host, "0.0.0.0", "*")):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"nothing listens on {host or '*'}:{port} in {ns} after {timeout}s")

    def close(self) -> None:
        for stack in list(self.stack.values()):
            stack.stop()
        if self.crelay is not None:
            self.crelay.stop()
        if self.cagent is not None:
            self.cagent.stop()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 3
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.01, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.topo.close()
        if not self.args.keep:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        t = self.topo
        for name in ("client", "cloud", "edge"):
            t.add(name)
        t.link("client", [f"{CLIENT}/24"], "cloud", [f"{PUBLIC}/24"])
        t.link("cloud", [f"{CLOUD}/24"], "edge", [f"{EDGE}/24"])
        t.route("client", "10.77.2.0/24", PUBLIC)
        t.route("edge", "10.77.1.0/24", CLOUD)
        for ns in ("client", "cloud", "edge"):
            t.exec(ns, ["sysctl", "-qw", "net.ipv4.tcp_tw_reuse=1"])
            t.exec(ns, ["sysctl", "-qw", "net.ipv4.ip_local_port_range=1024 65000"])
            t.exec(ns, ["sysctl", "-qw", "net.core.somaxconn=8192"])
        self.log(f"namespaces {', '.join(t.namespaces.values())}; workdir {self.tmp}")
        # Targets in edge.
        self.spawn("edge", ["iperf3", "-s", "-p", str(IPERF)], "iperf3")
        self.spawn("edge", write_nginx_conf(self.tmp, HTTP), "nginx")
        self.spawn("edge", [str(self.tool), "echo", str(ECHO)], "echo")
        self.spawn("edge", [str(self.tool), "sink", str(SINK)], "sink")
        self.spawn("edge", [str(self.tool), "echoclose", str(ECHO_CLOSE)], "echoclose")
        for port in (IPERF, HTTP, ECHO, SINK, ECHO_CLOSE):
            self.wait_listening("edge", port)
        self.results["env"] = environment()
        self.setup_certs()
        if not self.args.no_ssh:
            self.setup_ssh()

    def setup_certs(self) -> None:
        from nodeagent.trust import pki
        ca = pki.create_ca("nodeagent-bench-ca")
        ca.write(self.tmp / "ca.crt", self.tmp / "ca.key")
        pki.issue_server_certificate(ca, ["localhost"], [CLOUD]).write(
            self.tmp / "server.crt", self.tmp / "server.key")

    def setup_ssh(self) -> None:
        d = self.tmp / "ssh"
        self.spawn("cloud", write_sshd_config(d, CLOUD), "sshd")
        self.wait_listening("cloud", 2222, CLOUD)
        forwards = []
        for port in (IPERF, HTTP, ECHO, SINK, ECHO_CLOSE):
            forwards += ["-R", f"{PUBLIC}:{port + SSH_OFFSET}:127.0.0.1:{port}"]
        # The cipher is pinned (--ssh-cipher): left to negotiation, OpenSSH picks
        # chacha20-poly1305 first, and what a peer build prefers is not this benchmark's
        # business. The default, aes256-gcm, is the cipher the tunnel's TLS 1.3 negotiates
        # (TLS_AES_256_GCM_SHA384), on the same AES-NI path: the comparison is the relay's,
        # not the ciphers'.
        common = ["-i", str(d / "id"), "-p", "2222", "-c", self.args.ssh_cipher,
                  "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                  "-o", "BatchMode=yes"]
        self.ssh = self.spawn("edge", [
            "ssh", "-N", *common, "-o", "ExitOnForwardFailure=yes", "-o", "LogLevel=ERROR",
            *forwards, f"root@{CLOUD}"], "ssh")
        for port in (IPERF, HTTP, ECHO, SINK, ECHO_CLOSE):
            self.wait_listening("cloud", port + SSH_OFFSET, PUBLIC)
        # What was negotiated, from a second session with the same options (the forwarding
        # one logs errors only): the line `kex: server->client cipher: C MAC: M ...`.
        probe = subprocess.run(["ip", "netns", "exec", self.topo.ns("edge"), "ssh", "-v",
                                *common, f"root@{CLOUD}", "true"],
                               capture_output=True, text=True, timeout=30)
        self.results.setdefault("env", {})["ssh_cipher_negotiated"] = next(
            (ln.split("cipher:", 1)[1].split()[0] for ln in probe.stderr.splitlines()
             if "kex: server->client cipher:" in ln), "?")

    def start_stack(self, scheme: str) -> Stack:
        if scheme in self.stack:
            return self.stack[scheme]
        stack = Stack(self, scheme)
        stack.start()
        self.stack[scheme] = stack
        return stack

    def start_crelay(self) -> CRelay:
        """The C prototype's server (cloud) and agent (edge), started once per run."""
        if self.crelay is None:
            self.crelay = CRelay(self)
            self.crelay.start()
        return self.crelay

    def start_cagent(self) -> CAgentStack:
        """nodeagent's server with the C prototype as its agent, started once per run."""
        if self.cagent is None:
            self.cagent = CAgentStack(self)
            self.cagent.start()
        return self.cagent

    def stop_stack(self, scheme: str) -> None:
        stack = self.stack.pop(scheme, None)
        if stack is not None:
            stack.stop()

    # ------------------------------------------------------------------ tools

    def iperf(self, host: str, port: int, *, seconds: float, parallel: int = 1,
              reverse: bool = False) -> float:
        """Bits per second received (iperf3, client namespace)."""
        args = ["iperf3", "-c", host, "-p", str(port), "-t", str(seconds), "-J",
                "--connect-timeout", "5000", "-P", str(parallel)]
        if reverse:
            args.append("-R")
        for attempt in range(3):
            try:
                doc = json.loads(self.run("client", args, timeout=seconds + 30))
            except RuntimeError as exc:  # iperf3 exits 1 with its JSON: read the error there
                doc = {"error": str(exc)}
            if "error" not in doc:
                return float(doc["end"]["sum_received"]["bits_per_second"])
            # e.g. "the server is busy running a test": the previous test's server side
            # had not finished yet
            self.log(f"iperf3: {str(doc['error'])[:200]}; again (attempt {attempt + 2} of 3)")
            time.sleep(2)
        raise RuntimeError(f"iperf3 failed 3 times: {doc['error']}")

    def wrk(self, url: str, *, seconds: float, host: str | None = None) -> dict[str, float]:
        args = ["wrk", "-t2", "-c16", f"-d{seconds}s", "--latency", "--timeout", "5s"]
        if host:
            args += ["-H", f"Host: {host}"]
        return parse_wrk(self.run("client", [*args, url], timeout=seconds + 30))

    def benchtool(self, *args: str | int | float, timeout: float) -> dict[str, float]:
        out = self.run("client", [str(self.tool), *map(str, args)], timeout=timeout)
        return json.loads(out)  # type: ignore[no-any-return]

    @contextlib.contextmanager
    def profiled(self, name: str, stack: Stack | CRelay | CAgentStack | None,
                 seconds: float) -> Iterator[dict[str, float]]:
        """Measure the CPU seconds server and agent use in the body (into the yielded
        dict); with --profile also py-spy record them for `seconds`."""
        cpu: dict[str, float] = {}
        before = stack.cpu() if stack is not None else {}
        try:
            with self._spy(name, stack, seconds):
                yield cpu
        finally:
            if stack is not None:
                after = stack.cpu()
                cpu.update({k: round(after[k] - before[k], 3) for k in before})
            self.results.setdefault("cpu_seconds", {})[name] = dict(cpu)

    @contextlib.contextmanager
    def _spy(self, name: str, stack: Stack | CRelay | CAgentStack | None,
             seconds: float) -> Iterator[None]:
        if not self.args.profile or not isinstance(stack, Stack) or isinstance(
                stack, CAgentStack):
            yield
            return
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        procs = []
        for role, pid in (("server", stack.server.pid), ("agent", stack.agent.pid)):
            out = self.tmp / f"profile-{name}-{role}.txt"
            procs.append((role, out, subprocess.Popen(
                [spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                 "--rate", "250", "--format", "raw", "--output", str(out), "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        try:
            yield
        finally:
            for role, out, proc in procs:
                try:
                    proc.wait(seconds + 20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                summary = summarize_profile(out) if out.exists() else "(py-spy failed)"
                dest = ROOT / "bench-results" / f"profile-{name}-{role}.txt"
                dest.write_text(summary + "\n")
                if out.exists():
                    shutil.copy(out, dest.with_suffix(".raw"))
                print(f"--- profile {name} {role} ---\n{summary}\n", flush=True)

    # ------------------------------------------------------------------ tests

    def test_bulk(self) -> None:
        r = self.results["bulk"] = {}
        d = self.dur
        for direction, reverse in (("up", False), ("down", True)):
            row = r[direction] = {}
            self.log(f"bulk {direction}: direct")
            row["direct_gbps"] = self.iperf(EDGE, IPERF, seconds=d, reverse=reverse) / 1e9
            tls = self.start_stack("tls")
            self.log(f"bulk {direction}: nodeagent tls")
            with self.profiled(f"bulk-{direction}", tls, d) as cpu:
                row["tls_gbps"] = self.iperf(PUBLIC, IPERF + NA_OFFSET, seconds=d,
                                             reverse=reverse) / 1e9
            row["tls_cpu_s_per_gb"] = per_unit(cpu, row["tls_gbps"] * d / 8)
            if not self.args.no_ssh:
                self.log(f"bulk {direction}: ssh -R")
                row["ssh_gbps"] = self.iperf(PUBLIC, IPERF + SSH_OFFSET, seconds=d,
                                             reverse=reverse) / 1e9
        if not self.args.no_wss:
            self.stop_stack("tls")
            self.start_stack("wss")
            wss = self.stack["wss"]
            for direction, reverse in (("up", False), ("down", True)):
                self.log(f"bulk {direction}: nodeagent wss")
                with self.profiled(f"bulk-wss-{direction}", wss, d) as cpu:
                    gbps = self.iperf(PUBLIC, IPERF + WSS_OFFSET, seconds=d,
                                      reverse=reverse) / 1e9
                r[direction]["wss_gbps"] = gbps
                r[direction]["wss_cpu_s_per_gb"] = per_unit(cpu, gbps * d / 8)
            self.stop_stack("wss")

    def test_parallel(self) -> None:
        r = self.results["parallel"] = {}
        d = self.dur
        self.log("8 streams: direct")
        r["direct_gbps"] = self.iperf(EDGE, IPERF, seconds=d, parallel=8) / 1e9
        tls = self.start_stack("tls")
        self.log("8 streams: nodeagent tls")
        with self.profiled("parallel", tls, d) as cpu:
            r["tls_gbps"] = self.iperf(PUBLIC, IPERF + NA_OFFSET, seconds=d, parallel=8) / 1e9
        r["tls_cpu_s_per_gb"] = per_unit(cpu, r["tls_gbps"] * d / 8)
        if not self.args.no_ssh:
            self.log("8 streams: ssh -R")
            r["ssh_gbps"] = self.iperf(PUBLIC, IPERF + SSH_OFFSET, seconds=d, parallel=8) / 1e9

    def test_http(self) -> None:
        r = self.results["http"] = {}
        d = self.dur
        self.log("http: direct")
        r["direct"] = self.wrk(f"http://{EDGE}:{HTTP}/1k", seconds=d)
        tls = self.start_stack("tls")
        self.log("http: nodeagent tls (Host router)")
        with self.profiled("http", tls, d) as cpu:
            r["tls"] = self.wrk(f"http://{PUBLIC}:{HTTP + NA_OFFSET}/1k", seconds=d,
                                host="bench.test")
        r["tls"]["cpu_us_per_req"] = {k: v * 1e6 for k, v in per_unit(
            cpu, r["tls"]["req_per_sec"] * d).items()}
        self.log("http: nodeagent server's HTTP front only (server dials nginx, no tunnel)")
        with self.profiled("http-front-only", tls, d) as cpu:
            r["front_only"] = self.wrk(f"http://{PUBLIC}:{HTTP + NA_OFFSET}/1k", seconds=d,
                                       host="front.test")
        r["front_only"]["cpu_us_per_req"] = {k: v * 1e6 for k, v in per_unit(
            cpu, r["front_only"]["req_per_sec"] * d).items()}
        if not self.args.no_ssh:
            self.log("http: ssh -R")
            r["ssh"] = self.wrk(f"http://{PUBLIC}:{HTTP + SSH_OFFSET}/1k", seconds=d)
        if self.args.c_agent:
            cagent = self.start_cagent()
            self.log("http: nodeagent server + C agent")
            with self.profiled("http-c-agent", cagent, d) as cpu:
                r["c_agent"] = self.wrk(f"http://{PUBLIC}:{HTTP + C_AGENT_OFFSET}/1k",
                                        seconds=d, host="bench.test")
            r["c_agent"]["cpu_us_per_req"] = {k: v * 1e6 for k, v in per_unit(
                cpu, r["c_agent"]["req_per_sec"] * d).items()}
        if self.args.c_relay:
            crelay = self.start_crelay()
            self.log("http: C relay (Host router, the prototype)")
            with self.profiled("http-c", crelay, d) as cpu:
                r["c"] = self.wrk(f"http://{PUBLIC}:{HTTP + C_OFFSET}/1k", seconds=d,
                                  host="bench.test")
            r["c"]["cpu_us_per_req"] = {k: v * 1e6 for k, v in per_unit(
                cpu, r["c"]["req_per_sec"] * d).items()}
        r["added_p50_ms"] = r["tls"]["p50_ms"] - r["direct"]["p50_ms"]

    def test_connrate(self) -> None:
        """Two tests: the client closes (connrate), and the harder one where the target
        closes first and the client waits for that close (its FIN crosses the tunnel)
        before its next connection (connwait against the echoclose target)."""
        d = self.dur
        tls = None
        for key, mode, port, label in (
                ("connrate", "connrate", ECHO, "client closes"),
                ("connrate_close_first", "connwait", ECHO_CLOSE, "target closes first")):
            r = self.results[key] = {}
            self.log(f"new connections/s ({label}): direct")
            r["direct"] = self.benchtool(mode, EDGE, port, d, 16, timeout=d + 30)
            tls = tls or self.start_stack("tls")
            self.log(f"new connections/s ({label}): nodeagent tls (TCP port mapping)")
            with self.profiled(key, tls, d) as cpu:
                r["tls"] = self.benchtool(mode, PUBLIC, port + NA_OFFSET, d, 16,
                                          timeout=d + 30)
            r["tls"]["cpu_us_per_conn"] = {k: v * 1e6 for k, v in per_unit(
                cpu, r["tls"]["per_sec"] * d).items()}
            if self.args.c_agent:
                cagent = self.start_cagent()
                time.sleep(1)
                self.log(f"new connections/s ({label}): nodeagent server + C agent")
                with self.profiled(f"{key}-c-agent", cagent, d) as cpu:
                    r["c_agent"] = self.benchtool(mode, PUBLIC, port + C_AGENT_OFFSET, d, 16,
                                                  timeout=d + 30)
                r["c_agent"]["cpu_us_per_conn"] = {k: v * 1e6 for k, v in per_unit(
                    cpu, r["c_agent"]["per_sec"] * d).items()}
            if self.args.c_relay:
                crelay = self.start_crelay()
                time.sleep(1)
                self.log(f"new connections/s ({label}): C relay (the prototype)")
                with self.profiled(f"{key}-c", crelay, d) as cpu:
                    r["c"] = self.benchtool(mode, PUBLIC, port + C_OFFSET, d, 16,
                                            timeout=d + 30)
                r["c"]["cpu_us_per_conn"] = {k: v * 1e6 for k, v in per_unit(
                    cpu, r["c"]["per_sec"] * d).items()}
            if not self.args.no_ssh:
                time.sleep(1)
                self.log(f"new connections/s ({label}): ssh -R")
                r["ssh"] = self.benchtool(mode, PUBLIC, port + SSH_OFFSET, d, 16,
                                          timeout=d + 30)

    def _fairness(self, echo_port: int, iperf_port: int) -> dict[str, Any]:
        d = self.dur
        alone = self.benchtool("rr", PUBLIC, echo_port, d, 50, 64, timeout=d + 30)
        bulk = self.topo.popen("client", ["iperf3", "-c", PUBLIC, "-p", str(iperf_port), "-t",
                                          str(d + 3), "-J"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.0)
            loaded = self.benchtool("rr", PUBLIC, echo_port, d, 50, 64, timeout=d + 30)
            out, _ = bulk.communicate(timeout=d + 30)
            bulk_bps = float(json.loads(out)["end"]["sum_received"]["bits_per_second"])
        finally:
            if bulk.poll() is None:
                bulk.kill()
                bulk.wait()
        return {"alone": alone, "with_bulk": loaded, "bulk_gbps": bulk_bps / 1e9,
                "p99_ratio": loaded["p99_us"] / max(1.0, alone["p99_us"]),
                "p50_ratio": loaded["p50_us"] / max(1.0, alone["p50_us"])}

    def test_fairness(self) -> None:
        r = self.results["fairness"] = {}
        tls = self.start_stack("tls")
        self.log("fairness: 50 request/response streams, without and with 1 bulk stream")
        with self.profiled("fairness", tls, self.dur * 2 + 2):
            r["tls"] = self._fairness(ECHO + NA_OFFSET, IPERF + NA_OFFSET)
        if not self.args.no_ssh:
            self.log("fairness: ssh -R")
            r["ssh"] = self._fairness(ECHO + SSH_OFFSET, IPERF + SSH_OFFSET)

    def _open_idle(self, port: int, count: int, socks: list[socket.socket],
                   concurrency: int = 256) -> tuple[float, int]:
        """Open connections from the client namespace until `socks` holds `count`,
        each proven end to end by a 1-byte echo. Returns (seconds, failed attempts)."""
        import selectors
        t0 = time.monotonic()
        failures = 0
        sel = selectors.DefaultSelector()
        pending: dict[socket.socket, str] = {}
        deadline = t0 + (120 if not self.quick else 60)
        with in_netns(self.topo.ns("client")):
            while len(socks) < count:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {len(socks)} of {count} idle streams opened")
                while len(pending) < concurrency and len(socks) + len(pending) < count:
                    s = socket.socket()
                    s.setblocking(False)
                    s.connect_ex((PUBLIC, port))
                    pending[s] = "connect"
                    sel.register(s, selectors.EVENT_WRITE)
                for key, _ in sel.select(timeout=5):
                    s = key.fileobj  # type: ignore[assignment]
                    assert isinstance(s, socket.socket)
                    state = pending[s]
                    try:
                        if state == "connect":
                            err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                            if err:
                                raise OSError(err, os.strerror(err))
                            s.send(b"x")
                            pending[s] = "echo"
                            sel.modify(s, selectors.EVENT_READ)
                        else:
                            if s.recv(1) != b"x":
                                raise OSError("no echo")
                            sel.unregister(s)
                            del pending[s]
                            socks.append(s)
                    except OSError:
                        failures += 1
                        sel.unregister(s)
                        del pending[s]
                        s.close()
                        time.sleep(0.01)  # refused (e.g. the open-rate limit): retry
        sel.close()
        return time.monotonic() - t0, failures

    def test_idle(self) -> None:
        r = self.results["idle"] = {}
        total = 2000 if self.quick else 10_000
        # Fresh processes so earlier tests' allocations do not blur the figures.
        self.stop_stack("tls")
        tls = self.start_stack("tls")
        time.sleep(1)
        base = tls.rss()
        socks: list[socket.socket] = []
        try:
            self.log("idle: 1,000 connections through nodeagent")
            t1, f1 = self._open_idle(ECHO + NA_OFFSET, 1000, socks)
            time.sleep(1)
            at1k = tls.rss()
            self.log(f"idle: {total:,} connections through nodeagent")
            t2, f2 = self._open_idle(ECHO + NA_OFFSET, total, socks)
            time.sleep(1)
            atn = tls.rss()
            streams = tls.agent_status()["tunnel"]["streams_open"]
        finally:
            for s in socks:
                s.close()
        r["tls"] = {
            "streams": total, "streams_open_seen_by_agent": streams,
            "rss_base_mib": {k: v / 2**20 for k, v in base.items()},
            "rss_1k_mib": {k: v / 2**20 for k, v in at1k.items()},
            "rss_n_mib": {k: v / 2**20 for k, v in atn.items()},
            "bytes_per_stream": {k: (atn[k] - base[k]) / total for k in base},
            "open_seconds_1k": t1, "open_seconds_n": t1 + t2,
            "open_per_sec": total / (t1 + t2), "failed_attempts": f1 + f2,
        }
        self.stop_stack("tls")
        if not self.args.no_ssh:
            socks = []
            base = self.ssh_rss()
            try:
                self.log("idle: 1,000 connections through ssh -R")
                t1, f1 = self._open_idle(ECHO + SSH_OFFSET, 1000, socks)
                time.sleep(1)
                at1k = self.ssh_rss()
            finally:
                for s in socks:
                    s.close()
            r["ssh"] = {"rss_base_mib": {k: v / 2**20 for k, v in base.items()},
                        "rss_1k_mib": {k: v / 2**20 for k, v in at1k.items()},
                        "open_seconds_1k": t1, "failed_attempts": f1}

    def ssh_rss(self) -> dict[str, int]:
        cloud = [int(p) for p in self.topo.exec("cloud", ["ip", "netns", "pids",
                                                          self.topo.ns("cloud")],
                                                check=False).stdout.split()]
        sshd = 0
        for pid in cloud:
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip().startswith("sshd"):
                    sshd += rss_of(pid)
        return {"server": sshd, "agent": rss_of(self.ssh.pid)}

    def test_stall(self) -> None:
        r = self.results["stall"] = {}
        d = self.dur
        tls = self.start_stack("tls")
        self.log("stall: bulk stream alone")
        r["bulk_alone_gbps"] = self.iperf(PUBLIC, IPERF + NA_OFFSET, seconds=d) / 1e9
        before = tls.rss()
        stop = threading.Event()
        pushed = [0]
        with in_netns(self.topo.ns("client")):
            s = socket.create_connection((PUBLIC, SINK + NA_OFFSET), timeout=5)

        def writer() -> None:
            s.setblocking(False)
            chunk = b"s" * 65536
            import select
            while not stop.is_set():
                select.select([], [s], [], 0.2)
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    pushed[0] += s.send(chunk)

        thread = threading.Thread(target=writer, daemon=True)
        thread.start()
        try:
            time.sleep(2)
            stalled_at = pushed[0]
            self.log("stall: bulk stream beside a stream whose reader stopped reading")
            r["bulk_beside_stalled_gbps"] = self.iperf(PUBLIC, IPERF + NA_OFFSET,
                                                       seconds=d) / 1e9
            during = tls.rss()
            time.sleep(1)
            r["stalled_stream_bytes_accepted"] = pushed[0]
            r["stalled_stream_grew_after_2s"] = pushed[0] - stalled_at
        finally:
            stop.set()
            thread.join()
            s.close()
        r["ratio"] = r["bulk_beside_stalled_gbps"] / r["bulk_alone_gbps"]
        r["rss_before_mib"] = {k: v / 2**20 for k, v in before.items()}
        r["rss_during_mib"] = {k: v / 2**20 for k, v in during.items()}
        r["window_mib"] = 1.0  # the stream window (protocol Settings default)


def environment() -> dict[str, Any]:
    """What can move the figures between runs, recorded with them: CPU frequency scaling
    (a VM usually exposes none), the target's worker count, the machine's load."""
    governor = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
    return {
        "cpu_model": next((ln.split(":", 1)[1].strip() for ln in
                           Path("/proc/cpuinfo").read_text().splitlines()
                           if ln.startswith("model name")), "?"),
        "aes_ni": " aes " in Path("/proc/cpuinfo").read_text(),
        "cpufreq_governor": governor.read_text().strip() if governor.exists()
        else "not exposed (fixed by the host)",
        "nginx_workers": 1,  # lib/tools.write_nginx_conf: one worker, as for every scenario
        "placement": "scheduler's (no taskset): see docs/performance.md",
        "loadavg_at_start": os.getloadavg(),
    }


# The headline figures, per round: (key, label, goal, value of a round's results). A ratio
# is nodeagent over `ssh -R` measured in the same round, so a machine that is slower
# for a while slows both.
HEADLINES: list[tuple[str, str, str, Any]] = [
    ("http_vs_ssh", "HTTP req/s, nodeagent / ssh -R", ">= 2x",
     lambda r: r["http"]["tls"]["req_per_sec"] / r["http"]["ssh"]["req_per_sec"]),
    ("http_p99_ms", "HTTP p99 ms, nodeagent", "<= 5",
     lambda r: r["http"]["tls"]["p99_ms"]),
    ("http_ssh_p99_ms", "HTTP p99 ms, ssh -R", "",
     lambda r: r["http"]["ssh"]["p99_ms"]),
    ("http_ssh_req_per_sec", "HTTP req/s, ssh -R (the baseline itself)", "",
     lambda r: r["http"]["ssh"]["req_per_sec"]),
    ("http_cpu_us_per_req", "CPU us/request, server + agent", "",
     lambda r: sum(r["http"]["tls"]["cpu_us_per_req"].values())),
    ("connrate_vs_ssh", "new conn/s, client closes, nodeagent / ssh -R", ">= 1x",
     lambda r: r["connrate"]["tls"]["per_sec"] / r["connrate"]["ssh"]["per_sec"]),
    ("connrate_close_first_vs_ssh", "new conn/s, target closes first, nodeagent / ssh -R",
     ">= 1x", lambda r: (r["connrate_close_first"]["tls"]["per_sec"]
                         / r["connrate_close_first"]["ssh"]["per_sec"])),
    ("conn_cpu_us", "CPU us/connection (target closes), server + agent", "",
     lambda r: sum(r["connrate_close_first"]["tls"]["cpu_us_per_conn"].values())),
    # --c-relay: the C prototype in the same rounds.
    ("http_c_vs_ssh", "HTTP req/s, C relay / ssh -R", "",
     lambda r: r["http"]["c"]["req_per_sec"] / r["http"]["ssh"]["req_per_sec"]),
    ("http_c_p99_ms", "HTTP p99 ms, C relay", "", lambda r: r["http"]["c"]["p99_ms"]),
    ("http_c_cpu_us_per_req", "CPU us/request, C relay server + agent", "",
     lambda r: sum(r["http"]["c"]["cpu_us_per_req"].values())),
    ("connrate_c_vs_ssh", "new conn/s, client closes, C relay / ssh -R", "",
     lambda r: r["connrate"]["c"]["per_sec"] / r["connrate"]["ssh"]["per_sec"]),
    ("connrate_close_first_c_vs_ssh", "new conn/s, target closes first, C relay / ssh -R",
     "", lambda r: (r["connrate_close_first"]["c"]["per_sec"]
                    / r["connrate_close_first"]["ssh"]["per_sec"])),
    ("conn_c_cpu_us", "CPU us/connection (target closes), C relay server + agent", "",
     lambda r: sum(r["connrate_close_first"]["c"]["cpu_us_per_conn"].values())),
    ("conn_c_client_closes_cpu_us", "CPU us/connection (client closes), C relay", "",
     lambda r: sum(r["connrate"]["c"]["cpu_us_per_conn"].values())),
    # --c-agent: nodeagent's server, the C prototype as its agent.
    ("http_c_agent_vs_ssh", "HTTP req/s, nodeagent server + C agent / ssh -R", "",
     lambda r: r["http"]["c_agent"]["req_per_sec"] / r["http"]["ssh"]["req_per_sec"]),
    ("http_c_agent_p99_ms", "HTTP p99 ms, nodeagent server + C agent", "",
     lambda r: r["http"]["c_agent"]["p99_ms"]),
    ("http_c_agent_cpu_us_server", "CPU us/request, nodeagent server (C agent)", "",
     lambda r: r["http"]["c_agent"]["cpu_us_per_req"]["server"]),
    ("http_c_agent_cpu_us_agent", "CPU us/request, C agent (nodeagent server)", "",
     lambda r: r["http"]["c_agent"]["cpu_us_per_req"]["agent"]),
    ("connrate_close_first_c_agent_vs_ssh",
     "new conn/s, target closes first, nodeagent server + C agent / ssh -R", "",
     lambda r: (r["connrate_close_first"]["c_agent"]["per_sec"]
                / r["connrate_close_first"]["ssh"]["per_sec"])),
    ("conn_c_agent_cpu_us_server", "CPU us/connection (target closes), nodeagent server "
     "(C agent)", "",
     lambda r: r["connrate_close_first"]["c_agent"]["cpu_us_per_conn"]["server"]),
    ("conn_c_agent_cpu_us_agent", "CPU us/connection (target closes), C agent", "",
     lambda r: r["connrate_close_first"]["c_agent"]["cpu_us_per_conn"]["agent"]),
    ("bulk_up_vs_ssh", "1 stream client->edge, nodeagent / ssh -R", ">= 1x",
     lambda r: r["bulk"]["up"]["tls_gbps"] / r["bulk"]["up"]["ssh_gbps"]),
    ("bulk_down_vs_ssh", "1 stream edge->client, nodeagent / ssh -R", ">= 1x",
     lambda r: r["bulk"]["down"]["tls_gbps"] / r["bulk"]["down"]["ssh_gbps"]),
    ("bulk_cpu_s_per_gb", "CPU s/GB both ways, server + agent", "",
     lambda r: sum(sum(r["bulk"][d]["tls_cpu_s_per_gb"].values()) for d in ("up", "down"))),
    ("parallel_vs_ssh", "8 streams, nodeagent / ssh -R", "",
     lambda r: r["parallel"]["tls_gbps"] / r["parallel"]["ssh_gbps"]),
]


def summarize(rounds: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each headline over the rounds that measured it: median, min, max, every value."""
    import statistics
    out = {}
    for key, label, goal, value in HEADLINES:
        values = []
        for r in rounds:
            with contextlib.suppress(KeyError, TypeError, ZeroDivisionError):
                values.append(float(value(r)))
        if values:
            out[key] = {"label": label, "goal": goal, "median": statistics.median(values),
                        "min": min(values), "max": max(values), "rounds": values}
    return out


def summary_table(summary: dict[str, dict[str, Any]]) -> str:
    rows: list[tuple[str, ...]] = [("headline (per round, then over rounds)", "median",
                                    "min-max", "goal", "rounds")]
    for s in summary.values():
        rows.append((s["label"], f"{s['median']:,.2f}", f"{s['min']:,.2f}-{s['max']:,.2f}",
                     s["goal"], " ".join(f"{v:,.2f}" for v in s["rounds"])))
    return _render(rows)


def per_unit(cpu: dict[str, float], units: float) -> dict[str, float]:
    return {k: v / units for k, v in cpu.items()} if units > 0 else {}


def cpu_of(pid: int) -> float:
    """User + system CPU seconds a process has used."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def rss_of(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Stack:
    """A nodeagent server (cloud) and agent (edge), real processes via the CLI."""

    def __init__(self, bench: Bench, scheme: str) -> None:
        self.bench = bench
        self.scheme = scheme
        offset = NA_OFFSET if scheme == "tls" else WSS_OFFSET
        tport = 8443 if scheme == "tls" else 8444
        path = "/tunnel" if scheme == "wss" else ""
        d = bench.tmp / scheme
        d.mkdir(exist_ok=True)
        self.dir = d
        self.url = f"{scheme}://{CLOUD}:{tport}{path}"
        self.server_cfg = {
            "server_id": f"bench-{scheme}", "tunnel": self.url,
            "tls": {"cert_file": str(bench.tmp / "server.crt"),
                    "key_file": str(bench.tmp / "server.key")},
            "tokens": [{"node": "edge-1", "token": TOKEN}],
            "tcp": [{"name": f"t{port}", "listen": f"{PUBLIC}:{port + offset}",
                     "node": "edge-1", "target": f"127.0.0.1:{port}"}
                    for port in (IPERF, ECHO, SINK, ECHO_CLOSE)],
            "http": [{"name": "web", "listen": f"{PUBLIC}:{HTTP + offset}", "routes": [
                {"host": "bench.test", "node": "edge-1", "target": f"127.0.0.1:{HTTP}"},
                # The server dials this one itself: the HTTP front's cost without a tunnel.
                {"host": "front.test", "target": f"{EDGE}:{HTTP}"}]}],
            "debug_socket": str(d / "server.sock"),
        }
        self.agent_cfg = {
            "node": "edge-1", "server": self.url, "token": TOKEN,
            "tls": {"ca_file": str(bench.tmp / "ca.crt")},
            "allow": [f"127.0.0.1:{p}" for p in (IPERF, HTTP, ECHO, SINK, ECHO_CLOSE)],
            "debug_socket": str(d / "agent.sock"),
            "reconnect": {"initial": 0.1, "maximum": 1.0},
        }
        self.offset = offset

    def _cmd(self, role: str, cfg: dict[str, Any]) -> list[str]:
        path = self.dir / f"{role}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        workers = self.bench.args.workers if role == "server" else 1
        return [sys.executable, "-m", "nodeagent", "--log-level", self.bench.args.log_level,
                role, "--config", str(path),
                *(["--workers", str(workers)] if workers > 1 else [])]

    def start(self) -> None:
        b = self.bench
        b.log(f"starting nodeagent server + agent ({self.scheme})")
        tree = str(b.args.tree or ROOT)
        env = {**os.environ, "PYTHONPATH": tree}
        self.server = b.spawn("cloud", self._cmd("server", self.server_cfg),
                              f"{self.scheme}-server", env=env, cwd=tree)
        b.wait_listening("cloud", HTTP + self.offset, PUBLIC)
        self.agent = b.spawn("edge", self._cmd("agent", self.agent_cfg),
                             f"{self.scheme}-agent", env=env, cwd=tree)
        # Workers: the agent's dials reach a worker at random, and one already held is
        # retried on a paced backoff (1 s growing), so allow longer.
        deadline = time.monotonic() + (20 if b.args.workers == 1 else 90)
        while time.monotonic() < deadline:
            for proc, name in ((self.server, "server"), (self.agent, "agent")):
                if proc.poll() is not None:
                    raise RuntimeError(f"nodeagent {name} exited: "
                                       f"{(b.tmp / f'{self.scheme}-{name}.log').read_text()}")
            with contextlib.suppress(Exception):
                # A tunnel to every worker (one, without --workers).
                tunnels = [t for t in self.agent_status()["tunnels"] if t["state"] == "open"]
                if len(tunnels) >= b.args.workers:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"agent did not hold {b.args.workers} tunnel(s) within 20s")

    def _status(self, sock: str) -> dict[str, Any]:
        import httpx
        with httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=5) as client:
            resp = client.get("http://debug/status")
            resp.raise_for_status()
            return resp.json()  # type: ignore[no-any-return]

    def server_status(self) -> dict[str, Any]:
        sock = Path(self.server_cfg["debug_socket"])
        if self.bench.args.workers > 1:  # worker 0's (server-w0.sock)
            sock = sock.with_name(f"{sock.stem}-w0{sock.suffix}")
        return self._status(str(sock))

    def server_pids(self) -> list[int]:
        """The server's processes: with --workers, the parent and its workers."""
        pids = [self.server.pid]
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{self.server.pid}/task").iterdir():
                pids += [int(p) for p in (task / "children").read_text().split()]
        return pids

    def agent_status(self) -> dict[str, Any]:
        return self._status(self.agent_cfg["debug_socket"])

    def rss(self) -> dict[str, int]:
        # With --workers: every server process together (the parent and each worker).
        return {"server": sum(rss_of(p) for p in self.server_pids()),
                "agent": rss_of(self.agent.pid)}

    def cpu(self) -> dict[str, float]:
        return {"server": sum(cpu_of(p) for p in self.server_pids()),
                "agent": cpu_of(self.agent.pid)}

    def stop(self) -> None:
        for proc in (getattr(self, "agent", None), getattr(self, "server", None)):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in (getattr(self, "agent", None), getattr(self, "server", None)):
            if proc is None:
                continue
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class CRelay:
    """The C prototype of the data path (scripts/bench/bulk_relay.c) as the server (cloud:
    the TCP mappings' and the HTTP front's public ports at target + C_OFFSET, the tunnel
    on CLOUD:8445) and the agent (edge), each one process; the same certificates as the
    nodeagent stack's."""

    TUNNEL = f"{CLOUD}:8445"

    def __init__(self, bench: Bench) -> None:
        self.bench = bench

    def start(self) -> None:
        from scripts.bench.bulk_parity import build_relay
        b = self.bench
        d = b.tmp / "crelay"
        d.mkdir(exist_ok=True)
        shutil.copy(b.tmp / "server.crt", d / "cert.pem")
        shutil.copy(b.tmp / "server.key", d / "key.pem")
        shutil.copy(b.tmp / "ca.crt", d / "ca.pem")
        relay = build_relay(d)
        b.log("starting the C relay's server + agent (the prototype)")
        maps = []
        for port in (ECHO, ECHO_CLOSE):
            maps += [f"{PUBLIC}:{port + C_OFFSET}", str(port)]
        maps += [f"{PUBLIC}:{HTTP + C_OFFSET}", f"http:bench.test={HTTP}"]
        self.server = b.spawn("cloud", [str(relay), "server", self.TUNNEL, str(d), *maps],
                              "crelay-server")
        b.wait_listening("cloud", 8445, CLOUD)
        self.agent = b.spawn("edge", [str(relay), "agent", self.TUNNEL, str(d)],
                             "crelay-agent")
        b.wait_listening("cloud", HTTP + C_OFFSET, PUBLIC)

    def cpu(self) -> dict[str, float]:
        return {"server": cpu_of(self.server.pid), "agent": cpu_of(self.agent.pid)}

    def stop(self) -> None:
        for proc in (self.agent, self.server):
            if proc.poll() is None:
                proc.terminate()
                proc.wait(5)


class CAgentStack(Stack):
    """nodeagent's server (cloud; public ports at target + C_AGENT_OFFSET, the tunnel on
    CLOUD:8446) with the C prototype as its agent (edge): the agent's side compiled, the
    server's as shipped."""

    def __init__(self, bench: Bench) -> None:
        super().__init__(bench, "tls")
        self.scheme = "cagent"
        self.offset = C_AGENT_OFFSET
        self.dir = bench.tmp / "cagent"
        self.dir.mkdir(exist_ok=True)
        self.url = f"tls://{CLOUD}:8446"
        cfg = self.server_cfg
        cfg.update(server_id="bench-cagent", tunnel=self.url,
                   debug_socket=str(self.dir / "server.sock"))
        for mapping in cfg["tcp"]:
            port = int(mapping["target"].rsplit(":", 1)[1])
            mapping["listen"] = f"{PUBLIC}:{port + C_AGENT_OFFSET}"
        cfg["http"] = [{"name": "web", "listen": f"{PUBLIC}:{HTTP + C_AGENT_OFFSET}",
                        "routes": [{"host": "bench.test", "node": "edge-1",
                                    "target": f"127.0.0.1:{HTTP}"}]}]

    def start(self) -> None:
        from scripts.bench.bulk_parity import build_relay
        b = self.bench
        shutil.copy(b.tmp / "ca.crt", self.dir / "ca.pem")
        relay = build_relay(self.dir)
        b.log("starting nodeagent server + the C prototype as its agent")
        tree = str(b.args.tree or ROOT)
        self.server = b.spawn("cloud", self._cmd("server", self.server_cfg), "cagent-server",
                              env={**os.environ, "PYTHONPATH": tree}, cwd=tree)
        b.wait_listening("cloud", HTTP + self.offset, PUBLIC)
        hello = json.dumps({"node": "edge-1", "token": TOKEN})
        self.agent = b.spawn("edge", [str(relay), "agent", f"{CLOUD}:8446", str(self.dir)],
                             "cagent-agent", env={**os.environ, "BULK_HELLO": hello})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.agent.poll() is not None:
                raise RuntimeError("the C agent exited: "
                                   f"{(b.tmp / 'cagent-agent.log').read_text()}")
            with contextlib.suppress(Exception):
                if any(a["node"] == "edge-1" for a in self.server_status()["agents"]):
                    return
            time.sleep(0.1)
        raise RuntimeError("the C agent did not connect within 20s")


# ---------------------------------------------------------------------- report


def fmt(x: float | None, unit: str = "", digits: int = 2) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}{unit}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def table(res: dict[str, Any]) -> str:
    try:
        return _table(res)
    except (KeyError, TypeError) as exc:  # a test failed half-way: show what there is
        return f"(table incomplete: {exc!r}; see the JSON)"


def _table(res: dict[str, Any]) -> str:
    rows: list[tuple[str, ...]] = [("metric", "direct", "nodeagent tls", "nodeagent wss",
                                    "ssh -R", "tls/direct", "tls/ssh")]

    def row(name: str, direct: float | None, tls: float | None, wss: float | None,
            ssh: float | None, unit: str = "", digits: int = 2) -> None:
        rows.append((name, fmt(direct, unit, digits), fmt(tls, unit, digits),
                     fmt(wss, unit, digits), fmt(ssh, unit, digits), ratio(tls, direct),
                     ratio(tls, ssh)))

    if "bulk" in res:
        for direction, label in (("up", "client→edge"), ("down", "edge→client")):
            b = res["bulk"][direction]
            row(f"1 stream {label} Gbit/s", b.get("direct_gbps"), b.get("tls_gbps"),
                b.get("wss_gbps"), b.get("ssh_gbps"))
        for direction in ("up", "down"):
            b = res["bulk"][direction]
            for key in ("tls", "wss"):
                cpu = b.get(f"{key}_cpu_s_per_gb")
                if cpu:
                    rows.append((f"  CPU s/GB {direction} {key} (server+agent)", "-",
                                 *(fmt(sum(cpu.values())) if key == k else "-"
                                   for k in ("tls", "wss")), "-", "-", "-"))
    if "parallel" in res:
        p = res["parallel"]
        row("8 streams aggregate Gbit/s", p.get("direct_gbps"), p.get("tls_gbps"), None,
            p.get("ssh_gbps"))
    if "http" in res:
        h = res["http"]
        g = lambda k, m: h.get(k, {}).get(m)  # noqa: E731
        row("HTTP 1 KiB GET req/s (16 conns)", g("direct", "req_per_sec"),
            g("tls", "req_per_sec"), None, g("ssh", "req_per_sec"), digits=0)
        cpu = g("tls", "cpu_us_per_req")
        if cpu:
            row("  CPU us/request server, agent", None, cpu.get("server"), None, None,
                digits=0)
            row("  ", None, cpu.get("agent"), None, None, digits=0)
        if "c_agent" in h:
            row("HTTP req/s, nodeagent server + C agent", None, g("c_agent", "req_per_sec"),
                None, g("ssh", "req_per_sec"), digits=0)
            row("  its p99 ms", None, g("c_agent", "p99_ms"), None, g("ssh", "p99_ms"))
            acpu = g("c_agent", "cpu_us_per_req")
            if acpu:
                row("  its CPU us/request server, C agent", None, acpu.get("server"), None,
                    None, digits=0)
                row("  ", None, acpu.get("agent"), None, None, digits=0)
        if "c" in h:
            row("HTTP req/s, C relay (prototype)", None, g("c", "req_per_sec"), None,
                g("ssh", "req_per_sec"), digits=0)
            row("  C relay p99 ms", None, g("c", "p99_ms"), None, g("ssh", "p99_ms"))
            ccpu = g("c", "cpu_us_per_req")
            if ccpu:
                row("  C relay CPU us/request server, agent", None, ccpu.get("server"),
                    None, None, digits=0)
                row("  ", None, ccpu.get("agent"), None, None, digits=0)
        row("HTTP p50 ms", g("direct", "p50_ms"), g("tls", "p50_ms"), None, g("ssh", "p50_ms"))
        row("HTTP p99 ms", g("direct", "p99_ms"), g("tls", "p99_ms"), None, g("ssh", "p99_ms"))
        row("HTTP added p50 vs direct ms", None, h.get("added_p50_ms"), None,
            (g("ssh", "p50_ms") - g("direct", "p50_ms")) if g("ssh", "p50_ms") else None)
    for key, label in (("connrate", "new conn/s (1 B echo, client closes)"),
                       ("connrate_close_first", "new conn/s (1 B echo, target closes)")):
        if key not in res:
            continue
        c = res[key]
        row(label, c["direct"]["per_sec"],
            c.get("tls", {}).get("per_sec"), None, c.get("ssh", {}).get("per_sec"), digits=0)
        cpu = c.get("tls", {}).get("cpu_us_per_conn")
        if cpu:
            row("  CPU us/conn server, agent", None, cpu.get("server"), None, None, digits=0)
            row("  ", None, cpu.get("agent"), None, None, digits=0)
        if "c_agent" in c:
            row("  nodeagent server + C agent", None, c["c_agent"]["per_sec"], None,
                c.get("ssh", {}).get("per_sec"), digits=0)
            acpu = c["c_agent"].get("cpu_us_per_conn")
            if acpu:
                row("  its CPU us/conn server, C agent", None, acpu.get("server"), None,
                    None, digits=0)
                row("  ", None, acpu.get("agent"), None, None, digits=0)
        if "c" in c:
            row("  C relay (prototype)", None, c["c"]["per_sec"], None,
                c.get("ssh", {}).get("per_sec"), digits=0)
            ccpu = c["c"].get("cpu_us_per_conn")
            if ccpu:
                row("  C relay CPU us/conn server, agent", None, ccpu.get("server"), None,
                    None, digits=0)
                row("  ", None, ccpu.get("agent"), None, None, digits=0)
    if "fairness" in res:
        f = res["fairness"]
        for key, label in (("alone", "50 rr streams p99 ms, alone"),
                           ("with_bulk", "50 rr streams p99 ms, + 1 bulk")):
            row(label, None, f["tls"][key]["p99_us"] / 1000, None,
                f["ssh"][key]["p99_us"] / 1000 if "ssh" in f else None)
        row("fairness p99 ratio (with/without bulk)", None, f["tls"]["p99_ratio"], None,
            f.get("ssh", {}).get("p99_ratio"))
    if "idle" in res:
        i = res["idle"]["tls"]
        s = res["idle"].get("ssh", {})
        for role in ("server", "agent"):
            row(f"RSS MiB at start: {role}", None, i["rss_base_mib"][role], None,
                s.get("rss_base_mib", {}).get(role), digits=1)
        row("RSS MiB at 1k idle conns: server", None, i["rss_1k_mib"]["server"], None,
            s.get("rss_1k_mib", {}).get("server"), digits=1)
        row("RSS MiB at 1k idle conns: agent", None, i["rss_1k_mib"]["agent"], None,
            s.get("rss_1k_mib", {}).get("agent"), digits=1)
        row(f"RSS MiB at {i['streams']:,} idle: server", None, i["rss_n_mib"]["server"], None,
            None, digits=1)
        row(f"RSS MiB at {i['streams']:,} idle: agent", None, i["rss_n_mib"]["agent"], None,
            None, digits=1)
        row("bytes per idle stream: server", None, i["bytes_per_stream"]["server"], None,
            None, digits=0)
        row("bytes per idle stream: agent", None, i["bytes_per_stream"]["agent"], None,
            None, digits=0)
        row(f"seconds to open {i['streams']:,} streams", None, i["open_seconds_n"], None,
            None)
    if "stall" in res:
        s = res["stall"]
        row("bulk Gbit/s alone", None, s["bulk_alone_gbps"], None, None)
        row("bulk Gbit/s beside a stalled reader", None, s["bulk_beside_stalled_gbps"], None,
            None)
        row("RSS MiB with stalled stream: server", None, s["rss_during_mib"]["server"], None,
            None, digits=1)
        row("RSS MiB with stalled stream: agent", None, s["rss_during_mib"]["agent"], None,
            None, digits=1)
        row("MiB the stalled writer got in", None, s["stalled_stream_bytes_accepted"] / 2**20,
            None, None, digits=1)
    return _render(rows)


def _render(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for n, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(r, widths, strict=True))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def targets(res: dict[str, Any]) -> list[str]:
    lines = []

    def check(ok: bool, text: str) -> None:
        lines.append(f"  [{'met' if ok else 'MISSED'}] {text}")

    if "bulk" in res:
        for direction in ("up", "down"):
            row = res["bulk"][direction]
            if row.get("ssh_gbps"):
                ratio = row["tls_gbps"] / row["ssh_gbps"]
                check(ratio >= 1, f"single stream {direction} >= ssh -R: "
                      f"{row['tls_gbps']:.2f} vs {row['ssh_gbps']:.2f} Gbit/s ({ratio:.2f}x)")
    if "http" in res:
        h, ssh = res["http"]["tls"], res["http"].get("ssh")
        if ssh:
            ratio = h["req_per_sec"] / ssh["req_per_sec"]
            check(ratio >= 2 and h["p99_ms"] <= 5,
                  f"HTTP >= 2x ssh -R req/s with p99 <= 5 ms: {h['req_per_sec']:,.0f} vs "
                  f"{ssh['req_per_sec']:,.0f} req/s ({ratio:.2f}x), p99 {h['p99_ms']:.2f} ms")
    for key, label in (("connrate", "client closes"),
                       ("connrate_close_first", "target closes first")):
        if key not in res:
            continue
        c, ssh = res[key]["tls"], res[key].get("ssh")
        if ssh:
            ratio = c["per_sec"] / ssh["per_sec"]
            check(ratio >= 1, f"new conn/s ({label}) >= ssh -R: {c['per_sec']:,.0f} vs "
                  f"{ssh['per_sec']:,.0f} ({ratio:.2f}x)")
    if "fairness" in res:
        f = res["fairness"]["tls"]["p99_ratio"]
        check(f <= 2, f"fairness p99 within 2x: {f:.2f}x")
    if "idle" in res:
        i = res["idle"]["tls"]
        worst = max(i["rss_1k_mib"].values())
        check(worst <= 40, f"<= 40 MiB per process at 1,000 idle: {worst:.1f} MiB")
        per = max(i["bytes_per_stream"].values())
        check(per <= 4096, f"<= 4 KiB per idle stream: {per:,.0f} B")
    if "stall" in res:
        s = res["stall"]
        check(s["ratio"] >= 0.8, f"other streams keep throughput beside a stalled reader: "
              f"{s['ratio']:.2f}x")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.tunnel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short durations (smoke run)")
    parser.add_argument("--only", action="append", choices=TESTS, metavar="NAME",
                        help=f"run only this test (repeatable): {', '.join(TESTS)}")
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "bench.json")
    parser.add_argument("--profile", action="store_true",
                        help="py-spy record server and agent during each nodeagent run")
    parser.add_argument("--rounds", type=int, default=None, metavar="N",
                        help="run the selected tests N times (default 3, 1 with --quick); "
                             "the report gives each headline ratio's median and min-max")
    parser.add_argument("--ssh-cipher", default="aes256-gcm@openssh.com",
                        help="the cipher ssh -R is pinned to (default: the AES-256-GCM the "
                             "tunnel's TLS 1.3 negotiates)")
    parser.add_argument("--no-ssh", action="store_true", help="skip the ssh -R comparison")
    parser.add_argument("--no-wss", action="store_true", help="skip the WebSocket transport")
    parser.add_argument("--log-level", default="warning",
                        choices=["debug", "info", "warning", "error"])
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="run the nodeagent server with --workers N (RSS and CPU: all "
                             "its processes together)")
    parser.add_argument("--c-relay", action="store_true",
                        help="also run the C prototype (scripts/bench/bulk_relay.c) in the "
                             "connrate and http tests, between nodeagent and ssh -R")
    parser.add_argument("--c-agent", action="store_true",
                        help="also run nodeagent's server with the C prototype as its agent "
                             "in the connrate and http tests")
    parser.add_argument("--tree", type=Path, default=None,
                        help="run nodeagent from this source tree (A/B comparisons)")
    args = parser.parse_args()
    if (why := netns_available()) is not None:
        print(f"bench: {why}", file=sys.stderr)
        return 2
    if missing := missing_commands():
        print("bench: missing " + ", ".join(missing), file=sys.stderr)
        return 2
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, want), max(hard, want)))
    selected = [t for t in TESTS if not args.only or t in args.only]
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.c_agent and args.workers > 1:
        parser.error("--c-agent: the C agent holds one tunnel; run it without --workers")

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    # Also when started from a shell that ignores SIGINT for background jobs.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    status = 0
    started = time.time()
    rounds: list[dict[str, Any]] = []
    try:
        bench.setup()
        # Every round runs each selected test, and each test alternates direct, nodeagent
        # and ssh -R: a slow spell of the machine lands on every scenario of one round
        # rather than on one scenario of the run.
        for n in range(args.rounds):
            bench.log(f"round {n + 1} of {args.rounds} (load average "
                      f"{os.getloadavg()[0]:.1f})")
            loadavg = os.getloadavg()
            for name in selected:
                getattr(bench, f"test_{name}")()
            done = {k: bench.results.pop(k) for k in list(bench.results) if k != "env"}
            done["loadavg_at_start"] = loadavg
            rounds.append(done)
            if args.rounds > 1:
                print(f"\nround {n + 1}:\n{table(done)}\n", flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        status = 130
    except Exception as exc:
        import traceback
        traceback.print_exc()
        print(f"bench failed: {exc}; logs in {bench.tmp}", file=sys.stderr)
        bench.args.keep = True
        status = 1
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            bench.close()
    res = bench.results
    res["rounds"] = rounds
    res["summary"] = summarize(rounds)
    res["meta"] = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "seconds": round(time.time() - started, 1), "quick": args.quick,
        "tests": selected, "rounds": args.rounds, "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(), "duration_per_measurement": bench.dur,
        "tree": str(args.tree or ROOT), "workers": args.workers,
        "loadavg_at_end": os.getloadavg(),
        "uncommitted_tunnel_changes": subprocess.run(
            ["git", "-C", str(ROOT), "status", "--short", "tunnel"], capture_output=True,
            text=True).stdout.split("\n")[:-1],
        "git": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip(),
    }
    args.out.write_text(json.dumps(res, indent=2) + "\n")
    print()
    if len(rounds) == 1:
        print(table(rounds[0]))
        print()
        print("targets (the performance issue; ratios need the ssh -R run):")
        try:
            print("\n".join(targets(rounds[0])) or "  (none measured)")
        except (KeyError, TypeError) as exc:
            print(f"  (incomplete: {exc!r})")
    if res["summary"]:
        print(f"\nover {len(rounds)} round(s): median, min-max (the machine's load average "
              f"at the end: {os.getloadavg()[0]:.1f})")
        print(summary_table(res["summary"]))
    print(f"\nJSON: {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
