"""What a server and an agent hold at start, and what each import costs.

Two parts, from the repository root:

1. the running processes: a server and an agent from files, as
   `scripts.bench.memory_after_load` starts them (TLS tunnel, a TCP mapping, an HTTP
   route), connected and settled; from /proc/PID/smaps_rollup: RSS (what the issue's
   ≤ 40 MiB goal and `memory_after_load` read), PSS, USS (private pages: what the process
   alone holds), and RSS split into anonymous and file-backed pages (shared libraries'
   code: counted in every process's RSS, but one copy in memory however many processes
   map it), and the largest file mappings;
2. a fresh interpreter importing, in the order a role does, the groups below: RSS and
   anonymous pages after each, so each group's cost is the step it adds.

The tree's bytecode is written first, as installing nodeagent does.

    .venv/bin/python -m scripts.bench.startup_memory
    .venv/bin/python -m scripts.bench.startup_memory --tree /tmp/before  # another checkout

About 20 seconds. Figures: docs/performance.md ("Memory at 1,000 idle connections").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import Upstream, agent_config, make_certs, server_config
from scripts.bench.lib.procmem import compile_bytecode, smaps
from scripts.bench.memory_after_load import echo_target, http_upstream

# (label, statements) in the order a role imports them; each step's cost is its delta.
STEPS: dict[str, list[tuple[str, str]]] = {
    "common": [
        ("ssl (OpenSSL)", "import ssl"),
        ("trio (and attrs, idna, sortedcontainers...)", "import trio"),
        ("pydantic (pydantic-core, its stdlib)", "import pydantic, pydantic.main"),
        ("pydantic: a first model (schema machinery)",
         "import pydantic\nclass First(pydantic.BaseModel):\n    x: int = 0"),
        ("netfilter.model", "import netfilter.model"),
        ("nodeagent.config (the models)", "import nodeagent.config"),
        ("prometheus_client", "import prometheus_client"),
        ("yaml (config files)", "import yaml"),
        ("h11", "import h11"),
        ("argparse", "import argparse"),
        ("nodeagent.cli", "import nodeagent.cli"),
    ],
    "server": [
        ("httptools", "import httptools"),
        ("nodeagent.server.main (the rest)", "import nodeagent.server.main"),
        # Not at start: the front loads HTTP/2 on its first h2 connection or h2c backend.
        ("HTTP/2 on first use (h2, hpack, hyperframe)",
         "import nodeagent.http.h2connection"),
    ],
    "agent": [
        ("nodeagent.agent.main (the rest)", "import nodeagent.agent.main"),
    ],
}

_STEP_SCRIPT = """
import json, sys
def mem():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon"):
                out[key] = int(value.split()[0]) / 1024
    return out
rows = [("python", mem())]
for label, code in json.loads(sys.argv[1]):
    exec(code)
    rows.append((label, mem()))
rows.append((f"{len(sys.modules)} modules", mem()))
print(json.dumps(rows))
"""


def running(tree: Path | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, http_upstream() as http_target, \
            echo_target(Path(tmp)) as echo:
        work = Path(tmp)
        certs = make_certs(work)
        upstream = Upstream(http_port=http_target, echo_port=echo)
        scfg = server_config(work, certs, upstream)
        scfg["keepalive"] = {"interval": 15, "timeout": 10}
        acfg = agent_config(work, certs, upstream, scfg["tunnel"])
        acfg["keepalive"] = {"interval": 15, "timeout": 10}
        procs = {"server": NodeagentProcess("server", scfg, work, "server",
                                            log_level="warning"),
                 "agent": NodeagentProcess("agent", acfg, work, "agent",
                                           log_level="warning")}
        try:
            procs["server"].start().wait_ready()
            procs["agent"].start().wait_ready()
            procs["server"].wait_for(
                lambda s: any(a["node"] == "edge-1" for a in s["agents"]),
                what="edge-1 connected")
            time.sleep(2.0)
            return {name: smaps(proc.proc.pid) for name, proc in procs.items()
                    if proc.proc is not None}
        finally:
            for proc in procs.values():
                try:
                    proc.stop()
                except AssertionError as exc:
                    print(f"{proc.name} did not stop on SIGTERM: {str(exc)[:200]}")


def steps(role: str, cwd: Path) -> list[tuple[str, dict[str, float]]]:
    plan = STEPS["common"] + STEPS[role]
    out = subprocess.run([sys.executable, "-c", _STEP_SCRIPT, json.dumps(plan)],
                         check=True, capture_output=True, text=True, cwd=cwd,
                         env={**os.environ, "PYTHONPATH": str(cwd)}).stdout
    return [(label, mem) for label, mem in json.loads(out)]


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.startup_memory",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=None,
                        help="measure this checkout's code instead (a before/after)")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = parser.parse_args()
    tree = (args.tree or Path.cwd()).resolve()
    compile_bytecode(tree)
    if args.tree is not None:
        # The processes run the other checkout's code, first on their path.
        os.environ["PYTHONPATH"] = str(tree)
        os.chdir(tempfile.gettempdir())
    result: dict[str, Any] = {"running": running(args.tree), "steps": {}}
    for name, m in result["running"].items():
        files = ", ".join(f"{f} {v:.1f}" for f, v in m["files"].items())
        print(f"{name}: RSS {m['rss']:.1f} MiB (anonymous {m['anon']:.1f}, file-backed "
              f"{m['file']:.1f}), PSS {m['pss']:.1f}, USS {m['uss']:.1f}\n"
              f"  largest files in RSS, MiB: {files}")
    for role in ("server", "agent"):
        rows = steps(role, tree)
        result["steps"][role] = rows
        print(f"\n{role}: a fresh interpreter, RSS after each step (MiB)")
        previous = rows[0][1]
        for label, mem in rows:
            print(f"  {label:48s} {mem['VmRSS']:6.1f}  +{mem['VmRSS'] - previous['VmRSS']:5.1f}"
                  f"  (anonymous +{mem['RssAnon'] - previous['RssAnon']:4.1f})")
            previous = mem
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
