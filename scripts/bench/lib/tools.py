"""Building and parsing the load tools scripts.bench.tunnel and scripts.bench.intercept
drive."""

from __future__ import annotations

import collections
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
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


def write_nginx_conf(workdir: Path, port: int) -> list[str]:
    """An nginx serving `workdir/www/1k` (1 KiB) on `port`, tuned for load tests; returns
    the command line that runs it in the foreground."""
    www = workdir / "www"
    www.mkdir(exist_ok=True)
    (www / "1k").write_bytes(b"x" * 1024)
    conf = workdir / "nginx.conf"
    conf.write_text(f"""
user root; worker_processes 1; daemon off; pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 20000; }}
http {{ access_log off; keepalive_requests 1000000; keepalive_timeout 60;
  server {{ listen {port} reuseport backlog=8192; root {www}; location / {{ }} }} }}
""")
    return ["nginx", "-c", str(conf), "-e", str(workdir / "nginx-error.log")]


def write_sshd_config(sshdir: Path, listen: str, port: int = 2222) -> list[str]:
    """Host and client keys plus an sshd_config bound to `listen:port` only (key login as
    root, forwarding allowed); returns the command line that runs sshd in the foreground.
    The client key is `sshdir/id`."""
    sshdir.mkdir(mode=0o700, exist_ok=True)
    for key in ("host_key", "id"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                        str(sshdir / key)], check=True)
    shutil.copy(sshdir / "id.pub", sshdir / "authorized_keys")
    (sshdir / "sshd_config").write_text(f"""Port {port}
ListenAddress {listen}
HostKey {sshdir}/host_key
AuthorizedKeysFile {sshdir}/authorized_keys
PidFile {sshdir}/sshd.pid
UsePAM no
StrictModes no
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
GatewayPorts clientspecified
AllowTcpForwarding yes
MaxStartups 100
""")
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privsep directory
    sshd = shutil.which("sshd", path="/usr/sbin:/sbin:/usr/bin") or "/usr/sbin/sshd"
    return [sshd, "-D", "-e", "-f", str(sshdir / "sshd_config")]


def callgrind_instructions(tree: Path, module: str, args: list[str],
                           packages: tuple[str, ...]) -> int:
    """Instructions callgrind counts for one run of `python -m module args` with
    `tree`'s `packages` imported instead of this checkout's (the benchmark module is this
    checkout's, run over them)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        for package in packages:
            (Path(tmp) / package).symlink_to(tree / package)
        env = dict(os.environ, PYTHONPATH=f"{tmp}{os.pathsep}{ROOT}", PYTHONHASHSEED="0")
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
             "-P", "-m", module, *args],
            cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    match = re.search(r"Collected : (\d+)", proc.stderr)
    if match is None:
        raise SystemExit(f"no instruction count in valgrind's output:\n{proc.stderr[-2000:]}")
    return int(match.group(1))
