"""Server-side printing: `meta.k8s.io/v1` Table answers for `kubectl get`
(`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`).

Columns: a CRD's `additionalPrinterColumns` (JSONPath subset: `.a.b`, `[n]`, `[*]`,
`[?(@.path=="value")]`; date columns print as ages), the apiserver's columns for
Deployments, DaemonSets, Pods, Services, ConfigMaps, Secrets, Namespaces, Nodes, Ingresses,
RoleBindings and PodDisruptionBudgets, `NAME CREATED AT` for Roles, ClusterRoles and
CRDs, and NAME/AGE for every other type. Rows carry the object's metadata
(`includeObject=Metadata`, the default), the whole object (`Object`) or nothing (`None`).

Differences from a real cluster: watches are never served as Tables (`kubectl get -w`
prints nothing useful), and only the types named above have their specific columns.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from nodeagent.testing.fakekube.errors import ApiError, bad_request
from nodeagent.testing.fakekube.registry import ResourceType

Obj = dict[str, Any]
Cell = Callable[[Obj], Any]


def wants_table(accept: str) -> bool:
    """Whether the first media type the client accepts is a meta.k8s.io Table."""
    for entry in accept.split(","):
        kind, *params = (p.strip() for p in entry.split(";"))
        options = dict(p.split("=", 1) for p in params if "=" in p)
        if kind not in ("application/json", "*/*", "application/*"):
            continue
        return options.get("as") == "Table" and options.get("g") == "meta.k8s.io"
    return False


def human_duration(seconds: float) -> str:
    """`duration.HumanDuration`: the AGE column's words."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = hours // 24 % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def age(timestamp: Any) -> str:
    if not isinstance(timestamp, str) or not timestamp:
        return "<unknown>"
    try:
        moment = datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError:
        return "<unknown>"
    return human_duration(time.time() - moment.timestamp())


# -- a JSONPath subset, enough for printer columns ----------------------------------------------

_STEP = re.compile(r"""\.(?P<field>[A-Za-z0-9_\-$]+)|\[(?P<index>-?\d+|\*)\]|"""
                   r"""\[\?\(@(?P<fpath>(?:\.[A-Za-z0-9_\-]+)+)\s*==\s*(?P<fval>"[^"]*"|'[^']*'"""
                   r"""|-?\d+|true|false)\)\]""")


def parse_jsonpath(path: str) -> list[re.Match[str]]:
    text = path.strip()
    if text.startswith("{") and text.endswith("}"):
        text = text[1:-1]
    steps, pos = [], 0
    while pos < len(text):
        m = _STEP.match(text, pos)
        if m is None:
            raise ValueError(f"unsupported JSONPath {path!r} at {text[pos:]!r}")
        steps.append(m)
        pos = m.end()
    return steps


def _literal(text: str) -> Any:
    if text[0] in "\"'":
        return text[1:-1]
    if text in ("true", "false"):
        return text == "true"
    return int(text)


def evaluate(steps: list[re.Match[str]], obj: Any) -> list[Any]:
    values = [obj]
    for step in steps:
        out: list[Any] = []
        for v in values:
            if step["field"] is not None:
                if isinstance(v, dict) and step["field"] in v:
                    out.append(v[step["field"]])
            elif step["index"] is not None:
                if isinstance(v, list):
                    if step["index"] == "*":
                        out.extend(v)
                    elif -len(v) <= int(step["index"]) < len(v):
                        out.append(v[int(step["index"])])
            elif isinstance(v, list):
                want = _literal(step["fval"])
                sub = parse_jsonpath(step["fpath"])
                out.extend(item for item in v if want in evaluate(sub, item))
        values = out
    return values


# -- columns ------------------------------------------------------------------------------------

def _col(name: str, type_: str = "string", *, fmt: str = "", priority: int = 0,
         description: str = "") -> Obj:
    return {"name": name, "type": type_, "format": fmt, "description": description,
            "priority": priority}


