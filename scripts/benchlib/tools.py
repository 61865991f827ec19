"""Building and parsing the load tools scripts/bench.py drives."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

CLONE_NEWNET = 0x40000000

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "benchtool.c"
NEEDED = {  # command -> Debian package
    "ip": "iproute2", "wrk": "wrk", "iperf3": "iperf3", "nginx": "nginx-light",
    "sshd": "openssh-server", "ssh": "openssh-client", "ssh-keygen": "openssh-client",
    "cc": "gcc",
}


def missing_commands() -> list[str]:
    found = []
    for cmd, pkg in NEEDED.items():
        if shutil.which(cmd) is None and shutil.which(cmd, path="/usr/sbin:/sbin") is None:
            found.append(f"{cmd} (apt-get install -y {pkg})")
    return found


def build_benchtool(cache: Path) -> Path:
    """Compile benchtool.c once per source version; returns the binary."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    binary = cache / f"benchtool-{digest}"
    if not binary.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = binary.with_suffix(".tmp")
        subprocess.run(["cc", "-O2", "-pthread", "-o", str(tmp), str(SOURCE)], check=True)
        tmp.rename(binary)
    return binary


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text.strip())
    if not m:
        raise ValueError(f"cannot parse wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_wrk(out: str) -> dict[str, float]:
    """Requests/s and latency percentiles (ms) from `wrk --latency` output."""
    result: dict[str, float] = {}
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not m:
        raise ValueError(f"wrk printed no Requests/sec:\n{out}")
    result["req_per_sec"] = float(m.group(1))
    for pct in ("50", "75", "90", "99"):
        m = re.search(rf"^\s+{pct}%\s+(\S+)", out, re.M)
        if m:
            result[f"p{pct}_ms"] = _ms(m.group(1))
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    result["non_2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    result["socket_errors"] = sum(int(x) for x in m.groups()) if m else 0
    return result


def summarize_profile(raw: Path, top: int = 25) -> str:
    """Top functions by self time and by inclusive time from a py-spy raw (collapsed)
    profile."""
    self_t: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_short(f) for f in stack.split(";") if f]
        if not frames:
            continue
        self_t[frames[-1]] += n
        for frame in set(frames):
            incl[frame] += n
    if not total:
        return "(no samples)"
    lines = [f"{total} samples", "  self%  function"]
    lines += [f"  {100 * n / total:5.1f}  {name}" for name, n in self_t.most_common(top)]
    lines += ["  incl%  function"]
    lines += [f"  {100 * n / total:5.1f}  {name}" for name, n in incl.most_common(top)]
    return "\n".join(lines)


def _short(frame: str) -> str:
    # py-spy raw frames look like "function (path/to/file.py:123)"
    m = re.match(r"(.*) \((.*?):(\d+)\)$", frame)
    if not m:
        return frame
    func, path, _line = m.groups()
    parts = path.split("/")
    for anchor in ("site-packages", "tunnel", "nodeagent", "lib"):
        if anchor in parts:
            parts = parts[parts.index(anchor) + (1 if anchor in ("site-packages", "lib")
                                                 else 0):]
            break
    return f"{func} ({'/'.join(parts[-3:])})"


@contextlib.contextmanager
def in_netns(real_name: str) -> Iterator[None]:
    """Switch this thread's network namespace for the body (sockets made inside keep
    it). ctypes setns(2): os.setns needs Python 3.12."""
    libc = ctypes.CDLL(None, use_errno=True)
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/run/netns/{real_name}", os.O_RDONLY)
    try:
        if libc.setns(target, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns failed")
        yield
    finally:
        libc.setns(own, CLONE_NEWNET)
        os.close(own)
        os.close(target)
