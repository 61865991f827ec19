"""The scale subresource of Deployments, StatefulSets and ReplicaSets, as kube-apiserver
serves it: `GET|PUT|PATCH .../<plural>/<name>/scale` reads and writes an `autoscaling/v1`
`Scale` whose `spec.replicas` is the workload's and whose `status` says how many run and
which pods (the label selector as a string, what an autoscaler lists pods by).

A write goes through the store's update of the workload itself, so it bumps the
workload's generation and resourceVersion and watchers see a MODIFIED workload, as on a
real cluster. A `metadata.resourceVersion` in the Scale is a precondition on the
workload's (kubectl sends one with `--resource-version` or `--current-replicas`).

Differences from kube-apiserver: server-side apply on the subresource is refused (415),
and `status.selector` renders `matchExpressions` only for `In`, `NotIn`, `Exists`,
`DoesNotExist` (all the operators there are).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from nodeagent.testing.fakekube.errors import ApiError, bad_request, invalid
from nodeagent.testing.fakekube.objects import Obj
from nodeagent.testing.fakekube.patch import PatchError, json_patch, merge_patch
from nodeagent.testing.fakekube.registry import ResourceType
from nodeagent.testing.fakekube.store import Store

SCALABLE = frozenset({("apps", "deployments"), ("apps", "statefulsets"),
                      ("apps", "replicasets")})
SCALE_VERBS = ("get", "patch", "update")


def has_scale(rt: ResourceType) -> bool:
    return rt.key in SCALABLE


def discovery_entry(rt: ResourceType) -> Obj:
    """The `<plural>/scale` entry of the group version's resource list: kubectl's scale
    client finds the Scale kind (autoscaling/v1) through it."""
    return {"name": f"{rt.plural}/scale", "singularName": "", "namespaced": rt.namespaced,
            "group": "autoscaling", "version": "v1", "kind": "Scale",
            "verbs": list(SCALE_VERBS)}


def replicas_of(obj: Obj) -> int:
    """`spec.replicas`, defaulted to 1 as the API defaults it for these kinds."""
    value = (obj.get("spec") or {}).get("replicas")
    return 1 if value is None else int(value)


def selector_string(selector: Any) -> str:
    """A LabelSelector as the string form (`metav1.FormatLabelSelector`)."""
    if not isinstance(selector, dict):
        return ""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key", ""), expr.get("operator", ""), expr.get("values")
        joined = ",".join(sorted(values or []))
        if op == "In":
            parts.append(f"{key} in ({joined})")
        elif op == "NotIn":
            parts.append(f"{key} notin ({joined})")
        elif op == "Exists":
            parts.append(key)
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
    return ",".join(parts)


def scale_of(obj: Obj) -> Obj:
    """The Scale view of a workload."""
    meta = obj["metadata"]
    return {
        "kind": "Scale", "apiVersion": "autoscaling/v1",
        "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                          "creationTimestamp") if k in meta},
        "spec": {"replicas": replicas_of(obj)},
        "status": {"replicas": int((obj.get("status") or {}).get("replicas") or 0),
                   "selector": selector_string((obj.get("spec") or {}).get("selector"))},
    }


def serve_scale(store: Store, rt: ResourceType, version: str, namespace: str | None,
                name: str, verb: str, content_type: str, body: bytes,
                field_manager: str | None = None) -> Obj:
    """Answer a get, update or patch of the scale subresource; returns the Scale."""
    live = store.live(rt, namespace, name)
    if verb == "get":
        return scale_of(live)
    current = scale_of(live)
    if verb == "update":
        desired = _decode(body)
    elif verb == "patch":
        desired = _patched(current, content_type, body)
    else:
        raise ApiError(405, "MethodNotAllowed",
                       "the server does not allow this method on the requested resource")
    if not isinstance(desired, dict):
        raise bad_request("the body of the request was in an unknown format")
    kind = desired.get("kind")
    if kind not in (None, "Scale"):
        raise bad_request(f"the kind in the data ({kind}) does not match the expected kind "
                          f"(Scale)")
    replicas = (desired.get("spec") or {}).get("replicas")
    if replicas is None:
        replicas = 0  # an empty spec scales to zero, as the API's defaulting does
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise invalid(rt, name, [("spec.replicas", "FieldValueInvalid",
                                  f"Invalid value: {json.dumps(replicas)}: must be greater "
                                  f"than or equal to 0")])
    rv = (desired.get("metadata") or {}).get("resourceVersion")
    workload = copy.deepcopy(live)
    workload.setdefault("spec", {})["replicas"] = replicas
    if rv:
        workload["metadata"]["resourceVersion"] = rv
    updated = store.update(rt, version, namespace, name, workload,
                           field_manager=field_manager)
    return scale_of(updated)


def _decode(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise bad_request(f"the body of the request was in an unknown format: {exc}") from None


def _patched(current: Obj, content_type: str, body: bytes) -> Any:
    doc = _decode(body)
    try:
        if content_type in ("application/merge-patch+json",
                            "application/strategic-merge-patch+json"):
            if not isinstance(doc, dict):
                raise bad_request("a merge patch must be a JSON object")
            return merge_patch(current, doc)
        if content_type == "application/json-patch+json":
            return json_patch(current, doc)
    except PatchError as exc:
        raise ApiError(exc.code, "Invalid" if exc.code == 422 else "BadRequest",
                       str(exc)) from exc
    raise ApiError(415, "UnsupportedMediaType",
                   f"the body of the request was in an unknown format - accepted media types "
                   f"include: application/json-patch+json, application/merge-patch+json, "
                   f"application/strategic-merge-patch+json (got {content_type})")
