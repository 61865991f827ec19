"""Run the real `kubectl` binary against a FakeKube (tests that prove a client nobody here
wrote works against the fake as it would against a cluster)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import trio

KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
needs_kubectl = pytest.mark.skipif(not os.access(KUBECTL, os.X_OK),
                                   reason=f"no kubectl binary at {KUBECTL}")


def _env(kubeconfig: Path) -> dict[str, str]:
    """A private cache dir keeps discovery from leaking between tests."""
    env = {**os.environ, "KUBECACHEDIR": str(kubeconfig.parent / "kubecache"),
           "HOME": str(kubeconfig.parent)}
    env.pop("KUBECONFIG", None)
    return env


async def kubectl(kubeconfig: Path, *args: str, stdin: bytes | None = None
                  ) -> subprocess.CompletedProcess[bytes]:
    """`kubectl --kubeconfig <kubeconfig> args…`, output captured, no exception on failure;
    60 s at most."""
    with trio.fail_after(60):
        return await trio.run_process(
            [KUBECTL, "--kubeconfig", str(kubeconfig), *args], stdin=stdin,
            capture_stdout=True, capture_stderr=True, check=False, env=_env(kubeconfig))


def kubectl_sync(kubeconfig: Path, *args: str, stdin: str | None = None,
                 timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`kubectl` as above, for synchronous tests (the end-to-end ones); text output."""
    return subprocess.run([KUBECTL, "--kubeconfig", str(kubeconfig), *args], input=stdin,
                          capture_output=True, text=True, check=False, timeout=timeout,
                          env=_env(kubeconfig))
