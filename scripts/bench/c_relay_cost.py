"""Where the C relay's CPU goes, per connection and per request, on loopback.

`scripts/bench/bulk_relay.c` (the measuring-only prototype of a compiled data path; see
docs/performance.md, "A compiled connection and request path, measured") as a server and
an agent process on 127.0.0.1, with benchtool's `connwait` against its `echoclose` (a
TCP mapping's connections, the target closing first; `--client-closes`: `connrate`
against `echo`) or wrk's 16 keep-alive connections of 1 KiB GETs against nginx through
the relay's HTTP front (`--http`). Per round, each side's CPU per unit from /proc, user
and system apart; with `--syscalls`, the system calls per unit of each side by name
(strace -c attached for one round, which slows it: its rate is not a figure); with
`--instructions`, each side's user-space instructions per unit under callgrind.

    .venv/bin/python -m scripts.bench.c_relay_cost                     # connections, 3 rounds
    .venv/bin/python -m scripts.bench.c_relay_cost --http
    .venv/bin/python -m scripts.bench.c_relay_cost --syscalls --rounds 1
    .venv/bin/python -m scripts.bench.c_relay_cost --instructions --rounds 1 --seconds 10

Needs gcc, libssl-dev, libhttp-parser-dev (and nginx and wrk for --http, strace,
valgrind). Prints one JSON object: per side and metric the median [min, max] over the
rounds, the load average per round.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench.bulk_parity import _wait_listening, build_relay
from scripts.bench.lib.tools import build_benchtool, parse_wrk, write_nginx_conf
from scripts.bench.splice_bulk import _certs, _cpu_parts, _free_port


def _strace_counts(path: Path) -> dict[str, int]:
    """Calls per system call name from an `strace -c` summary."""
    counts = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", line)
        if m and m.group(2) != "total":
            counts[m.group(2)] = int(m.group(1))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.c_relay_cost",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--http", action="store_true",
                        help="HTTP via the relay's Host router (wrk, nginx) instead")
    parser.add_argument("--client-closes", action="store_true",
                        help="connections: the client closes first (connrate, echo)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="per round (4)")
    parser.add_argument("--syscalls", action="store_true", help="strace -c each side")
    parser.add_argument("--instructions", action="store_true",
                        help="each side under callgrind: user-space instructions per unit")
    args = parser.parse_args()
    if args.syscalls and args.instructions:
        parser.error("one of --syscalls and --instructions")
    loads: list[float] = []
    rounds: list[dict[str, float]] = []
    calls: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "certs").mkdir()
        _certs(tmp / "certs")
        relay = build_relay(tmp)
        tool = build_benchtool(Path(tempfile.gettempdir()) / "nodeagent-benchtool")
        procs: list[subprocess.Popen[str]] = []
        try:
            target = _free_port()
            if args.http:
                (tmp / "nginx").mkdir()
                procs.append(subprocess.Popen(write_nginx_conf(tmp / "nginx", target),
                                              stdout=subprocess.DEVNULL, text=True))
                route = f"http:bench.test={target}"
            else:
                kind = "echo" if args.client_closes else "echoclose"
                procs.append(subprocess.Popen([str(tool), kind, str(target)],
                                              stdout=subprocess.DEVNULL, text=True))
                route = str(target)
            _wait_listening(target)
            tunnel, listen = _free_port(), _free_port()
            grind = (["valgrind", "--tool=callgrind", "--collect-atstart=yes",
                      f"--callgrind-out-file={tmp}/callgrind.%p"] if args.instructions
                     else [])
            server = subprocess.Popen([*grind, str(relay), "server", str(tunnel),
                                       str(tmp / "certs"), str(listen), route],
                                      stdout=subprocess.PIPE, text=True)
            procs.append(server)
            assert server.stdout is not None
            assert server.stdout.readline().strip() == "listening"
            agent = subprocess.Popen([*grind, str(relay), "agent", str(tunnel),
                                      str(tmp / "certs")], stdout=subprocess.PIPE, text=True)
            procs.append(agent)
            assert agent.stdout is not None
            assert agent.stdout.readline().strip() == "ready"
            assert server.stdout.readline().strip() == "ready"
            sides = {"server": server.pid, "agent": agent.pid}
            for n in range(args.rounds):
                loads.append(os.getloadavg()[0])
                if args.instructions:
                    for pid in sides.values():
                        subprocess.run(["callgrind_control", "-z", str(pid)], check=True,
                                       capture_output=True)
                tracers = {}
                if args.syscalls:
                    for side, pid in sides.items():
                        tracers[side] = subprocess.Popen(
                            ["strace", "-c", "-p", str(pid), "-o", str(tmp / f"{side}.st")],
                            stderr=subprocess.DEVNULL)
                    time.sleep(0.5)
                before = {side: _cpu_parts(pid) for side, pid in sides.items()}
                if args.http:
                    out = subprocess.run(
                        ["wrk", "-t2", "-c16", f"-d{args.seconds:g}s", "--latency",
                         "-H", "Host: bench.test", f"http://127.0.0.1:{listen}/1k"],
                        capture_output=True, text=True, check=True).stdout
                    wrk = parse_wrk(out)
                    units = wrk["req_per_sec"] * args.seconds
                    row = {"per_sec": wrk["req_per_sec"], "p99_ms": wrk["p99_ms"]}
                else:
                    mode = "connrate" if args.client_closes else "connwait"
                    out = subprocess.run([str(tool), mode, "127.0.0.1", str(listen),
                                          str(args.seconds), "16"],
                                         capture_output=True, text=True, check=True).stdout
                    got = json.loads(out)
                    units = float(got["count"])
                    row = {"per_sec": got["per_sec"]}
                after = {side: _cpu_parts(pid) for side, pid in sides.items()}
                for side in sides:
                    row[f"{side}_user_us"] = (after[side][0] - before[side][0]) / units * 1e6
                    row[f"{side}_sys_us"] = (after[side][1] - before[side][1]) / units * 1e6
                if args.syscalls:
                    time.sleep(0.3)
                    for side, tracer in tracers.items():
                        tracer.send_signal(2)
                        tracer.wait(10)
                        counts = _strace_counts(tmp / f"{side}.st")
                        calls[side] = {k: round(v / units, 2) for k, v in sorted(
                            counts.items(), key=lambda kv: -kv[1])}
                        calls[side]["total"] = round(sum(counts.values()) / units, 2)
                if args.instructions:
                    for side, pid in sides.items():
                        before_dumps = set(tmp.glob(f"callgrind.{pid}*"))
                        subprocess.run(["callgrind_control", "-d", str(pid)], check=True,
                                       capture_output=True)
                        (dump,) = set(tmp.glob(f"callgrind.{pid}*")) - before_dumps
                        total = next(int(ln.split()[1]) for ln in dump.read_text().splitlines()
                                     if ln.startswith(("summary:", "totals:")))
                        row[f"{side}_instructions"] = total / units
                rounds.append(row)
                print(f"round {n + 1}: " + " ".join(f"{k}={v:,.1f}" for k, v in row.items()),
                      file=sys.stderr, flush=True)
        finally:
            for proc in procs:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                if proc.stdout is not None:
                    proc.stdout.close()
    summary: dict[str, object] = {
        "unit": "request" if args.http else "connection",
        "rounds": args.rounds, "load_average_per_round": loads,
        "median_min_max": {k: [round(statistics.median(v), 2), round(min(v), 2),
                               round(max(v), 2)]
                           for k in rounds[0] for v in [[r[k] for r in rounds]]}}
    if calls:
        summary["syscalls_per_unit"] = calls
    print(json.dumps(summary))


if __name__ == "__main__":
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        sys.exit("c_relay_cost needs a C compiler, libssl-dev and libhttp-parser-dev")
    main()
