"""Admission of the built-in kinds: the defaulting and validation kube-apiserver applies on
create and update before an object is stored.

`validate_metadata` checks names (per kind: RFC 1123 subdomain or label, DNS-1035 label,
RBAC path segment), label syntax and annotation types; `admit` defaults and validates the
kinds that have rules here (Secrets, Services, Namespaces, Pods, EndpointSlices, Ingresses,
CRDs, RBAC via `rbacvalidation.py`, PodDisruptionBudgets); `admit_custom` prunes, defaults
and validates a custom object against its CRD schema (`schema.py`). Problems are collected
as field causes and raised as one 422 Invalid, as the real server does.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from typing import Any

from nodeagent.testing.fakekube import schema as schemas
from nodeagent.testing.fakekube.errors import Causes, bad_request, invalid
from nodeagent.testing.fakekube.objects import Obj
from nodeagent.testing.fakekube.rbacvalidation import admit as admit_rbac
from nodeagent.testing.fakekube.registry import RBAC, ResourceType
from nodeagent.testing.fakekube.selectors import SelectorError, parse_label_selector
from nodeagent.testing.fakekube.servicestatus import admit_load_balancer_class

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?\Z")


class ClusterIPs:
    """Hands out Service cluster IPs from 10.96.0.0/12, in order."""

    def __init__(self) -> None:
        self._next = 10

    def allocate(self) -> str:
        ip = str(ipaddress.ip_address("10.96.0.0") + self._next)
        self._next += 1
        return ip


def validate_metadata(rt: ResourceType, obj: Obj) -> Causes:
    """Name, label and annotation problems of `obj` (its `metadata` is a dict)."""
    meta = obj["metadata"]
    name = meta.get("name", "")
    causes = []
    pattern, limit, what = _SUBDOMAIN, 253, "a lowercase RFC 1123 subdomain"
    if rt.key in (("", "namespaces"),):
        pattern, limit, what = _LABEL, 63, "a lowercase RFC 1123 label"
    elif rt.key == ("", "services"):
        pattern, limit, what = _DNS1035, 63, "a DNS-1035 label"
    if rt.group == RBAC:  # any path segment name ("system:discovery")
        if name in ("", ".", "..") or "/" in name or "%" in name:
            causes.append(("metadata.name", "FieldValueInvalid",
                           f'Invalid value: "{name}": may not contain \'/\' or \'%\''))
    elif not pattern.match(name) or len(name) > limit:
        causes.append(("metadata.name", "FieldValueInvalid",
                       f'Invalid value: "{name}": {what} must consist of lower case '
                       "alphanumeric characters or '-'"))
    for k, v in (meta.get("labels") or {}).items():
        try:
            parse_label_selector(f"{k}={v}" if v else f"{k}")
        except SelectorError as exc:
            causes.append(("metadata.labels", "FieldValueInvalid",
                           f'Invalid value: "{k}={v}": {exc}'))
        if not isinstance(v, str):
            causes.append((f"metadata.labels.{k}", "FieldValueTypeInvalid",
                           "label values must be strings"))
    for k, v in (meta.get("annotations") or {}).items():
        if not isinstance(v, str):
            causes.append((f"metadata.annotations.{k}", "FieldValueTypeInvalid",
                           "annotation values must be strings"))
    return causes


def admit_custom(rt: ResourceType, obj: Obj) -> Obj:
    """Prune, default and validate a custom object against its version's schema."""
    version = obj["apiVersion"].rpartition("/")[2]
    schema = rt.schemas.get(version) or rt.schemas.get(rt.versions[0])
    if not schema:
        return obj
    pruned = schemas.prune(obj, schema, root=True)
    defaulted = schemas.default(pruned, schema)
    causes = schemas.validate(defaulted, schema, root=True)
    if causes:
        raise invalid(rt, obj["metadata"].get("name", ""), causes)
    return dict(defaulted)


def check_unknown_fields(rt: ResourceType, version: str, doc: Any) -> None:
    """`fieldValidation=Strict` on a custom object (a create, an update, or a merge or
    apply patch): a field its structural schema does not declare is a 400, as the API
    server's strict decoding says it, instead of being pruned."""
    schema = rt.schemas.get(version) or rt.schemas.get(rt.versions[0])
    if not schema or not isinstance(doc, dict):
        return
    unknown = schemas.unknown_fields(doc, schema, root=True)
    if unknown:
        fields = ", ".join(f'unknown field "{field}"' for field in unknown)
        raise bad_request(f'{rt.kind} in version "{version}" cannot be handled as a '
                          f"{rt.kind}: strict decoding error: {fields}")


