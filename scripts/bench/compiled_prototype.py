"""A throwaway copy of the tunnel package compiled with mypyc, for measuring only.

Issue 25 asks whether a compiled framing and copy path is worth shipping. This builds the
answer's prototype: it copies this tree's `tunnel` package to OUT/tunnel, applies the few
behaviour-neutral edits mypyc needs (`PATCHES`, below: the product code is never changed),
compiles a module set with mypyc (`--set protocol`: tunnel/protocol/*; `--set trio`: that
plus the trio-side hot modules) and, with `--measure`, compares it against this tree:

    .venv/bin/python -m scripts.bench.compiled_prototype --out /tmp/proto-protocol --measure
    .venv/bin/python -m scripts.bench.compiled_prototype --out /tmp/proto-trio --set trio \
        --measure

`--measure` runs `scripts.bench.tunnel_instructions --relays 150` (callgrind instructions
per relayed connection, both endpoints, 3 interleaved rounds: "this" is this tree,
"other" the compiled copy) and `--cpu-rounds` interleaved rounds of
`scripts.bench.tunnel_cpu --relays 3000` on each (CPU µs per relayed connection), and
prints one JSON object per measure. Needs gcc, the interpreter's headers and mypy (which
ships mypyc; it is in the `test` extra). Building the `trio` set takes ~1-2 CPU minutes.
See docs/performance.md, "A compiled tunnel core, measured".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROTOCOL = ["protocol/__init__.py", "protocol/connection.py", "protocol/errors.py",
            "protocol/events.py", "protocol/flow.py", "protocol/reassembly.py",
            "protocol/state.py", "protocol/wire.py"]
# transports/base.py stays interpreted: its Transport ABC is subclassed by interpreted
# classes (StreamTransport's multiple inheritance mypyc refuses, the WebSocket transport,
# the tests' memory transport), and mypyc's classes cannot be.
TRIO = [*PROTOCOL, "spliceloop.py", "endpoint.py", "stream.py", "relay.py", "tcp.py",
        "dial.py", "transports/tls.py", "transports/tcpstate.py"]
SETS = {"protocol": PROTOCOL, "trio": TRIO}

# (file, old, new): what mypyc needs that mypy does not. mypyc checks `bytes` arguments at
# run time, where mypy lets a bytearray pass as bytes; it types `exc` of consecutive
# `except A as exc` / `except B as exc` clauses as A; and its native classes cannot be
# weakly referenced (the splice loops are kept in a WeakKeyDictionary per connection).
PATCHES = [
    ("protocol/connection.py", "def receive_data(self, data: bytes | memoryview) -> list",
     "def receive_data(self, data: bytes | bytearray | memoryview) -> list"),
    ("protocol/reassembly.py",
     "def complete_pending(inbuf: bytearray, data: bytes | memoryview, limit",
     "def complete_pending(inbuf: bytearray, data: bytes | bytearray | memoryview, limit"),
    ("endpoint.py", "        except p.StreamLimitReached as exc:\n"
                    "            raise StreamRefusedError(p.StreamReason.OVERLOADED, str(exc))"
                    " from None",
     "        except p.StreamLimitReached as exc2:\n"
     "            raise StreamRefusedError(p.StreamReason.OVERLOADED, str(exc2)) from None"),
    ("endpoint.py", "        except p.ConnectionDraining as exc:\n"
                    "            raise StreamRefusedError(p.StreamReason.DRAINING, str(exc))"
                    " from None",
     "        except p.ConnectionDraining as exc3:\n"
     "            raise StreamRefusedError(p.StreamReason.DRAINING, str(exc3)) from None"),
    # `answered` deletes what an answered dial or open no longer needs.
    ("spliceloop.py", '"on_refused", "splice",\n                 "timeout")\n',
     '"on_refused", "splice",\n                 "timeout")\n'
     '    __deletable__ = ["incoming", "on_accepted", "on_refused"]\n'),
    ("spliceloop.py", '"splice", "timeout",\n                 "to_tunnel")\n',
     '"splice", "timeout",\n                 "to_tunnel")\n'
     '    __deletable__ = ["to_tunnel", "on_accepted", "on_refused", "on_lost"]\n'),
    ("endpoint.py", "\nclass TunnelConnection:",
     "\nfrom mypy_extensions import mypyc_attr\n\n\n"
     "@mypyc_attr(native_class=False)\nclass TunnelConnection:"),
]

SETUP = """\
import os
from setuptools import setup
from mypyc.build import mypycify
setup(name="compiled-prototype", ext_modules=mypycify(
    os.environ["MODULES"].split(), opt_level="3", group_name="tunnel.compiled"))
