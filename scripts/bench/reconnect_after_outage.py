"""How long a node needs to be back once its server is reachable again, by outage length.

Runs a real `nodeagent server` and `nodeagent agent` (TLS, the agent's default reconnect
policy), kills the server, keeps it down for the outage, starts it again, and reads from
the new server's log the time from its tunnel listener being up ("listening") to the agent
registering ("agent connected"). Repeats, and prints median / p95 / max per outage, next to
the same figures with the previous policy (one backoff growing to 15 s for every failure:
`reconnect.unreachable_maximum: 15`) and their ratio.

From the repository root:

    sudo .venv/bin/python -m scripts.bench.reconnect_after_outage        # 5 and 20 s, 5 runs
    sudo .venv/bin/python -m scripts.bench.reconnect_after_outage --outages 1 5 20 --runs 10
    sudo .venv/bin/python -m scripts.bench.reconnect_after_outage --no-compare  # new policy

Root: the agent sets SO_MARK on its tunnel socket.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import Certs, Upstream, agent_config, server_config
from nodeagent.trust import pki

POLICIES: dict[str, dict[str, Any]] = {
    "now": {},  # the defaults
    "before": {"unreachable_maximum": 15.0},  # one schedule to 15 s, as before
}


def stamp(line: str) -> float:
    return datetime.strptime(line.split()[0], "%Y-%m-%dT%H:%M:%S.%fZ").timestamp()


def first_line(proc: NodeagentProcess, text: str, timeout: float = 60.0) -> str:
    proc.wait_for_log(text, timeout)
    return next(line for line in proc.logs().splitlines() if text in line)


def one_run(tmp: Path, certs: Certs, outage: float, reconnect: dict[str, Any]) -> float:
    scfg = server_config(tmp, certs, Upstream(1, 2))
    server = NodeagentProcess("server", scfg, tmp, "server").start()
    agent = NodeagentProcess("agent", agent_config(tmp, certs, Upstream(1, 2), scfg["tunnel"],
                                                   reconnect=reconnect), tmp, "agent")
    back = NodeagentProcess("server", scfg, tmp, "server-back")
    try:
        server.wait_ready()
        agent.start().wait_ready()
        first_line(server, "agent connected")
        server.kill()
        time.sleep(outage)
        back.start()
        listening = stamp(first_line(back, "tunnel.accept listening"))
        connected = stamp(first_line(back, "agent connected"))
        return connected - listening
    finally:
        for proc in (server, agent, back):
            proc.kill()
        for proc in (server, agent, back):
            proc.log_path.unlink(missing_ok=True)


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return (f"median {statistics.median(ordered):5.2f} s  p95 {p95:5.2f} s  "
            f"max {ordered[-1]:5.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.reconnect_after_outage",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--outages", type=float, nargs="+", default=[5.0, 20.0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--no-compare", action="store_true",
                        help="only the current policy")
    args = parser.parse_args()
    policies = ["now"] if args.no_compare else ["now", "before"]
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        ca = pki.create_ca("bench-ca")
        ca.write(tmp / "ca.crt", tmp / "ca.key")
        cert = pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"])
        cert.write(tmp / "server.crt", tmp / "server.key")
        certs = Certs(tmp / "ca.crt", tmp / "server.crt", tmp / "server.key",
                      tmp / "server.crt", tmp / "server.key")
        results: dict[tuple[str, float], list[float]] = {}
        for outage in args.outages:
            for policy in policies:
                for run in range(args.runs):
                    value = one_run(tmp, certs, outage, POLICIES[policy])
                    results.setdefault((policy, outage), []).append(value)
                    print(f"  outage {outage:g}s policy {policy:6} run {run + 1}: "
                          f"{value:.2f} s", flush=True)
        print("\nback after the server is reachable again (listener up -> agent registered)")
        for outage in args.outages:
            now = results[("now", outage)]
            print(f"outage {outage:4g} s  now:    {summary(now)}")
            if "before" in policies:
                before = results[("before", outage)]
                ratio = statistics.median(before) / max(statistics.median(now), 1e-3)
                print(f"               before: {summary(before)}   "
                      f"(median {ratio:.1f}x slower)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
