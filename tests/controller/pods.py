"""Pods that back EndpointSlice endpoints, as a cluster has them: an endpoint is believed
only if its targetRef names a Pod of the Service's namespace on its node with its address
(nodeagent/controller/ingress.py), so tests that are not about that trust give each
endpoint its Pod."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def pod(namespace: str, name: str, node: str, *ips: str, host_network: bool = False,
        ports: Iterable[int] = (), uid: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeName": node, "containers": [
        {"name": "app", "image": "app", "ports": [{"containerPort": p} for p in ports]}]}
    if host_network:
        spec["hostNetwork"] = True
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace,
                         "uid": uid or f"uid-{namespace}-{name}"},
            "spec": spec,
            "status": {"phase": "Running", "podIP": ips[0] if ips else None,
                       "podIPs": [{"ip": ip} for ip in ips]}}


def target_ref(namespace: str, name: str) -> dict[str, str]:
    return {"kind": "Pod", "namespace": namespace, "name": name}


def pods_for(slices: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A Pod for every endpoint that has a nodeName and a targetRef: the one the
    targetRef names, on the endpoint's node, holding its addresses."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for es in slices:
        namespace = (es.get("metadata") or {}).get("namespace", "")
        for endpoint in es.get("endpoints") or []:
            if not isinstance(endpoint, dict):
                continue
            ref = endpoint.get("targetRef")
            if not endpoint.get("nodeName") or not isinstance(ref, dict):
                continue
            key = (ref.get("namespace") or namespace, str(ref.get("name", "")))
            out[key] = pod(*key, endpoint["nodeName"], *(endpoint.get("addresses") or []))
    return list(out.values())
