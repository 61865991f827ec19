"""A single stream's CPU per GB: the tunnel, its per-read path in C, and `ssh -R`.

Issue 25 asks for a single stream at `ssh -R`'s throughput both ways, or the measured
prototype that shows what it would take. This runs one 127.0.0.1 transfer each way through
each variant, in the same harness as `scripts.bench.splice_bulk` (a server process and an
agent process, the client and the target threads of this process, each endpoint's CPU
from /proc around each transfer), rounds interleaved:

- `python`: this tree's tunnel (splice_bulk's endpoints: the splice loop, TLSStream);
- `c`: `bulk_relay.c` beside this file, built here with the system's cc and libssl: the
  same per-read work (256 KiB socket reads, DATA frames of 64 KiB joined behind their
  headers, TLS 1.3 through memory BIOs, 1 MiB tunnel reads, frames parsed in place, the
  tunnel's windows) with no Python per read: the floor of a compiled per-read path of the
  same design;
- `c+trio`: the same C relay as a library driven by a trio loop in a Python process: the
  loop waits (`trio.lowlevel.wait_readable`) for the relay's epoll descriptor and calls
  the relay's step through ctypes, which does all that is ready: what a compiled piece
  called once per wake-up by the splice loop would cost, trio's scheduling included;
- `ssh`: `sshd` (the "server": every process under the listener) and `ssh -N -R` (the
  "agent"), the ssh cipher pinned as `scripts.bench.tunnel` pins it;
- `-aes128` after any of them: the same with AES-128-GCM (TLS_AES_128_GCM_SHA256, set
  through ctypes for the Python endpoints: Python 3.11's ssl cannot choose TLS 1.3
  suites; aes128-gcm@openssh.com for ssh). The tunnel negotiates TLS_AES_256_GCM_SHA384
  by default.

    .venv/bin/python -m scripts.bench.bulk_parity                       # ~5 min
    .venv/bin/python -m scripts.bench.bulk_parity --variants python,c,c+trio,ssh --rounds 5
    .venv/bin/python -m scripts.bench.bulk_parity --variants python,c --instructions --mib 32

Up: the server reads the client and sends, the agent writes into the target; down the
other way round. It also prints OpenSSL's own AES-GCM cost (`openssl speed -evp`, 16 KiB
blocks, one core: the encryption alone, s/GB). Prints each transfer, then one JSON
object: per variant and direction the median [min, max] of each side's CPU s/GB and the
throughput, and per round the ratios to `python` and to `ssh` of the same round.
See docs/performance.md, "A compiled per-read path, measured".
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench.lib.tools import write_sshd_config
from scripts.bench.splice_bulk import BUF, Pair, _certs, _cpu_parts, _free_port

HERE = Path(__file__).resolve().parent
AES128_TLS = "TLS_AES_128_GCM_SHA256"
SSH_CIPHERS = {"": "aes256-gcm@openssh.com", "-aes128": "aes128-gcm@openssh.com"}
VARIANTS = ["python", "c", "c+trio", "ssh", "python-aes128", "c-aes128", "c+trio-aes128",
            "ssh-aes128"]
ROOT = HERE.parents[1]


def build_relay(out: Path) -> Path:
    """bulk_relay.c compiled to out/bulk_relay, and as a library to out/bulk_relay.so
    (cc -O2, libssl, libhttp-parser); returns the program's path."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("bulk_parity needs a C compiler (cc), libssl-dev and "
                         "libhttp-parser-dev")
    binary = out / "bulk_relay"
    source = str(HERE / "bulk_relay.c")
    libs = ["-lssl", "-lcrypto", "-lhttp_parser"]
    subprocess.run([cc, "-O2", "-Wall", "-o", str(binary), source, *libs], check=True)
    subprocess.run([cc, "-O2", "-Wall", "-shared", "-fPIC", "-DBULK_RELAY_LIB", "-o",
                    str(out / "bulk_relay.so"), source, *libs], check=True)
    return binary


def trio_endpoint(library: str, args: list[str]) -> None:
    """A `c+trio` endpoint: the C relay's library, driven by a trio loop (one
    wait_readable on its epoll descriptor and one ctypes call per wake-up)."""
    import ctypes

    import trio

    lib = ctypes.CDLL(library)
    argv = [b"bulk_relay", *(a.encode() for a in args)]
    if lib.bulk_relay_start(len(argv), (ctypes.c_char_p * len(argv))(*argv)) != 0:
        raise SystemExit(2)
    epfd = lib.bulk_relay_epoll()
    step = lib.bulk_relay_step

    async def loop() -> None:
        while True:
            await trio.lowlevel.wait_readable(epfd)
            step()

    trio.run(loop)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return found