def _get(obj: Obj, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return default
        obj = obj[key]
    return obj


def _name(o: Obj) -> Any:
    return o["metadata"]["name"]


def _age(o: Obj) -> Any:
    return age(o["metadata"].get("creationTimestamp"))


def _created(o: Obj) -> Any:
    return o["metadata"].get("creationTimestamp")


NAME = (_col("Name", fmt="name", description="Name must be unique within a namespace."),
        _name)
AGE = (_col("Age", description="CreationTimestamp is a timestamp representing the server "
                                "time when this object was created."), _age)
CREATED_AT = (_col("Created At", "date"), _created)


def _pod_ready(o: Obj) -> str:
    statuses = _get(o, "status", "containerStatuses", default=[]) or []
    total = len(_get(o, "spec", "containers", default=[]) or [])
    return f"{sum(1 for s in statuses if s.get('ready'))}/{total}"


def _service_ports(o: Obj) -> str:
    ports = []
    for p in _get(o, "spec", "ports", default=[]) or []:
        node = f":{p['nodePort']}" if p.get("nodePort") else ""
        ports.append(f"{p.get('port')}{node}/{p.get('protocol', 'TCP')}")
    return ",".join(ports) or "<none>"


def _service_external_ip(o: Obj) -> str:
    """kubectl's EXTERNAL-IP: for a LoadBalancer its status addresses (or <pending>) and
    spec.externalIPs, as kube-apiserver's printer gives them (not wide: cut at 16)."""
    external = list(_get(o, "spec", "externalIPs", default=[]) or [])
    if _get(o, "spec", "type", default="ClusterIP") != "LoadBalancer":
        return ",".join(external) or "<none>"
    found = [e.get("ip") or e.get("hostname") or "" for e in
             _get(o, "status", "loadBalancer", "ingress", default=[]) or []
             if isinstance(e, dict)]
    text = ",".join(a for a in found if a)
    if len(text) > 16:
        text = text[:16] + "..."
    return ",".join([*([text] if text else []), *external]) or "<pending>"


def _node_status(o: Obj) -> str:
    ready = [c for c in _get(o, "status", "conditions", default=[]) or []
             if c.get("type") == "Ready"]
    status = "Unknown" if not ready else "Ready" if ready[0].get("status") == "True" \
        else "NotReady"
    return status + (",SchedulingDisabled" if _get(o, "spec", "unschedulable") else "")


def _node_roles(o: Obj) -> str:
    prefix = "node-role.kubernetes.io/"
    roles = sorted(k.removeprefix(prefix) for k in o["metadata"].get("labels") or {}
                   if k.startswith(prefix))
    return ",".join(roles) or "<none>"


def _ingress_hosts(o: Obj) -> str:
    hosts = [r.get("host") for r in _get(o, "spec", "rules", default=[]) or [] if r.get("host")]
    return ",".join(hosts) or "*"


def _ingress_address(o: Obj) -> str:
    lbs = _get(o, "status", "loadBalancer", "ingress", default=[]) or []
    return ",".join(i.get("ip") or i.get("hostname") or "" for i in lbs)


def _containers(o: Obj, what: str) -> str:
    spec = _get(o, "spec", "template", "spec", default={}) or {}
    return ",".join(c.get(what, "") for c in spec.get("containers") or []) or "<none>"


def _selector(o: Obj) -> str:
    labels = _get(o, "spec", "selector", "matchLabels", default={}) or {}
    return ",".join(f"{k}={v}" for k, v in labels.items()) or "<none>"


def _subjects(o: Obj, kind: str) -> str:
    return ",".join(
        (f"{s.get('namespace', '')}/{s['name']}" if kind == "ServiceAccount" else s["name"])
        for s in o.get("subjects") or [] if s.get("kind") == kind)


def _int_or(value: Any) -> Any:
    return "N/A" if value is None else value


_COLUMNS: dict[tuple[str, str], list[tuple[Obj, Cell]]] = {
    ("apps", "deployments"): [
        NAME,
        (_col("Ready"), lambda o: f"{_get(o, 'status', 'readyReplicas', default=0)}/"
                                  f"{_get(o, 'spec', 'replicas', default=1)}"),
        (_col("Up-to-date", "integer"), lambda o: _get(o, "status", "updatedReplicas",
                                                       default=0)),
        (_col("Available", "integer"), lambda o: _get(o, "status", "availableReplicas",
                                                      default=0)),
        AGE,
        (_col("Containers", priority=1), lambda o: _containers(o, "name")),
        (_col("Images", priority=1), lambda o: _containers(o, "image")),
        (_col("Selector", priority=1), _selector),
    ],
    ("apps", "daemonsets"): [
        NAME,
        *((_col(title, "integer"), lambda o, f=field: _get(o, "status", f, default=0))
          for title, field in (("Desired", "desiredNumberScheduled"),
                               ("Current", "currentNumberScheduled"),
                               ("Ready", "numberReady"),
                               ("Up-to-date", "updatedNumberScheduled"),
                               ("Available", "numberAvailable"))),
        (_col("Node Selector"), lambda o: ",".join(
            f"{k}={v}" for k, v in (_get(o, "spec", "template", "spec", "nodeSelector",
                                         default={}) or {}).items()) or "<none>"),
        AGE,
    ],
    ("", "pods"): [
        NAME,
        (_col("Ready"), _pod_ready),
        (_col("Status"), lambda o: _get(o, "status", "phase", default="Unknown")),
        (_col("Restarts", "string"), lambda o: str(sum(
            s.get("restartCount", 0)
            for s in _get(o, "status", "containerStatuses", default=[]) or []))),
        AGE,
        (_col("IP", priority=1), lambda o: _get(o, "status", "podIP", default="<none>")),
        (_col("Node", priority=1), lambda o: _get(o, "spec", "nodeName", default="<none>")),
    ],
    ("", "services"): [
        NAME,
        (_col("Type"), lambda o: _get(o, "spec", "type", default="ClusterIP")),
        (_col("Cluster-IP"), lambda o: _get(o, "spec", "clusterIP", default="<none>")),
        (_col("External-IP"), _service_external_ip),
        (_col("Port(s)"), _service_ports),
        AGE,
        (_col("Selector", priority=1), lambda o: ",".join(
            f"{k}={v}" for k, v in (_get(o, "spec", "selector", default={}) or {}).items())
            or "<none>"),
    ],
    ("", "configmaps"): [
        NAME,
        (_col("Data", "integer"), lambda o: len(o.get("data") or {})
         + len(o.get("binaryData") or {})),
        AGE,
    ],
    ("", "secrets"): [
        NAME, (_col("Type"), lambda o: o.get("type", "")),
        (_col("Data", "integer"), lambda o: len(o.get("data") or {})), AGE,
    ],
    ("", "namespaces"): [
        NAME, (_col("Status"), lambda o: _get(o, "status", "phase", default="")), AGE,
    ],
    ("", "nodes"): [
        NAME, (_col("Status"), _node_status), (_col("Roles"), _node_roles), AGE,
        (_col("Version"), lambda o: _get(o, "status", "nodeInfo", "kubeletVersion",
                                         default="")),
    ],
    ("networking.k8s.io", "ingresses"): [
        NAME,
        (_col("Class"), lambda o: _get(o, "spec", "ingressClassName", default="<none>")),
        (_col("Hosts"), _ingress_hosts),
        (_col("Address"), _ingress_address),
        (_col("Ports"), lambda o: "80, 443" if _get(o, "spec", "tls") else "80"),
        AGE,
    ],
    ("rbac.authorization.k8s.io", "roles"): [NAME, CREATED_AT],
    ("rbac.authorization.k8s.io", "clusterroles"): [NAME, CREATED_AT],
    ("apiextensions.k8s.io", "customresourcedefinitions"): [NAME, CREATED_AT],
    ("policy", "poddisruptionbudgets"): [
        NAME,
        (_col("Min Available"), lambda o: _int_or(_get(o, "spec", "minAvailable"))),
        (_col("Max Unavailable"), lambda o: _int_or(_get(o, "spec", "maxUnavailable"))),
        (_col("Allowed Disruptions", "integer"), lambda o: _get(
            o, "status", "disruptionsAllowed", default=0)),
        AGE,
    ],
}
for _kind in ("rolebindings", "clusterrolebindings"):
    _COLUMNS[("rbac.authorization.k8s.io", _kind)] = [
        NAME,
        (_col("Role"), lambda o: f"{_get(o, 'roleRef', 'kind')}/{_get(o, 'roleRef', 'name')}"),
        AGE,
        (_col("Users", priority=1), lambda o: _subjects(o, "User")),
        (_col("Groups", priority=1), lambda o: _subjects(o, "Group")),
        (_col("ServiceAccounts", priority=1), lambda o: _subjects(o, "ServiceAccount")),
    ]


def _custom_columns(printer_columns: list[Obj]) -> list[tuple[Obj, Cell]]:
    columns: list[tuple[Obj, Cell]] = [NAME]
    for c in printer_columns:
        steps = parse_jsonpath(c["jsonPath"])
        kind = c.get("type", "string")

        def cell(o: Obj, steps: list[re.Match[str]] = steps, kind: str = kind) -> Any:
            found = evaluate(steps, o)
            if not found:
                return None
            if kind == "date":
                return age(found[0])
            if len(found) == 1:
                return found[0]
            return ",".join(str(v) for v in found)

        columns.append((_col(c["name"], kind, fmt=c.get("format", ""),
                             priority=int(c.get("priority", 0)),
                             description=c.get("description", "")), cell))
    return columns


def columns_for(rt: ResourceType, version: str) -> list[tuple[Obj, Cell]]:
    if rt.custom:
        printer = rt.printer_columns.get(version)
        if printer is None:
            printer = [{"name": "Age", "type": "date",
                        "jsonPath": ".metadata.creationTimestamp"}]
        return _custom_columns(printer)
    return _COLUMNS.get(rt.key, [NAME, AGE])


def to_table(rt: ResourceType, version: str, doc: Obj, include_object: str | None) -> Obj:
    """The Table for a list or a single object as served at `version`."""
    include = include_object or "Metadata"
    if include not in ("None", "Metadata", "Object"):
        raise bad_request(f'includeObject: Unsupported value: "{include}": supported values: '
                          '"None", "Metadata", "Object"')
    try:
        columns = columns_for(rt, version)
    except ValueError as exc:
        raise ApiError(500, "InternalError", str(exc)) from exc
    is_list = isinstance(doc.get("items"), list)
    items = doc["items"] if is_list else [doc]
    rows = []
    for item in items:
        row: Obj = {"cells": [cell(item) for _, cell in columns]}
        if include == "Metadata":
            row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                             "metadata": item["metadata"]}
        elif include == "Object":
            row["object"] = {"apiVersion": rt.api_version(version), "kind": rt.kind, **item}
        rows.append(row)
    meta: Obj = {}
    if is_list:
        meta = {k: v for k, v in (doc.get("metadata") or {}).items()
                if k in ("resourceVersion", "continue", "remainingItemCount")}
    else:
        meta = {"resourceVersion": doc["metadata"].get("resourceVersion", "")}
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta,
            "columnDefinitions": [c for c, _ in columns], "rows": rows}
