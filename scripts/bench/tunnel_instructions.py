"""The tunnel endpoints' cost in machine instructions, this tree against another.

`tunnel_cpu` measures CPU time, which on a small shared machine moves by a quarter from
one run to the next (other processes evict the caches a memory-bound copy path lives
in). Instruction counts do not move: this runs `tunnel_cpu` under valgrind's callgrind
(the machine has no hardware counters for `perf stat`), once per phase and once with
every phase at its minimum, and reports each phase's instructions with the start-up
(interpreter, imports, handshake) subtracted. What is left varies by a few per cent (how
the writer batches frames depends on scheduling), so the two trees run in interleaved
rounds and the median ratio is reported with its spread:

    .venv/bin/python -m scripts.bench.tunnel_instructions --tree /path/to/other/checkout
    .venv/bin/python -m scripts.bench.tunnel_instructions --tree ... --relays 200
    .venv/bin/python -m scripts.bench.tunnel_instructions --tree ... --egress 200

`--tree` is a checkout whose `tunnel` package is compared with this one's (for example a
`git worktree add /tmp/before COMMIT`); with `--egress` (streams an agent opens that a
real nodeagent server dials: the intercepted path's server side) its `nodeagent` too.
Prints one JSON object per phase: the median instructions per unit of work for each
tree, and the median, min and max of the rounds' ratios (this tree / the other).
Callgrind runs the interpreter ~80x slower; the defaults take about ten minutes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from scripts.bench.lib.tools import callgrind_instructions

ROOT = Path(__file__).resolve().parents[2]

# phase name -> (tunnel_cpu arguments, how many units of work the phase does)
MINIMUM = ["--mib", "1", "--rr", "1", "--opens", "1", "--parallel", "1"]


def phases(mib: int, rr: int, opens: int, relays: int = 0, egress: int = 0,
           ) -> dict[str, tuple[list[str], int, str]]:
    if egress:  # as relays: the echo target's and the server's start-up subtracted
        return {"open_egress_close": ([*MINIMUM, "--egress", str(egress)], egress - 1,
                                      "instructions_per_egress_stream")}
    if relays:  # only this phase: it needs the echo target's start-up subtracted too
        return {"open_relay_close": ([*MINIMUM, "--relays", str(relays)], relays - 1,
                                     "instructions_per_relayed_stream")}
    return {
        "bulk": (["--mib", str(mib), "--rr", "1", "--opens", "1", "--parallel", "1"],
                 (mib - 1) * 2**20, "instructions_per_byte"),
        "request_response": (["--mib", "1", "--rr", str(rr), "--opens", "1", "--parallel", "1"],
                             2 * (rr - 1), "instructions_per_request"),
        "open_echo_close": (["--mib", "1", "--rr", "1", "--opens", str(opens), "--parallel", "1"],
                            opens - 1, "instructions_per_stream"),
    }


def instructions(tree: Path, args: list[str], packages: tuple[str, ...] = ("tunnel",)) -> int:
    """Instructions callgrind counted for one tunnel_cpu run with `tree`'s `packages`."""
    return callgrind_instructions(tree, "scripts.bench.tunnel_cpu", args, packages)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.tunnel_instructions",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, required=True,
                        help="the other checkout (its tunnel/ is imported instead of this one's)")
    parser.add_argument("--mib", type=int, default=32, help="bulk phase size")
    parser.add_argument("--rr", type=int, default=1000, help="request/response round trips")
    parser.add_argument("--opens", type=int, default=300, help="streams opened, echoed, closed")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per phase")
    parser.add_argument("--relays", type=int, default=0,
                        help="instead of the other phases: streams relayed to a C echo "
                             "target (dial, accept, splice, close), per relayed stream")
    parser.add_argument("--egress", type=int, default=0,
                        help="instead of the other phases: streams an agent opens that a "
                             "nodeagent server dials to a C echo target, per stream (the "
                             "other tree's nodeagent package too)")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian package: valgrind)")
    trees = {"this": ROOT, "other": args.tree.resolve()}
    minimum = ([*MINIMUM, "--egress", "1"] if args.egress else
               [*MINIMUM, "--relays", "1"] if args.relays else MINIMUM)
    packages = ("tunnel", "nodeagent") if args.egress else ("tunnel",)
    start = {name: instructions(tree, minimum, packages) for name, tree in trees.items()}
    for phase, (phase_args, units, unit_name) in phases(args.mib, args.rr, args.opens,
                                                        args.relays, args.egress).items():
        rounds: list[dict[str, float]] = []
        for _ in range(args.rounds):
            rounds.append({name: (instructions(tree, phase_args, packages) - start[name])
                           / units for name, tree in trees.items()})
        ratios = [r["this"] / r["other"] for r in rounds]
        print(json.dumps({
            "phase": phase, "unit": unit_name,
            "this": round(statistics.median(r["this"] for r in rounds), 2),
            "other": round(statistics.median(r["other"] for r in rounds), 2),
            "ratio": round(statistics.median(ratios), 4),
            "ratio_min": round(min(ratios), 4), "ratio_max": round(max(ratios), 4),
        }), flush=True)

if __name__ == "__main__":
    main()
