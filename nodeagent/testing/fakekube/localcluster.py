"""A local stand-in for a cluster, driven the way a user drives one: the fake API server as
a process (`python -m nodeagent.testing.fakekube --tls --rbac`), the real `kubectl`, and nodeagent
processes started with the flags the applied workloads give them.

Shared by the kubectl end-to-end test and `scripts/demo --cluster`. What a cluster would do
and the fake does not (there is no kubelet, scheduler or Deployment controller), the caller
does in its place with the helpers here: create the pods, give each a projected token bound
to it (`add_token`), and run its container's command (`container_command`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import yaml

from nodeagent.testing.fakekube.kubectl import kubectl_sync

ROOT = Path(__file__).resolve().parents[3]  # the checkout: manifests/ are not packaged
MANIFESTS = ROOT / "manifests"
NAMESPACE = "nodeagent"


class Kubectl:
    """The user at a terminal: every call is `kubectl …` with the given kubeconfig."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig

    def run(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        return kubectl_sync(self.kubeconfig, *args, stdin=stdin)

    def ok(self, *args: str, stdin: str | None = None) -> str:
        result = self.run(*args, stdin=stdin)
        if result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr}")
        return result.stdout

    def apply(self, *docs: dict[str, Any]) -> str:
        return self.ok("apply", "-f", "-", stdin=yaml.safe_dump_all(docs))

    def json(self, *args: str) -> Any:
        return json.loads(self.ok("get", *args, "-o", "json"))

    def table(self, *args: str) -> list[list[str]]:
        return [line.split() for line in self.ok("get", *args).splitlines()]


class FakeApiServer:
    """`python -m nodeagent.testing.fakekube --tls --rbac --token ADMIN --kubeconfig PATH` as a
    process:
    RBAC is enforced for every user but the admin, whose kubeconfig is written to PATH.
    `control` is an HTTP client for the fake's own `/_fake` endpoints (tokens, requests)."""

    def __init__(self, kubeconfig: Path, admin_token: str,
                 bookmark_interval: float = 0.5) -> None:
        self.kubeconfig = kubeconfig
        self.proc = subprocess.Popen(
            # --token=VALUE: a random token may begin with "-", which argparse would take
            # for an option (the fake then never started, one run in 64).
            [sys.executable, "-m", "nodeagent.testing.fakekube", "--tls", "--rbac",
             f"--token={admin_token}",
             "--kubeconfig", str(kubeconfig), "--bookmark-interval", str(bookmark_interval)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            assert self.proc.stdout is not None
            self.url: str = json.loads(self.proc.stdout.readline())["url"]
        except (ValueError, KeyError):
            self.close()
            raise RuntimeError("the fake API server did not start") from None
        self.control = httpx.Client(base_url=self.url, verify=False, timeout=5)

    def add_token(self, token: str, path: Path, **claims: Any) -> Path:
        """A ServiceAccount token the fake knows (as TokenReview will), written where the
        kubelet would project it."""
        response = self.control.post("/_fake/tokens", json={"token": token, **claims})
        if response.status_code != 200:
            raise AssertionError(f"the fake refused the token: {response.text}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token)
        return path

    def kubeconfig_as(self, token_file: Path, path: Path) -> Path:
        """The admin kubeconfig with the user swapped for a token file (a ServiceAccount)."""
        doc = yaml.safe_load(self.kubeconfig.read_text())
        doc["users"][0]["user"] = {"tokenFile": str(token_file)}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(doc))
        return path

    def close(self) -> None:
        if hasattr(self, "control"):
            self.control.close()
        self.proc.kill()
        self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def pod(name: str, account: str, node: str, namespace: str = NAMESPACE) -> dict[str, Any]:
    """A pod as the scheduler would have placed it (the fake runs nothing)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
            "spec": {"serviceAccountName": account, "nodeName": node,
                     "containers": [{"name": "c", "image": "ghcr.io/nodeagent/nodeagent"}]}}


def container_command(workload: dict[str, Any], role: str, fields: dict[str, str],
                      replace: dict[str, str]) -> list[str]:
    """The workload's container args as the kubelet would run them, minus the role: each
    `$(VAR)` expanded from the container's `fieldRef` env, then each `--flag=value` whose
    flag is in `replace` given the caller's value. Every other flag runs as applied."""
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
           for e in container.get("env", [])}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    if args[0] != role:
        raise AssertionError(f"{workload['metadata']['name']} runs {args[0]!r}, not {role!r}")
    given = {a.partition("=")[0] for a in args[1:]}
    if not set(replace) <= given:
        raise AssertionError(f"the manifest no longer gives {set(replace) - given}")
    return [f"{flag}={replace[flag]}" if (flag := a.partition("=")[0]) in replace else a
            for a in args[1:]]


def ready(port: int) -> bool:
    """The readiness probe the manifests declare (`GET /readyz` on the metrics port)."""
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def wait_for(check: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    """Poll until `check()` is truthy; returns its value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, OSError, AssertionError) as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout}s (last: {last!r})")
