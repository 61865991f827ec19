"""`nodeagent server --workers 2` in controller mode, with real processes: the fake API
server, two controllers started with `--server-workers 2`, one server pod with two
workers, one agent.

Asserted: each worker gets its own certificate and routes from the controller; the
controller's count for the node is ready server pods x workers (one pod here: 2), so the
agent holds a tunnel to both workers (without `--server-workers` it would stop at one and
half the requests would get 502); an Ingress is served through both workers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.kube.resources import ENDPOINTSLICES
from nodeagent.server.workers import worker_socket
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import Certs, Upstream, free_port
from tests.e2e.test_kubernetes import (
    controllers,  # noqa: F401 (a fixture)
    seed_identities,
    serve_shop_on_edge,
    start_cluster_agent,
    start_cluster_server,
    wait_for,
)

pytestmark = pytest.mark.needs("root")  # the agent marks its tunnel socket (SO_MARK)


def _server_endpoints(address: str) -> dict[str, Any]:
    """One ready endpoint of Service nodeagent-server: one server pod."""
    return {"metadata": {"name": "nodeagent-server-1", "namespace": "nodeagent",
                         "labels": {"kubernetes.io/service-name": "nodeagent-server"}},
            "addressType": "IPv4",
            "ports": [{"name": "tunnel", "port": 8443, "protocol": "TCP"}],
            "endpoints": [{"addresses": [address], "conditions": {"ready": True}}]}


@pytest.fixture
def workers_cluster(controllers: dict[str, Any], tmp_path: Path,  # noqa: F811
                    certs: Certs, upstream: Upstream) -> Iterator[dict[str, Any]]:
    api, procs = controllers["api"], controllers["procs"]
    ports = {name: free_port() for name in ("tunnel", "http")}
    seed_identities(api, tmp_path, certs)
    api.create(ENDPOINTSLICES, _server_endpoints("10.2.0.1"))
    controller_url = f"https://127.0.0.1:{controllers['ports']['c1']}"
    server = start_cluster_server(
        tmp_path, controller_url, ports["tunnel"], certs.server_cert, certs.server_key,
        "--ingress-http", f"127.0.0.1:{ports['http']}",
        "--state-dir", str(tmp_path / "server-state"), "--workers", "2")
    procs.append(server)
    views = []
    for k in (0, 1):
        view = NodeagentProcess("server", {"debug_socket": str(
            worker_socket(tmp_path / "s.sock", k))}, tmp_path, f"server-w{k}")
        view.log_path = server.log_path  # the workers write to the parent's output
        view.wait_ready(timeout=30)
        views.append(view)
    agent = start_cluster_agent(tmp_path, controller_url, ports["tunnel"])
    procs.append(agent)
    agent.wait_ready(timeout=30)
    yield {"api": api, "http": ports["http"], "server": server, "views": views,
           "agent": agent, "upstream": upstream}
    server.stop(timeout=60)


@pytest.mark.controller_args("--server-workers", "2")
def test_an_agent_holds_every_worker_of_a_server_pod_and_both_serve_ingress(
        workers_cluster: dict[str, Any]) -> None:
    api, port = workers_cluster["api"], workers_cluster["http"]
    agent, views = workers_cluster["agent"], workers_cluster["views"]
    status = agent.wait_for(
        lambda s: {t["server_id"] for t in s["tunnels"] if t["state"] == "open"}
        == {"s1-w0", "s1-w1"}, timeout=150, what="a tunnel to each worker")
    assert status["tunnel"]["replicas"] == 2  # the controller's count: 1 pod x 2 workers
    for k, view in enumerate(views):
        s = view.wait_for(lambda s: s["identity"] and s["identity"]["not_after"]
                          and s["config_watch"]["config_version"] >= 1,
                          what="the worker's certificate and routes")
        assert s["server_id"] == f"s1-w{k}"
        assert s["replicas"] == 2  # routes count 1 pod; the worker announces 1 x 2

    upstream = workers_cluster["upstream"]
    serve_shop_on_edge(api, upstream)

    def served_by_both() -> bool:
        return all(v.status()["http"].get("ingress-http", {}).get("responses_2xx", 0) > 0
                   for v in views)

    def request() -> int:
        return httpx.get(f"http://127.0.0.1:{port}/cart", timeout=5, headers={
            "host": "shop.test", "connection": "close"}).status_code

    wait_for(lambda: request() == 200 and served_by_both(),
             "the Ingress served through both workers", timeout=60)
    codes = [request() for _ in range(30)]
    assert codes == [200] * 30, codes
