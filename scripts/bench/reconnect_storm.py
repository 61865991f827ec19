"""N agents hitting one restarted server at once: does admission control keep it up?

Starts a real `nodeagent server` process (TLS, a token for node "*"), then N in-process
`TunnelClient`s in this process dial it all at once, as a fleet does when its server comes
back. Prints the time until all are connected, the handshakes/s admitted, the refusals
(OVERLOADED with a retry-after, honoured with jitter), and the server's CPU seconds and
peak RSS. Run it twice to see what admission buys: with the default rate, and with
`--rate 100000` (admission off in effect).

From the repository root:

    .venv/bin/python -m scripts.bench.reconnect_storm                  # 1,000 agents
    .venv/bin/python -m scripts.bench.reconnect_storm -n 5000
    .venv/bin/python -m scripts.bench.reconnect_storm -n 1000 --rate 100000

The load generator is one Python process: on a small machine it competes with the server
for CPU, so the figures are a floor for the server. It keeps at most `--in-flight` dials
(TCP + TLS + HELLO) going at once: thousands at once starve its own event loop, so that
their TLS handshakes outlive the server's 10 s handshake timeout, over and over (each
real agent has a CPU of its own). That still offers the server far more handshakes per
second than it admits.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import ssl
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

import tunnel.client
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import free_port
from nodeagent.trust import pki
from tunnel import protocol as p
from tunnel.client import TunnelClient
from tunnel.endpoint import EndpointSettings
from tunnel.urls import parse_endpoint

TOKEN = "storm-token-0123456789abcdef"


def proc_stats(pid: int) -> tuple[float, int]:
    """(CPU seconds, peak RSS in KiB) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1])
    return cpu, hwm


async def storm(url: str, ctx: ssl.SSLContext, n: int, limit: float,
                in_flight: int) -> tuple[float, int]:
    """Start n clients at once; seconds until all are connected, and how many are not."""
    gate = trio.Semaphore(in_flight)
    real_dial = tunnel.client.dial

    async def gated_dial(*args: Any, **kwargs: Any) -> Any:
        async with gate:
            return await real_dial(*args, **kwargs)

    tunnel.client.dial = gated_dial  # type: ignore[assignment]
    clients = [TunnelClient(parse_endpoint(url),
                            hello=lambda i=i: p.Hello(identity={"node": f"edge-{i}",
                                                                "token": TOKEN}),
                            handler=None, ssl_context=ctx, server_hostname="localhost",
                            # No keepalive: with thousands of clients in one process a
                            # PING answer may wait for the loop longer than a timeout.
                            settings=EndpointSettings(ping_interval=0), connect_timeout=30)
               for i in range(n)]
    async with trio.open_nursery() as nursery:
        started = trio.current_time()
        for c in clients:
            nursery.start_soon(c.run)
        with trio.move_on_after(limit):
            for c in clients:
                await c.wait_connected()
        took = trio.current_time() - started
        missing = sum(1 for c in clients if c.connection is None)
        nursery.cancel_scope.cancel()
    return took, missing


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.reconnect_storm",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=1000, help="agents (default 1000)")
    parser.add_argument("--rate", type=float, default=None,
                        help="server tunnel.handshake_rate (default: the server's default)")
    parser.add_argument("--burst", type=int, default=None, help="tunnel.handshake_burst")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--in-flight", type=int, default=100,
                        help="dials the generator runs at once (default 100)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # N clients' "connect failed" lines: no
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * args.n + 512
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ca = pki.create_ca("storm-ca")
        ca.write(d / "ca.crt", d / "ca.key")
        cert = pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"])
        cert.write(d / "server.crt", d / "server.key")
        url = f"tls://127.0.0.1:{free_port()}"
        tunnel: dict[str, object] = {"url": url}
        if args.rate is not None:
            tunnel["handshake_rate"] = args.rate
        if args.burst is not None:
            tunnel["handshake_burst"] = args.burst
        config = {"server_id": "storm", "tunnel": tunnel,
                  "tls": {"cert_file": str(d / "server.crt"), "key_file": str(d / "server.key")},
                  "tokens": [{"node": "*", "token": TOKEN}],
                  # The load generator is one busy process: the server must not take a
                  # late PING answer from it for a dead agent.
                  "keepalive": {"interval": 120, "timeout": 120},
                  "debug_socket": str(d / "server.sock")}
        server = NodeagentProcess("server", config, d, "server", extra_args=[])
        server.start()
        try:
            server.wait_ready()
            assert server.proc is not None
            cpu0, _ = proc_stats(server.proc.pid)
            ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))
            wall0 = time.monotonic()
            took, missing = trio.run(storm, url, ctx, args.n, args.timeout, args.in_flight)
            cpu1, hwm = proc_stats(server.proc.pid)
            status = server.status(timeout=30)
            wall = time.monotonic() - wall0
        finally:
            server.kill()
        refusals = status.get("handshake_refusals", {}).get("overloaded", 0)
        rate = args.rate if args.rate is not None else "default"
        print(f"agents                {args.n}")
        print(f"handshake_rate        {rate}")
        print(f"all connected in      {took:.2f} s" + (f"  ({missing} NOT connected)"
                                                       if missing else ""))
        print(f"admitted handshakes/s {args.n / took:.0f}")
        print(f"refusals (overloaded) {refusals}  ({refusals / args.n:.2f} per agent)")
        print(f"server CPU            {cpu1 - cpu0:.2f} s over {wall:.2f} s wall "
              f"({(cpu1 - cpu0) / took:.0%} of a core while connecting)")
        print(f"server peak RSS       {hwm / 1024:.0f} MiB")
        print(f"handshake failures    {status.get('handshake_failures')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