"""


def build(out: Path, modules: list[str]) -> None:
    """Copy this tree's tunnel package to out/tunnel, patch it, compile `modules` in it."""
    if (out / "tunnel").exists():
        shutil.rmtree(out / "tunnel")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(ROOT / "tunnel", out / "tunnel",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name, old, new in PATCHES:
        if name.split("/")[0] != "protocol" and name not in modules:
            continue
        path = out / "tunnel" / name
        text = path.read_text()
        if old not in text:
            raise SystemExit(f"patch for {name} no longer applies: {old!r}")
        path.write_text(text.replace(old, new, 1))
    # A build directory with no pyproject.toml (setuptools would validate this repo's) and
    # a mypy.ini with the repo's strictness, so mypyc sees the types mypy checks.
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "tunnel").symlink_to(out / "tunnel")
        (Path(tmp) / "setup.py").write_text(SETUP)
        (Path(tmp) / "mypy.ini").write_text("[mypy]\npython_version = 3.11\nstrict = True\n")
        env = dict(os.environ, MODULES=" ".join(f"tunnel/{m}" for m in modules))
        subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=tmp,
                       env=env, check=True, stdout=subprocess.DEVNULL)


def cpu_us(tree: Path, relays: int) -> float:
    """CPU µs per relayed connection (tunnel_cpu --relays) with `tree`'s tunnel package."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "tunnel").symlink_to(tree / "tunnel")
        env = dict(os.environ, PYTHONPATH=f"{tmp}{os.pathsep}{ROOT}")
        proc = subprocess.run(
            [sys.executable, "-P", "-m", "scripts.bench.tunnel_cpu", "--mib", "1", "--rr", "1",
             "--opens", "1", "--parallel", "1", "--relays", str(relays)],
            cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return float(json.loads(proc.stdout.splitlines()[-1])["open_relay_close_cpu_us"])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.compiled_prototype",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="where the copy is built")
    parser.add_argument("--set", choices=sorted(SETS), default="protocol")
    parser.add_argument("--no-build", dest="build", action="store_false",
                        help="measure an existing copy")
    parser.add_argument("--measure", action="store_true")
    parser.add_argument("--relays", type=int, default=150, help="for the instruction count")
    parser.add_argument("--cpu-relays", type=int, default=3000)
    parser.add_argument("--cpu-rounds", type=int, default=3)
    args = parser.parse_args()
    out = args.out.resolve()
    if args.build:
        build(out, SETS[args.set])
    if not args.measure:
        return
    subprocess.run([sys.executable, "-m", "scripts.bench.tunnel_instructions", "--tree",
                    str(out), "--relays", str(args.relays)], cwd=ROOT, check=True)
    rounds = [{"this": cpu_us(ROOT, args.cpu_relays), "other": cpu_us(out, args.cpu_relays)}
              for _ in range(args.cpu_rounds)]
    ratios = [r["other"] / r["this"] for r in rounds]
    print(json.dumps({
        "measure": "cpu_us_per_relayed_connection", "set": args.set,
        "plain": [round(r["this"], 1) for r in rounds],
        "compiled": [round(r["other"], 1) for r in rounds],
        "compiled_over_plain": round(statistics.median(ratios), 3),
        "min": round(min(ratios), 3), "max": round(max(ratios), 3),
        "loadavg": os.getloadavg()[0],
    }), flush=True)


if __name__ == "__main__":
    main()