def admit(rt: ResourceType, obj: Obj, old: Obj | None, cluster_ips: ClusterIPs) -> None:
    """Defaulting and validation the real API server applies to these types."""
    name = obj["metadata"].get("name", "")
    causes: Causes = []
    if rt.key == ("", "secrets"):
        _admit_secret(rt, obj, old, causes)
    elif rt.key == ("", "services"):
        _admit_service(obj, old, causes, cluster_ips)
    elif rt.key == ("", "namespaces") and old is None:
        obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
        obj["status"] = {"phase": "Active"}
    elif rt.key == ("", "pods") and old is None:
        obj.setdefault("status", {}).setdefault("phase", "Pending")
    elif rt.key == ("discovery.k8s.io", "endpointslices"):
        if obj.get("addressType") not in ("IPv4", "IPv6", "FQDN"):
            causes.append(("addressType", "FieldValueRequired" if "addressType" not in obj
                           else "FieldValueNotSupported",
                           'Unsupported value: supported values: "FQDN", "IPv4", "IPv6"'))
        if old is not None and old.get("addressType") != obj.get("addressType"):
            causes.append(("addressType", "FieldValueInvalid", "field is immutable"))
    elif rt.key == ("networking.k8s.io", "ingresses"):
        _admit_ingress(obj, causes)
    elif rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
        _admit_crd(obj, old, causes)
    elif rt.group == RBAC:
        admit_rbac(rt, obj, old, causes)
    elif rt.key == ("policy", "poddisruptionbudgets"):
        _admit_pdb(obj, old, causes)
    if causes:
        raise invalid(rt, name, causes)


def _admit_service(obj: Obj, old: Obj | None, causes: Causes,
                   cluster_ips: ClusterIPs) -> None:
    spec = obj.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    admit_load_balancer_class(spec, (old or {}).get("spec") if old else None, causes)
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))
    if spec["type"] == "ExternalName":
        return
    if old is not None:
        old_ip = (old.get("spec") or {}).get("clusterIP")
        spec.setdefault("clusterIP", old_ip)
        if spec["clusterIP"] != old_ip:
            causes.append(("spec.clusterIP", "FieldValueInvalid",
                           f'Invalid value: "{spec["clusterIP"]}": field is immutable'))
    elif not spec.get("clusterIP"):
        spec["clusterIP"] = cluster_ips.allocate()
    if spec.get("clusterIP"):
        spec["clusterIPs"] = [spec["clusterIP"]]


def _admit_secret(rt: ResourceType, obj: Obj, old: Obj | None,
                  causes: Causes) -> None:
    string_data = obj.pop("stringData", None) or {}
    data = dict(obj.get("data") or {})
    for key, value in string_data.items():
        data[key] = base64.b64encode(str(value).encode()).decode()
    for key, value in data.items():
        try:
            base64.b64decode(value, validate=True)
        except (binascii.Error, TypeError, ValueError) as exc:
            raise bad_request(f'Secret in version "v1" cannot be handled as a Secret: illegal '
                              f"base64 data at key {key!r}: {exc}") from exc
        if not re.fullmatch(r"[-._a-zA-Z0-9]+", key):
            causes.append((f"data[{key}]", "FieldValueInvalid",
                           f'Invalid value: "{key}": a valid config key must consist of '
                           "alphanumeric characters, '-', '_' or '.'"))
    if data:
        obj["data"] = data
    else:
        obj.pop("data", None)
    obj.setdefault("type", "Opaque")
    if obj["type"] == "kubernetes.io/tls":
        for required in ("tls.crt", "tls.key"):
            if required not in data:
                causes.append((f"data[{required}]", "FieldValueRequired", "Required value"))
    if old is not None:
        if obj["type"] != old.get("type"):
            causes.append(("type", "FieldValueInvalid",
                           f'Invalid value: "{obj["type"]}": field is immutable'))
        if old.get("immutable") and (obj.get("data") != old.get("data")
                                     or not obj.get("immutable")):
            causes.append(("data", "FieldValueForbidden",
                           "Forbidden: field is immutable when `immutable` is set"))


