#!/usr/bin/env python3
"""Config propagation: from a Kubernetes API write to each subscribed node applying the
config it causes, with 500 simulated nodes watching the controller's config stream.

Everything runs in one trio process (the fake API server from tests/, the controller,
and 500 watch_config clients over real TLS connections), so all of it shares one core:
a pessimistic setting. Each node presents its own client certificate, issued straight from
the CA the controller's leader bootstraps (the bench measures config fan-out, not signing).
The change measured is the worst case, a fan-out: a ClusterTunnel edit that changes every
node's config (500 applies per event).

Target (issue 4): p99 ≤ 1 s with 500 nodes subscribed.

    .venv/bin/python scripts/bench_config.py [--nodes 500] [--events 5]
"""

from __future__ import annotations

import argparse
import functools
import json
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nodeagent import pki  # noqa: E402
from nodeagent.config import NodeConfig  # noqa: E402
from nodeagent.configwatch import WatchStatus, watch_config  # noqa: E402
from nodeagent.controller.bootstrap import CA_SECRET, secret_value  # noqa: E402
from nodeagent.controller.controller import ControllerSettings, serve_controller  # noqa: E402
from nodeagent.crd import CLUSTER_TUNNELS  # noqa: E402
from nodeagent.kube import NODES, KubeClient  # noqa: E402
from tests.fakekube.fixtures import credentials_for, start_fake_kube  # noqa: E402
from tests.fakekube.server import FakeKube  # noqa: E402
from tests.fakekube.store import ApiError  # noqa: E402
from tunnel.backoff import Backoff  # noqa: E402

NAMESPACE = "nodeagent"


class Progress:
    """Wakes a waiter whenever some node applied a config."""

    def __init__(self) -> None:
        self._event = trio.Event()

    def tick(self) -> None:
        self._event.set()

    async def until(self, done: Any) -> None:
        while not done():
            await self._event.wait()
            self._event = trio.Event()


async def wait_for_ca(fake: FakeKube, namespace: str) -> pki.CertificateAuthority:
    """The CA the controller's leader creates at start, read from the fake's store."""
    rt, version = fake.store.type_for("v1", "Secret")
    while True:
        try:
            secret = fake.store.get(rt, version, namespace, CA_SECRET)
        except ApiError:
            await trio.sleep(0.05)
            continue
        return pki.CertificateAuthority.load(secret_value(secret, "tls.crt").encode(),
                                             secret_value(secret, "tls.key").encode())


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


async def bench(nodes: int, events: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-config-"))
    applied: dict[str, list[tuple[float, NodeConfig]]] = {}
    progress = Progress()
    async with trio.open_nursery() as fake_nursery:
        fake = await start_fake_kube(fake_nursery, bookmark_interval=1.0,
                                      namespaces=("default", NAMESPACE))
        kubeconfig = fake.write_kubeconfig(tmp / "kubeconfig")
        async with KubeClient(credentials_for(fake, tmp)) as kube:
            # The controller and the watchers first, so it releases its Lease while the
            # API is still up; then the fake API server.
            async with trio.open_nursery() as nursery:
                for i in range(nodes):
                    await kube.create(NODES, {"apiVersion": "v1", "kind": "Node", "metadata": {
                        "name": f"n{i}"}, "status": {"addresses": [
                            {"type": "InternalIP", "address": f"10.0.{i // 256}.{i % 256}"}]}})
                settings = ControllerSettings(namespace=NAMESPACE, identity="bench",
                                              listen_host="127.0.0.1", listen_port=0,
                                              kubeconfig=kubeconfig, tls_names=("127.0.0.1",))
                settings.listen_port = _free_port()
                await nursery.start(functools.partial(serve_controller, settings))
                with trio.fail_after(30):
                    ca = await wait_for_ca(fake, NAMESPACE)
                contexts: dict[str, ssl.SSLContext] = {}
                for i in range(nodes):
                    cert = pki.issue_client_certificate(ca, f"n{i}")
                    contexts[f"n{i}"] = pki.client_ssl_context(
                        ca.certificate_pem, cert.certificate_pem, cert.key_pem)

                for i in range(nodes):
                    name = f"n{i}"
                    applied[name] = []

                    async def apply(config: NodeConfig, name: str = name) -> None:
                        applied[name].append((time.monotonic(), config))
                        progress.tick()

                    nursery.start_soon(functools.partial(
                        watch_config, open_stream=functools.partial(
                            trio.open_tcp_stream, "127.0.0.1", settings.listen_port),
                        host="127.0.0.1", path=f"/v1/config/nodes/{name}",
                        tls=functools.partial(contexts.__getitem__, name),
                        model=NodeConfig, apply=apply, status=WatchStatus("bench"),
                        backoff=Backoff(initial=0.05, maximum=1.0)))
                with trio.fail_after(60):
                    await progress.until(lambda: all(applied[f"n{i}"] for i in range(nodes)))
                connected_at = time.monotonic()

                fanout: list[float] = []
                for e in range(events):
                    before = {n: len(v) for n, v in applied.items()}
                    start = time.monotonic()
                    obj = {"apiVersion": "nodeagent.io/v1alpha1", "kind": "ClusterTunnel",
                           "metadata": {"name": f"t{e}"}, "spec": {"allowedNodePorts": [9000 + e]}}
                    if e == 0:
                        await kube.create(CLUSTER_TUNNELS, obj)
                    else:  # a merge patch: the controller writes status/finalizers meanwhile
                        await kube.patch(CLUSTER_TUNNELS, "t0", {"spec": obj["spec"]})
                    with trio.fail_after(30):
                        await progress.until(functools.partial(
                            lambda seen: all(len(applied[n]) > seen[n] for n in applied), before))
                    fanout += [applied[n][before[n]][0] - start for n in applied]

                nursery.cancel_scope.cancel()
        fake_nursery.cancel_scope.cancel()
    return {"nodes": nodes, "events": events,
            "connect_all_s": connected_at,
            "fanout_applies": len(fanout),
            "fanout_p50_ms": statistics.median(fanout) * 1000,
            "fanout_p99_ms": pct(fanout, 0.99) * 1000,
            "fanout_max_ms": max(fanout) * 1000}


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=500)
    parser.add_argument("--events", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-results" / "config.json")
    args = parser.parse_args()
    result = trio.run(bench, args.nodes, args.events)
    result.pop("connect_all_s")
    for key, value in result.items():
        print(f"{key:18} {value:,.1f}" if isinstance(value, float) else f"{key:18} {value:,}")
    print(f"target: p99 {result['fanout_p99_ms']:.0f} ms (<= 1000 ms) from an API write to "
          f"every one of {args.nodes} nodes applying it")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
