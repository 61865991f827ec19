"""Idle CPU of the controller: with 10,000 Ingresses (and their Services and
EndpointSlices) and nothing changing, how much CPU does a controller process use?

The fake API server (nodeagent.testing.fakekube) runs in this process with the objects
written straight into its store; the controller runs as a real `nodeagent controller`
process against it (one replica, so it is the leader and also writes its own watchers
ConfigMap every 5 s).
Once the servers' config carrying every Ingress rule has arrived on the config stream, the
controller's utime+stime (from /proc/PID/stat) is sampled over `--seconds` of quiet.

Target: ~0 s of CPU between changes. Measured on this 2-core machine, 10,000 Ingresses,
30 s idle: 8.36 s of CPU (28 %) when every cache event, the 5 s watcher reports included,
recomputed everything (the code before controller/inputs.py); 0.20 s (0.7 %: the replica's
own watcher report and watch bookmarks) with recomputes driven by config inputs only.

The config stream is read over TLS with a server identity (nodeagent://server/bench)
issued straight from the CA Secret the leader creates at start; the controller gets
`--tls-name 127.0.0.1` so its serving certificate names the address dialled. Prints the
controller's CPU over the quiet period with what it measured along the way, and writes
bench-results/controller_idle.json. From the repository root:

    .venv/bin/python -m scripts.bench.controller_idle [--ingresses 10000] [--seconds 30]
        [--source DIR]    # run the controller from another checkout (e.g. a `git archive`
                          # of main) to compare before/after with the same fake API server
        [--legacy-token]  # for a --source tree from before the TLS config stream (before
                          # fa3063f): plain HTTP with the shared token Secret
                          # nodeagent-agent-token, created here, and no --tls-name
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import h11
import trio

from nodeagent.controller.bootstrap import CA_SECRET, secret_value
from nodeagent.testing.fakekube.errors import ApiError
from nodeagent.testing.fakekube.fixtures import start_fake_kube
from nodeagent.testing.fakekube.server import FakeKube
from nodeagent.trust import pki
from scripts import ROOT

TOKEN = "bench-idle-token-0123456789"
NAMESPACE = "nodeagent"
APPS = "apps"


def populate(fake: FakeKube, ingresses: int, *, legacy_token: bool = False) -> None:
    """Ingresses, each with its own Service and EndpointSlice on one of 50 nodes (and,
    for a --legacy-token controller, the shared token Secret it reads)."""
    store = fake.store

    def create(obj: dict[str, Any]) -> None:
        rt, version = store.type_for(obj["apiVersion"], obj["kind"])
        store.create(rt, version, obj["metadata"].get("namespace"), obj)

    if legacy_token:
        create({"apiVersion": "v1", "kind": "Secret", "metadata": {
            "name": "nodeagent-agent-token", "namespace": NAMESPACE},
            "stringData": {"token": TOKEN}})
    create({"apiVersion": "networking.k8s.io/v1", "kind": "IngressClass", "metadata": {
        "name": "nodeagent"}, "spec": {"controller": "nodeagent.io/ingress-controller"}})
    for n in range(50):
        create({"apiVersion": "v1", "kind": "Node", "metadata": {"name": f"node-{n}"},
                "status": {"addresses": [{"type": "InternalIP", "address": f"10.0.0.{n + 1}"}]}})
    for i in range(ingresses):
        name = f"app-{i}"
        create({"apiVersion": "v1", "kind": "Service", "metadata": {
            "name": name, "namespace": APPS}, "spec": {"ports": [
                {"name": "http", "port": 80, "targetPort": 8080}]}})
        create({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": {
            "name": f"{name}-1", "namespace": APPS,
            "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv4", "ports": [{"name": "http", "port": 8080}],
            "endpoints": [{"addresses": [f"10.{1 + i // 65536}.{i // 256 % 256}.{i % 256}"],
                           "nodeName": f"node-{i % 50}", "conditions": {"ready": True}}]})
        create({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {
            "name": name, "namespace": APPS}, "spec": {
                "ingressClassName": "nodeagent", "rules": [{
                    "host": f"{name}.example.com", "http": {"paths": [{
                        "path": "/", "pathType": "Prefix", "backend": {"service": {
                            "name": name, "port": {"name": "http"}}}}]}}]}})


async def server_identity(fake: FakeKube, proc: trio.Process) -> ssl.SSLContext:
    """A client context presenting a server identity for `bench`, issued from the CA the
    controller's leader creates at start (read from the fake's store once it exists)."""
    rt, version = fake.store.type_for("v1", "Secret")
    while True:
        try:
            secret = fake.store.get(rt, version, NAMESPACE, CA_SECRET)
            break
        except ApiError:
            if proc.returncode is not None:
                raise RuntimeError(f"the controller exited ({proc.returncode}) before "
                                   f"creating its CA; a --source tree from before the TLS "
                                   f"config stream (it has no --tls-name) needs "
                                   f"--legacy-token") from None
            await trio.sleep(0.1)
    ca = pki.CertificateAuthority.load(secret_value(secret, "tls.crt").encode(),
                                       secret_value(secret, "tls.key").encode())
    identity = pki.issue_server_identity(ca, "bench")
    return pki.client_ssl_context(ca.certificate_pem, identity.certificate_pem,
                                  identity.key_pem)


async def first_routes(port: int, want_rules: int, tls: ssl.SSLContext | None,
                       proc: trio.Process) -> int:
    """Read the servers' config stream (over TLS with `tls`, else plain HTTP with the
    legacy token) until a config carries `want_rules` Ingress rules; returns its version."""
    while True:
        if proc.returncode is not None:
            raise RuntimeError(f"the controller exited ({proc.returncode}) before serving "
                               f"the routes; a --source tree from before the TLS config "
                               f"stream (it has no --tls-name) needs --legacy-token")
        try:
            stream: trio.abc.Stream = await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            await trio.sleep(0.2)
            continue
        if tls is not None:
            stream = trio.SSLStream(stream, tls, server_hostname="127.0.0.1",
                                    https_compatible=True)
        try:
            async with stream:
                version = await _read_stream(stream, want_rules, tls is None)
        except (OSError, trio.BrokenResourceError, h11.ProtocolError):
            version = None  # not listening yet, or dropped: try again
        if version is not None:
            return version
        await trio.sleep(0.2)


async def _read_stream(stream: trio.abc.Stream, want_rules: int, token: bool) -> int | None:
    conn = h11.Connection(h11.CLIENT)
    headers = [("host", "127.0.0.1")]
    if token:
        headers.append(("authorization", f"Bearer {TOKEN}"))
    await stream.send_all(conn.send(h11.Request(
        method="GET", target="/v1/config/servers/bench", headers=headers)))
    buffer = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(1 << 20)
            if not data:
                return None
            conn.receive_data(bytes(data))
        elif isinstance(event, h11.Response):
            if event.status_code != 200:
                return None  # not ready yet (legacy: the token Secret not read): again
        elif isinstance(event, h11.Data):
            buffer += bytes(event.data)
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                doc = json.loads(line)
                rules = (((doc.get("config") or {}).get("ingress") or {})
                         .get("rules") or [])
                if len(rules) >= want_rules:
                    return int(doc["version"])
        else:
            return None


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench(ingresses: int, seconds: float, source: Path,
                legacy_token: bool) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-controller-idle-"))
    async with trio.open_nursery() as nursery:
        fake = await start_fake_kube(nursery, bookmark_interval=1.0,
                                     namespaces=("default", NAMESPACE, APPS))
        started = time.monotonic()
        populate(fake, ingresses, legacy_token=legacy_token)
        populated = time.monotonic() - started
        kubeconfig = fake.write_kubeconfig(tmp / "kubeconfig")
        port = _free_port()
        log = (tmp / "controller.log").open("wb")
        env = dict(os.environ, PYTHONPATH=str(source))
        command = [sys.executable, "-m", "nodeagent", "controller",
                   "--kubeconfig", str(kubeconfig), "--namespace", NAMESPACE,
                   "--listen", f"127.0.0.1:{port}", "--identity", "bench"]
        if not legacy_token:
            command += ["--tls-name", "127.0.0.1"]
        proc = await trio.lowlevel.open_process(
            command, cwd=source, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            started = time.monotonic()
            with trio.fail_after(600):
                tls = None if legacy_token else await server_identity(fake, proc)
                version = await first_routes(port, ingresses, tls, proc)
            first_config = time.monotonic() - started
            # The leader's first writes (Ingress status for every Ingress, PKI) settle first.
            await trio.sleep(10)
            cpu_before = cpu_seconds(proc.pid)
            await trio.sleep(seconds)
            idle_cpu = cpu_seconds(proc.pid) - cpu_before
        finally:
            proc.terminate()
            with trio.move_on_after(10):
                await proc.wait()
            log.close()
            nursery.cancel_scope.cancel()
    return {"source": str(source), "stream": "http+token" if legacy_token else "tls",
            "ingresses": ingresses, "populate_s": populated,
            "first_config_s": first_config, "first_config_version": version,
            "idle_seconds": seconds, "idle_cpu_s": idle_cpu,
            "idle_cpu_percent": 100 * idle_cpu / seconds,
            "controller_log": str(tmp / "controller.log")}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.controller_idle",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--ingresses", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--source", type=Path, default=ROOT,
                        help="checkout to run the controller from (default: this one)")
    parser.add_argument("--legacy-token", action="store_true",
                        help="the --source controller serves plain HTTP with the shared token "
                             "Secret (trees before the TLS config stream)")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench-results" / "controller_idle.json")
    args = parser.parse_args()
    result = trio.run(bench, args.ingresses, args.seconds, args.source.resolve(),
                      args.legacy_token)
    for key, value in result.items():
        print(f"{key:22} {value:,.2f}" if isinstance(value, float) else f"{key:22} {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
