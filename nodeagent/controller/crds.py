"""nodeagent's CustomResourceDefinitions: generated from the pydantic models in
nodeagent/controller/clustertunnel.py, and installed or upgraded by the controller at start.

Generation turns pydantic's JSON Schema into a *structural* OpenAPI v3 schema as the API
server requires (every node typed, no $ref, nullable instead of `anyOf: [X, null]`,
x-kubernetes-int-or-string for int-or-string fields). Fields whose Python model accepts a
short form (a port range as `80` or `"8000-8100"`) get that form in the schema too.

Upgrades follow the usual operator practice: the CRD carries an annotation with the schema
revision it was generated from (CRD_REVISION, bumped with every schema change; a test
fails if the shipped manifest differs from what the model generates). At start the
controller creates the CRD if absent, replaces it if the installed revision is older, and
leaves it alone if it is the same or NEWER — a controller being rolled back must never
downgrade a schema a newer controller already relies on.
"""

from __future__ import annotations

import copy
from typing import Any

from pydantic import BaseModel

from nodeagent.controller.clustertunnel import (
    CLUSTER_TUNNELS,
    CRD_VERSION_ANNOTATION,
    ClusterTunnelSpec,
    ClusterTunnelStatus,
)
from nodeagent.kube import CUSTOMRESOURCEDEFINITIONS, Conflict, KubeClient, NotFound
from nodeagent.ops.logs import get_logger

# 3: status.nodesCovered, nodesConnected; 4: allowedPodPorts; 5: wide printer columns;
# 6: protocol TCP/UDP spellings, intercept rules' dns_zones and dns_resolver; 7: scaleToZero;
# 8: loadBalancers; 9: ingressJwt, ingressRateLimit
CRD_REVISION = 9
log = get_logger("nodeagent.crds")

# Models whose Python side accepts a scalar short form: their schema is that form.
_SHORT_FORMS: dict[str, dict[str, Any]] = {
    "PortRange": {"x-kubernetes-int-or-string": True,
                  "description": "A port (80) or an inclusive range (\"8000-8100\")."},
}
_KEEP = ("type", "description", "enum", "minimum", "maximum", "exclusiveMinimum",
         "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems",
         "x-kubernetes-int-or-string")


def structural(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """pydantic JSON Schema → structural OpenAPI v3 (see the module docstring)."""
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name in _SHORT_FORMS:
            return dict(_SHORT_FORMS[name])
        resolved = structural(defs[name], defs)
        if "description" in schema:
            resolved["description"] = schema["description"]
        return resolved
    options = schema.get("anyOf")
    if options is not None:
        non_null = [o for o in options if o.get("type") != "null"]
        nullable = len(non_null) < len(options)
        types = {o.get("type") for o in non_null}
        if types <= {"integer", "string"} and len(types) == 2:
            out: dict[str, Any] = {"x-kubernetes-int-or-string": True}
        elif len(non_null) == 1 or types == {"string"}:
            out = structural(non_null[0], defs)
        else:
            raise ValueError(f"cannot express {options} in a structural schema")
        if nullable:
            out["nullable"] = True
        if "description" in schema:
            out["description"] = schema["description"]
        return out
    out = {key: copy.deepcopy(schema[key]) for key in _KEEP if key in schema}
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties")
        if props is not None:
            out["properties"] = {name: structural(sub, defs) for name, sub in props.items()}
            required = [n for n in schema.get("required", []) if n in props]
            if required:
                out["required"] = required
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            out["additionalProperties"] = structural(extra, defs)
    elif kind == "array":
        out["items"] = structural(schema.get("items", {"type": "string"}), defs)
    if "type" not in out and "x-kubernetes-int-or-string" not in out:
        raise ValueError(f"schema without a type: {schema}")
    return out


def _model_schema(model: type[BaseModel]) -> dict[str, Any]:
    return structural(model.model_json_schema(by_alias=True, mode="validation"))


def crd_manifests() -> list[dict[str, Any]]:
    """The CRDs nodeagent owns, as the API objects to apply."""
    ct = CLUSTER_TUNNELS
    spec = _model_schema(ClusterTunnelSpec)
    status = _model_schema(ClusterTunnelStatus)
    spec["description"] = ClusterTunnelSpec.__doc__ or ""
    status["description"] = ClusterTunnelStatus.__doc__ or ""
    return [{
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": ct.qualified_name,
            "labels": {"app.kubernetes.io/name": "nodeagent",
                       "app.kubernetes.io/part-of": "nodeagent"},
            "annotations": {CRD_VERSION_ANNOTATION: str(CRD_REVISION)},
        },
        "spec": {
            "group": ct.group,
            "scope": "Cluster",
            "names": {"plural": ct.plural, "singular": ct.kind.lower(), "kind": ct.kind,
                      "listKind": ct.list_kind, "shortNames": ["ct"]},
            "versions": [{
                "name": ct.version,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Server", "type": "string", "jsonPath": ".spec.serverUrl"},
                    {"name": "Nodes", "type": "integer",
                     "jsonPath": ".status.nodesConnected"},
                    {"name": "Version", "type": "integer",
                     "jsonPath": ".status.configVersion"},
                    {"name": "Ready", "type": "string",
                     "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    # -o wide: how many nodes it covers (Nodes counts those connected),
                    # and why it is (not) Ready.
                    {"name": "Covered", "type": "integer", "priority": 1,
                     "jsonPath": ".status.nodesCovered"},
                    {"name": "Reason", "type": "string", "priority": 1,
                     "jsonPath": ".status.conditions[?(@.type==\"Ready\")].reason"},
                ],
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "Tunnel-wide settings of nodeagent: server address, node "
                                   "ports servers may reach, interception and egress.",
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec,
                        "status": status,
                    },
                }},
            }],
        },
    }]


def installed_revision(crd: dict[str, Any]) -> int:
    """The revision annotation of an installed CRD; 0 when absent or unreadable (a CRD
    someone applied by hand without it counts as the oldest)."""
    text = ((crd.get("metadata") or {}).get("annotations") or {}).get(CRD_VERSION_ANNOTATION)
    try:
        return int(text) if text is not None else 0
    except ValueError:
        return 0


async def ensure_crds(kube: KubeClient) -> None:
    """Create missing CRDs, upgrade older ones, never downgrade a newer one."""
    for wanted in crd_manifests():
        name = wanted["metadata"]["name"]
        for _ in range(5):  # a concurrent writer (another replica) → re-read and retry
            try:
                current = await kube.get(CUSTOMRESOURCEDEFINITIONS, name)
            except NotFound:
                try:
                    await kube.create(CUSTOMRESOURCEDEFINITIONS, wanted)
                except Conflict:
                    continue
                log.info("CRD installed", crd=name, revision=CRD_REVISION)
                break
            have = installed_revision(current)
            if have >= CRD_REVISION:
                if have > CRD_REVISION:
                    log.warning("CRD is newer than this controller; leaving it",
                                crd=name, installed=have, ours=CRD_REVISION)
                break
            replacement = dict(wanted)
            replacement["metadata"] = dict(wanted["metadata"], resourceVersion=current[
                "metadata"]["resourceVersion"])
            try:
                await kube.update(CUSTOMRESOURCEDEFINITIONS, replacement)
            except Conflict:
                continue
            log.info("CRD upgraded", crd=name, revision=CRD_REVISION, previous=have)
            break
        else:
            raise RuntimeError(f"CRD {name}: kept conflicting with another writer")
