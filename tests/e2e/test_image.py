"""The container image, built and run on this machine (slow: minutes the first time).

`python -m scripts.image build` makes the debootstrap base (cached under
/var/cache/nodeagent-image/), the wheels from requirements.lock on the host, and the image
with podman; `smoke` runs a server and an agent from it and passes traffic through the
tunnel. The image's size and the build time are printed (and asserted nowhere: figures,
not pass/fail).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest

from scripts import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.needs("root", "podman", "runc", "debootstrap")]


def image_script(*args: str, timeout: float) -> str:
    proc = subprocess.run([sys.executable, "-m", "scripts.image", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"scripts.image {args[0]} failed:\n{proc.stderr[-4000:]}"
    return proc.stdout.strip()


def test_the_image_builds_and_carries_traffic(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    built = image_script("build", timeout=1800)
    build_seconds = time.monotonic() - started
    assert re.match(r"image localhost/nodeagent:\S+: [\d.]+ MiB", built), built
    smoked = image_script("smoke", timeout=300)
    assert re.match(r"smoke \S+: 262144 bytes through server and agent containers "
                    r"\(agent [\d.]+, tunnel connected\)", smoked), smoked
    # The image runs the version this checkout is.
    from nodeagent import __version__
    assert f"agent {__version__}," in smoked
    with capsys.disabled():
        print(f"\n{built}\n{smoked}\n(build step of this run: {build_seconds:.0f}s)")


def test_the_image_refuses_a_bad_config_in_one_line(tmp_path: pytest.TempPathFactory) -> None:
    """The image's entry point is the nodeagent CLI, config errors and all."""
    proc = subprocess.run(
        ["podman", "--runtime", "runc", "run", "--rm", "--ulimit", "nofile=1024:1024",
         "--ulimit", "nproc=1024:1024", "localhost/nodeagent:0.1.0", "agent", "--node", "n1"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "controller mode needs --server" in proc.stderr
    assert "Traceback" not in proc.stderr
