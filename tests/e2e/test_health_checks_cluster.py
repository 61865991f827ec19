"""Active health checks in controller mode: the Service's `nodeagent.io/health-check`
annotation goes from the controller to the server (the Ingress rule), the server asks the
agent of the endpoint's node, the agent checks beside the endpoint, and the state comes
back to the server's debug view as the endpoint's /healthz changes."""

from __future__ import annotations

from typing import Any

import pytest

from nodeagent.kube.resources import ENDPOINTSLICES, INGRESSES, NODES, SERVICES
from tests.e2e.test_health_checks import Backend, states
from tests.e2e.test_kubernetes import (
    NS,
    cluster,
    controllers,
    endpoint_slice,
    get,
    ingress,
    wait_for,
    web_endpoint,
)

pytestmark = pytest.mark.needs("root")
__all__ = ["cluster", "controllers"]  # the fixtures, shared with test_kubernetes


def test_the_service_annotation_sets_checks_run_by_the_endpoints_agent(
        cluster: dict[str, Any]) -> None:
    api, port, server, agent = cluster["api"], cluster["http"], cluster["server"], \
        cluster["agent"]
    backend = Backend("web-0")
    try:
        api.replace_status(NODES, "edge-1", None, {"addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"}]})
        api.create(SERVICES, {"metadata": {"name": "web", "namespace": NS}, "spec": {
            "ports": [{"name": "http", "port": 80}]}})
        api.create(ENDPOINTSLICES, endpoint_slice(backend.port, [web_endpoint(api)]))
        api.create(INGRESSES, ingress("a", "a.test", "/"))
        wait_for(lambda: get(port, "a.test", "/").status_code == 200, "Ingress served")
        assert server.status()["backend_health"] == []  # no annotation: no checks

        # The annotation arrives after the Ingress: the translation follows it.
        service = api.get(SERVICES, "web", NS)
        service["metadata"]["annotations"] = {
            "nodeagent.io/health-check": "http:/healthz interval=0.5 healthy=1 unhealthy=1"}
        api.replace(SERVICES, service)
        target = f"127.0.0.1:{backend.port}"
        server.wait_for(lambda s: states(s).get(target) == "healthy", timeout=20,
                        what="the agent reports the endpoint healthy")
        backend.healthy = False
        server.wait_for(lambda s: states(s).get(target) == "unhealthy",
                        what="the agent reports the endpoint unhealthy")
        (row,) = [r for r in agent.status()["health_checks"] if r["target"] == target]
        assert row["kind"] == "http" and "503" in row["detail"]
        # Its only endpoint: still tried (all unhealthy → all tried, as before).
        assert get(port, "a.test", "/").status_code == 200

        # The annotation removed: the checks stop, the state goes.
        service = api.get(SERVICES, "web", NS)
        service["metadata"]["annotations"] = {}
        api.replace(SERVICES, service)
        server.wait_for(lambda s: s["backend_health"] == [], what="checks removed")
    finally:
        backend.close()