def _admit_ingress(obj: Obj, causes: Causes) -> None:
    spec = obj.get("spec") or {}

    def check_backend(backend: Any, field: str) -> None:
        if not isinstance(backend, dict):
            causes.append((field, "FieldValueRequired", "Required value"))
            return
        service, resource = backend.get("service"), backend.get("resource")
        if bool(service) == bool(resource):
            causes.append((field, "FieldValueInvalid",
                           "Invalid value: cannot set both resource and service backends"
                           if service else "Required value: one backend must be specified"))
        if service:
            if not service.get("name"):
                causes.append((f"{field}.service.name", "FieldValueRequired", "Required value"))
            port = service.get("port") or {}
            if bool(port.get("name")) == bool(port.get("number")):
                causes.append((f"{field}.service.port", "FieldValueInvalid",
                               "Invalid value: exactly one of port name or number must be set"))

    if spec.get("defaultBackend") is not None:
        check_backend(spec["defaultBackend"], "spec.defaultBackend")
    for i, rule in enumerate(spec.get("rules") or []):
        host = rule.get("host")
        if host is not None and (host.startswith("*") and not host.startswith("*.")):
            causes.append((f"spec.rules[{i}].host", "FieldValueInvalid",
                           f'Invalid value: "{host}": a wildcard DNS-1123 subdomain must start '
                           "with '*.'"))
        http = rule.get("http")
        if http is None:
            continue
        paths = http.get("paths")
        if not paths:
            causes.append((f"spec.rules[{i}].http.paths", "FieldValueRequired",
                           "Required value"))
        for j, path in enumerate(paths or []):
            field = f"spec.rules[{i}].http.paths[{j}]"
            kind = path.get("pathType")
            if kind not in ("Exact", "Prefix", "ImplementationSpecific"):
                causes.append((f"{field}.pathType", "FieldValueRequired" if kind is None
                               else "FieldValueNotSupported",
                               'Unsupported value: supported values: "Exact", '
                               '"ImplementationSpecific", "Prefix"'))
            value = path.get("path", "")
            if kind in ("Exact", "Prefix") and not str(value).startswith("/"):
                causes.append((f"{field}.path", "FieldValueInvalid",
                               f'Invalid value: "{value}": must be an absolute path'))
            if kind in ("Exact", "Prefix") and re.search(r"//|/\./|/\.\./|%2f|%2F", str(value)):
                causes.append((f"{field}.path", "FieldValueInvalid",
                               f'Invalid value: "{value}": must not contain invalid '
                               "sequences"))
            check_backend(path.get("backend"), f"{field}.backend")
    for i, tls in enumerate(spec.get("tls") or []):
        if not isinstance(tls, dict):
            causes.append((f"spec.tls[{i}]", "FieldValueTypeInvalid", "must be an object"))


def _admit_pdb(obj: Obj, old: Obj | None, causes: Causes) -> None:
    spec = obj.get("spec") or {}
    if "minAvailable" in spec and "maxUnavailable" in spec:
        causes.append(("spec", "FieldValueInvalid", "Invalid value: minAvailable and "
                                                    "maxUnavailable cannot be both set"))
    for key in ("minAvailable", "maxUnavailable"):
        value = spec.get(key)
        if isinstance(value, str) and not re.fullmatch(r"\d+%", value):
            causes.append((f"spec.{key}", "FieldValueInvalid",
                           f'Invalid value: "{value}": a valid percent string must be a '
                           "numeric string followed by an ending '%'"))
        elif isinstance(value, int) and value < 0:
            causes.append((f"spec.{key}", "FieldValueInvalid",
                           f"Invalid value: {value}: must be greater than or equal to 0"))
    if old is None:
        # The disruption controller fills this in; a new PDB starts with the empty status.
        obj["status"] = {"disruptionsAllowed": 0, "currentHealthy": 0, "desiredHealthy": 0,
                         "expectedPods": 0}


def _admit_crd(crd: Obj, old: Obj | None, causes: Causes) -> None:
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group, plural = spec.get("group"), names.get("plural")
    for field, value in (("spec.group", group), ("spec.names.plural", plural),
                         ("spec.names.kind", names.get("kind"))):
        if not value:
            causes.append((field, "FieldValueRequired", "Required value"))
    if group and plural and crd["metadata"].get("name") != f"{plural}.{group}":
        causes.append(("metadata.name", "FieldValueInvalid",
                       f'Invalid value: "{crd["metadata"].get("name")}": must be '
                       "spec.names.plural+\".\"+spec.group"))
    if spec.get("scope") not in ("Namespaced", "Cluster"):
        causes.append(("spec.scope", "FieldValueNotSupported",
                       'Unsupported value: supported values: "Cluster", "Namespaced"'))
    versions = spec.get("versions") or []
    if not versions:
        causes.append(("spec.versions", "FieldValueInvalid", "Invalid value: must have "
                                                             "exactly one version marked as "
                                                             "storage version"))
    elif sum(1 for v in versions if v.get("storage")) != 1:
        causes.append(("spec.versions", "FieldValueInvalid",
                       "Invalid value: must have exactly one version marked as storage "
                       "version"))
    for i, v in enumerate(versions):
        if not (v.get("schema") or {}).get("openAPIV3Schema"):
            causes.append((f"spec.versions[{i}].schema.openAPIV3Schema", "FieldValueRequired",
                           "Required value: schemas are required"))
    if old is not None:
        old_spec = old.get("spec") or {}
        if old_spec.get("scope") != spec.get("scope"):
            causes.append(("spec.scope", "FieldValueInvalid", "field is immutable"))
        if old_spec.get("group") != group:
            causes.append(("spec.group", "FieldValueInvalid", "field is immutable"))
