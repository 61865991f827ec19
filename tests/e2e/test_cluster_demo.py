"""`scripts/demo --cluster` as a user runs it: start it, wait for its instructions, run each
printed command word for word (the `export`, then kubectl, curl and `nodeagent debug` as
printed, from a PATH without the venv), and stop it with Ctrl-C."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

from nodeagent.testing.fakekube.kubectl import needs_kubectl
from tests.e2e.test_demo import path_without_venv

pytestmark = [pytest.mark.needs("root"), needs_kubectl,
              pytest.mark.skipif(not os.access("/usr/bin/curl", os.X_OK), reason="no curl")]

ROOT = Path(__file__).resolve().parents[2]


def read_instructions(proc: subprocess.Popen[str], timeout: float = 120.0) -> list[str]:
    """The demo's output up to "Ctrl-C stops everything."; fails if it exits first."""
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the demo exited ({proc.wait()}):\n{''.join(lines)}")
        lines.append(line)
        if line.startswith("Ctrl-C stops everything."):
            return lines
    raise AssertionError(f"no instructions within {timeout}s:\n{''.join(lines)}")


def test_cluster_demo_steps_work_word_for_word(tmp_path: Path) -> None:
    proc = subprocess.Popen([str(ROOT / "scripts" / "demo"), "--cluster"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output = read_instructions(proc)
        text = "".join(output)
        assert "a local stand-in for a real cluster" in text, text
        steps = [line.strip() for line in text.partition("Try it")[2].splitlines()
                 if line.startswith("  ")]
        assert steps[0].startswith("export KUBECONFIG="), steps
        env = {**os.environ, "KUBECONFIG": steps[0].partition("=")[2],
               "HOME": str(tmp_path), "KUBECACHEDIR": str(tmp_path / "kubecache"),
               "PATH": path_without_venv()}
        results: dict[str, str] = {}
        for step in steps[1:]:
            argv = shlex.split(step)
            for _ in range(50 if argv[0] == "curl" else 1):  # the route lands in a moment
                done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
                if done.returncode == 0 and (argv[0] != "curl" or "hello from" in done.stdout):
                    break
                time.sleep(0.2)
            assert done.returncode == 0, f"{step}: {done.stdout}{done.stderr}"
            results[argv[0] + " " + argv[1]] = done.stdout
        assert re.search(r"clustertunnel.nodeagent.io/demo\s", results["kubectl get"]), results
        # The demo plays the kubelet, which reports its node Ready.
        assert re.search(r"^node/demo-node\s+Ready\s", results["kubectl get"], re.M), results
        assert "hello from the sample backend on demo-node" in results["curl -H"], results
        assert re.search(r"^Ingress Class:\s+nodeagent$", results["kubectl describe"], re.M)
        debug = next(out for step, out in results.items() if step.endswith(" debug"))
        assert "demo-node" in debug, results

        # The README's Kubernetes section, word for word, against the demo: the install
        # again (nothing changes) and the example ClusterTunnel (it covers no demo node).
        readme = (ROOT / "README.md").read_text().partition("\n## Kubernetes\n")[2]
        block = readme.partition("```sh\n")[2].partition("```")[0]
        commands = [line.partition("#")[0].strip() for line in block.splitlines()]
        assert commands == ["kubectl apply -k manifests/",
                            "kubectl apply -f manifests/examples/clustertunnel.yaml"], commands
        for command in commands:
            done = subprocess.run(shlex.split(command), cwd=ROOT, capture_output=True,
                                  text=True, env=env, timeout=60)
            assert done.returncode == 0, f"{command}: {done.stderr}"
            if "-k" in command:
                assert all(line.endswith(" unchanged") for line in done.stdout.splitlines())
        curl = shlex.split(next(step for step in steps if step.startswith("curl ")))
        time.sleep(1)  # what the new ClusterTunnel changes has reached the agent
        again = subprocess.run(curl, capture_output=True, text=True, env=env, timeout=60)
        assert "hello from the sample backend on demo-node" in again.stdout, again

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert proc.stdout is not None
        rest = proc.stdout.read()
        assert "stopped." in rest and "Traceback" not in rest, rest
        logs = re.search(r"Logs: (\S+)/\*\.log", text)
        assert logs and not Path(logs.group(1)).exists(), "the demo left its directory"
    finally:
        if proc.poll() is None:
            # Ctrl-C first: the demo stops its processes; a kill would orphan them.
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
