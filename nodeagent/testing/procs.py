"""Real nodeagent processes for end-to-end tests: config files, logs, debug sockets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml


@dataclass
class NodeagentProcess:
    """`python -m nodeagent ROLE --config FILE`, logging to a file."""

    role: str
    config: dict[str, Any]
    workdir: Path
    name: str
    extra_args: Sequence[str] = ()
    netns: str | None = None
    # Set: run `nodeagent ROLE *args` (controller mode) instead of writing a config file;
    # `config` then only needs `debug_socket`.
    args: Sequence[str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    # Tests read the debug lines; benchmarks ask for less (a line per stream costs CPU).
    log_level: str = "debug"
    # Set: run from another checkout (`python -m` imports the working directory's
    # packages first), so a benchmark compares trees in one run.
    cwd: Path | None = None
    log_path: Path = field(init=False)
    config_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.workdir / f"{self.name}.log"
        self.config_path = self.workdir / f"{self.name}.yaml"

    @property
    def socket(self) -> Path:
        return Path(self.config["debug_socket"])

    def write_config(self) -> None:
        self.config_path.write_text(yaml.safe_dump(self.config))

    def start(self) -> NodeagentProcess:
        if self.args is not None:
            cmd = [sys.executable, "-m", "nodeagent", "--log-level", self.log_level, self.role,
                   *self.args]
        else:
            self.write_config()
            cmd = [sys.executable, "-m", "nodeagent", "--log-level", self.log_level, self.role,
                   "--config", str(self.config_path), *self.extra_args]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        # The child gets its own copy of the log's descriptor; ours is closed at once.
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                         cwd=self.cwd)
        return self

    def status(self, timeout: float = 2.0) -> dict[str, Any]:
        transport = httpx.HTTPTransport(uds=str(self.socket))
        with httpx.Client(transport=transport, timeout=timeout) as client:
            response = client.get("http://debug/status")
            response.raise_for_status()
            result: dict[str, Any] = response.json()
            return result

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the process's metrics (its debug socket's /metrics), 0 if absent;
        `labels` in the order the metric declares them."""
        transport = httpx.HTTPTransport(uds=str(self.socket))
        with httpx.Client(transport=transport, timeout=5) as client:
            text = client.get("http://debug/metrics").text
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.splitlines():
            if line.startswith(f"{name}{{{want}}}" if want else f"{name} "):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def wait_ready(self, timeout: float = 15.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.proc.returncode}:\n"
                                     f"{self.logs()}")
            try:
                return self.status()
            except (httpx.HTTPError, OSError, json.JSONDecodeError):
                time.sleep(0.05)
        raise AssertionError(f"{self.name} not ready after {timeout}s:\n{self.logs()}")

    def wait_for(self, predicate: Any, timeout: float = 10.0, what: str = "") -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            try:
                last = self.status()
                if predicate(last):
                    return last
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.05)
        raise AssertionError(f"{self.name}: {what or 'condition'} not met in {timeout}s; "
                             f"last status {last}\n{self.logs()}")

    def wait_for_log(self, text: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.logs():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no {text!r} in the log after {timeout}s:\n"
                                     f"{self.logs()}")
            time.sleep(0.05)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} did not stop on SIGTERM:\n{self.logs()}") from None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def rss_kib(pid: int) -> int:
    """Resident memory of a live process, KiB (VmRSS)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def kill_all(procs: Sequence[NodeagentProcess | subprocess.Popen[bytes]]) -> None:
    """Kill every process of a test's lab (nodeagent's and peers') before anything is
    checked, so a failed check cannot leak the others; peers' stdout pipes are closed."""
    for proc in procs:
        proc.kill()
        if isinstance(proc, subprocess.Popen):
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def nodeagent_logs(procs: Sequence[object]) -> list[str]:
    """The logs of the nodeagent processes among `procs`, for checks after the lab is down
    (no traceback, no secret)."""
    return [proc.logs() for proc in procs if isinstance(proc, NodeagentProcess)]
