"""`nodeagent demo` (what `scripts/demo` runs) stops cleanly: on Ctrl-C (SIGINT to the
whole foreground process group, as a terminal sends it) and on SIGTERM to the demo alone,
it exits 0 with no traceback, leaves no server or agent running, and removes its working
directory (which holds the demo CA's key). The commands it prints work as printed, from a
shell whose PATH does not hold the venv."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.needs("root")  # the agent marks its tunnel socket (SO_MARK)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose; its parent (the demo) has exited.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(") ", 1)[1].startswith(("R", "S", "D"))


def path_without_venv() -> str:
    """PATH as a user's shell has it: without the directory of this interpreter (the
    venv's bin, where `nodeagent` lives)."""
    venv_bin = str(Path(sys.executable).parent)
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and d != venv_bin)


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_the_demo_stops_cleanly_on_a_signal(how: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "nodeagent", "demo"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "press Ctrl-C to stop" in line:
                break
        output = "".join(lines)
        assert "press Ctrl-C to stop" in output, output
        workdir = Path(re.search(r"working directory\s+(\S+)", output)[1])  # type: ignore[index]
        pids = [int(p) for p in re.search(r"server pid (\d+), agent pid (\d+)", output)
                .groups()]  # type: ignore[union-attr]
        assert workdir.is_dir() and all(_alive(pid) for pid in pids)
        printed = [line.strip() for line in lines if " debug " in line]
        assert len(printed) == 3, output
        for command in printed:
            if "--watch" not in command:
                done = subprocess.run(shlex.split(command), capture_output=True, text=True,
                                      env={**os.environ, "PATH": path_without_venv()},
                                      timeout=30)
                assert done.returncode == 0, f"{command}: {done.stderr}"
                assert "demo-node" in done.stdout, done.stdout
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output += rest
    assert proc.returncode == 0, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output
    assert output.rstrip().endswith("stopped."), output
    assert not workdir.exists()
    assert not [pid for pid in pids if _alive(pid)]