class SshPair(Pair):
    """sshd on 127.0.0.1 and `ssh -N -R` forwarding the up and down ports to the sink and
    the source: `ssh -R` in Pair's shape (server: sshd and every process under it, agent:
    the ssh client)."""

    def __init__(self, tmp: Path, cipher: str) -> None:
        self.callgrind = None
        self.sink = socket.create_server(("127.0.0.1", 0))
        self.source = socket.create_server(("127.0.0.1", 0))
        self.up_port, self.down_port, sshd_port = (_free_port() for _ in range(3))
        sshdir = Path(tempfile.mkdtemp(dir=tmp))
        self.server = subprocess.Popen(
            write_sshd_config(sshdir, "127.0.0.1", sshd_port), stderr=subprocess.DEVNULL,
            text=True)
        _wait_listening(sshd_port)
        self.agent = subprocess.Popen([
            "ssh", "-N", "-i", str(sshdir / "id"), "-p", str(sshd_port), "-c", cipher,
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "BatchMode=yes", "-o", "ExitOnForwardFailure=yes", "-o", "LogLevel=ERROR",
            "-R", f"127.0.0.1:{self.up_port}:127.0.0.1:{self.sink.getsockname()[1]}",
            "-R", f"127.0.0.1:{self.down_port}:127.0.0.1:{self.source.getsockname()[1]}",
            "root@127.0.0.1"], text=True)
        # A probe of a forwarded port is forwarded: its connection is taken off the
        # target's backlog here, or the transfer would accept it instead of its own.
        for port, target in ((self.up_port, self.sink), (self.down_port, self.source)):
            _wait_listening(port)
            target.settimeout(10)
            target.accept()[0].close()
            target.settimeout(None)

    def cpu(self) -> dict[str, float]:
        user = system = 0.0
        for pid in _descendants(self.server.pid):
            try:
                u, s = _cpu_parts(pid)
            except OSError:  # ended meanwhile
                continue
            user, system = user + u, system + s
        u, s = _cpu_parts(self.agent.pid)
        return {"server": user + system, "server_sys": system, "agent": u + s,
                "agent_sys": s}


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def openssl_speed() -> dict[str, float]:
    """s/GB of OpenSSL's AEADs alone, encrypting 16 KiB blocks (one TLS record)."""
    out = {}
    for alg in ("aes-256-gcm", "aes-128-gcm", "chacha20-poly1305"):
        proc = subprocess.run(["openssl", "speed", "-seconds", "2", "-bytes", "16384",
                               "-evp", alg], capture_output=True, text=True, check=True)
        # The last line: "<alg> <kB/s per block size>k", in 1000s of bytes per second.
        match = re.search(r"^\S+\s+([\d.]+)k\s*$", proc.stdout.strip().splitlines()[-1])
        if match is None:
            raise SystemExit(f"openssl speed: unexpected output:\n{proc.stdout}")
        out[alg] = round(1e9 / (float(match.group(1)) * 1000), 3)
    return out


def _stats(values: list[float]) -> list[float]:
    return [round(statistics.median(values), 3), round(min(values), 3), round(max(values), 3)]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.bulk_parity",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="MiB per transfer (512)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, from {', '.join(VARIANTS)} (all)")
    parser.add_argument("--instructions", action="store_true",
                        help="python and c variants only, under callgrind: user-space "
                             "instructions per MiB too (~50x slower: use --mib 32)")
    parser.add_argument("--no-speed", dest="speed", action="store_false",
                        help="skip `openssl speed`")
    args = parser.parse_args()
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            parser.error(f"unknown variant {v!r}")
    if args.instructions and any(v.startswith("ssh") for v in variants):
        parser.error("--instructions: ssh has no callgrind control here; leave it out")
    runs: dict[str, list[dict[str, float]]] = {}
    loads = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        certs = tmp / "certs"
        certs.mkdir()
        _certs(certs)
        relay = build_relay(tmp)
        for rnd in range(args.rounds):
            loads.append(os.getloadavg()[0])
            # The order alternates round by round: whichever ran first in a round came
            # out slower in fixed-order runs.
            for variant in variants if rnd % 2 == 0 else variants[::-1]:
                kind, _, suffix = variant.partition("-")
                suffix = f"-{suffix}" if suffix else ""
                grind = Path(tempfile.mkdtemp(dir=tmp)) if args.instructions else None
                env = {"BULK_CIPHERSUITES": AES128_TLS} if suffix else {}
                pair: Pair
                if kind == "ssh":
                    pair = SshPair(tmp, SSH_CIPHERS[suffix])
                elif kind == "c":
                    pair = Pair(None, certs, grind, command=[str(relay)], env=env)
                elif kind == "c+trio":
                    pair = Pair(None, certs, grind, env={**env, "PYTHONPATH": str(ROOT)},
                                command=[sys.executable, "-P", str(Path(__file__).resolve()),
                                         "--trio-endpoint", str(tmp / "bulk_relay.so")])
                else:
                    pair = Pair(None, certs, grind, env=env)
                try:
                    pair.transfer("up", (4 if grind else 64) * BUF)  # warm up
                    for direction in ("up", "down"):
                        r = pair.transfer(direction, args.mib * BUF)
                        runs.setdefault(f"{variant} {direction}", []).append(r)
                        print(f"round {rnd + 1} {variant:13} {direction:4} "
                              + " ".join(f"{k}={v:.3f}" for k, v in r.items()),
                              file=sys.stderr, flush=True)
                finally:
                    pair.close()
    summary: dict[str, object] = {"mib": args.mib, "rounds": args.rounds,
                                  "load_average_per_round": loads,
                                  "load_average_end": os.getloadavg()}
    if args.speed:
        summary["openssl_speed_s_per_gb"] = openssl_speed()
    metrics = list(next(iter(runs.values()))[0])
    summary["median_min_max"] = {
        key: {k: _stats([r[k] for r in rs]) for k in metrics} for key, rs in runs.items()}
    ratios: dict[str, object] = {}
    for base in ("python", "ssh"):
        if base not in variants:
            continue
        for variant in variants:
            if variant == base:
                continue
            for direction in ("up", "down"):
                this, other = runs[f"{variant} {direction}"], runs[f"{base} {direction}"]
                ratios[f"{variant}/{base} {direction}"] = {
                    k: _stats([a[k] / b[k] for a, b in zip(this, other, strict=True)])
                    for k in metrics}
    summary["ratios_per_round"] = ratios
    print(json.dumps(summary))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trio-endpoint"]:
        trio_endpoint(sys.argv[2], sys.argv[3:])
    else:
        main()
