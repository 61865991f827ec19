"""OpenAPI v3 for kubectl: the `/openapi/v3` index and one document per group-version.

Built-in schemas come from the offline JSON schemas of the kubernetes-validate package (the
ones tests/test_manifests.py validates with), converted to OpenAPI (`$ref` into
`components/schemas`, nullable type lists collapsed, int-or-string marked); each document
holds the kinds of its group-version with every definition they reference. CRD kinds get
their structural `openAPIV3Schema` with apiVersion/kind/metadata added, as the apiserver
publishes them. Each kind has list/create/get/replace/patch/delete operations tagged with
`x-kubernetes-group-version-kind`, the PATCH one declaring the `fieldValidation` query
parameter: that is how kubectl decides the server validates fields itself, so `kubectl
apply` (validation on, the default) sends `fieldValidation=Strict` instead of validating
client-side, and `kubectl explain` reads the schemas.

Differences from a real cluster: `fieldValidation=Strict` rejects unknown fields of CRD
objects (admission.check_unknown_fields) but not of built-in kinds (only Strict: Warn and
Ignore prune silently); operations carry no request/response details beyond the kind's
schema; there is no OpenAPI v2 (`/openapi/v2`), which kubectl 1.32 needs only when v3 is missing.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate

from nodeagent.testing.fakekube.registry import ResourceType

Obj = dict[str, Any]
_SCHEMA_ROOT = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"


@functools.lru_cache(maxsize=2)
def builtin_definitions(minor: int = 31) -> dict[str, Obj]:
    """The Kubernetes 1.<minor> definitions as OpenAPI v3 schemas (nearest version held)."""
    held = sorted((int(m[1]), p) for p in _SCHEMA_ROOT.iterdir()
                  if (m := re.fullmatch(r"v1\.(\d+)\.\d+-local", p.name)))
    directory = min(held, key=lambda h: abs(h[0] - minor))[1]
    raw = json.loads((directory / "_definitions.json").read_text())["$defs"]
    return {name: _to_openapi(schema) for name, schema in raw.items()}


def _to_openapi(node: Any) -> Any:
    if isinstance(node, list):
        return [_to_openapi(n) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        return {"$ref": node["$ref"].replace("#/$defs/", "#/components/schemas/")}
    one_of = node.get("oneOf")
    if isinstance(one_of, list) and sorted(
            str(_to_openapi(o).get("type")) for o in one_of) == ["integer", "string"]:
        return {"x-kubernetes-int-or-string": True,
                "anyOf": [{"type": "integer"}, {"type": "string"}]}
    out: Obj = {}
    for key, value in node.items():
        if key == "$schema":
            continue
        if key == "type" and isinstance(value, list):
            kinds = [t for t in value if t != "null"]
            if len(kinds) == 1:
                out["type"] = kinds[0]
            continue
        if key in ("properties", "patternProperties"):
            out[key] = {k: _to_openapi(v) for k, v in value.items()}
        else:
            out[key] = _to_openapi(value)
    return out


def _refs(node: Any, found: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            found.add(ref.rsplit("/", 1)[-1])
        for value in node.values():
            _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)


def _closure(names: set[str], defs: dict[str, Obj]) -> dict[str, Obj]:
    out: dict[str, Obj] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in out or name not in defs:
            continue
        out[name] = defs[name]
        found: set[str] = set()
        _refs(defs[name], found)
        todo.extend(found - set(out))
    return out


def _builtin_name(rt: ResourceType, version: str, defs: dict[str, Obj]) -> str | None:
    api_version = rt.api_version(version)
    for name, schema in defs.items():
        if not name.endswith(f".{version}.{rt.kind}"):
            continue
        enum = ((schema.get("properties") or {}).get("apiVersion") or {}).get("enum")
        if enum is None or api_version in enum:
            return name
    return None


def _custom_name(rt: ResourceType, version: str) -> str:
    return ".".join(reversed(rt.group.split("."))) + f".{version}.{rt.kind}"


def _custom_schema(rt: ResourceType, version: str) -> Obj:
    schema = copy.deepcopy(rt.schemas.get(version) or {"type": "object"})
    props = schema.setdefault("properties", {})
    props.setdefault("apiVersion", {"type": "string", "description": "APIVersion defines "
                                    "the versioned schema of this representation of an "
                                    "object."})
    props.setdefault("kind", {"type": "string", "description": "Kind is a string value "
                              "representing the REST resource this object represents."})
    props["metadata"] = {"$ref": f"#/components/schemas/{OBJECT_META}",
                         "description": "Standard object's metadata."}
    return schema


def _gvk(rt: ResourceType, version: str) -> Obj:
    return {"group": rt.group, "version": version, "kind": rt.kind}


def _operation(rt: ResourceType, version: str, action: str, ref: str, *,
               params: tuple[str, ...] = ()) -> Obj:
    verb = {"list": "list", "post": "create", "get": "read", "put": "replace",
            "patch": "patch", "delete": "delete"}[action]
    group = "".join(p.capitalize() for p in rt.group.split(".")[:1]) or "Core"
    scope = "Namespaced" if rt.namespaced else ""
    schema = {"$ref": ref}
    op: Obj = {
        "operationId": f"{verb}{group}{version.capitalize()}{scope}{rt.kind}",
        "parameters": [{"name": p, "in": "query", "schema": {"type": "string",
                                                             "uniqueItems": True}}
                       for p in params],
        "responses": {"200": {"description": "OK", "content": {
            "application/json": {"schema": schema}}}},
        "x-kubernetes-action": {"list": "list", "post": "post", "get": "get",
                                "put": "put", "patch": "patch",
                                "delete": "delete"}[action],
        "x-kubernetes-group-version-kind": _gvk(rt, version),
    }
    if action in ("post", "put"):
        op["requestBody"] = {"content": {"*/*": {"schema": schema}}, "required": True}
    if action == "patch":
        op["requestBody"] = {"content": {t: {"schema": {"type": "object"}} for t in (
            "application/apply-patch+yaml", "application/json-patch+json",
            "application/merge-patch+json", "application/strategic-merge-patch+json")},
            "required": True}
    return op


_WRITE = ("dryRun", "fieldManager", "fieldValidation")


def _paths(rt: ResourceType, version: str, ref: str) -> dict[str, Obj]:
    base = f"/apis/{rt.group}/{version}" if rt.group else f"/api/{version}"
    collection = (f"{base}/namespaces/{{namespace}}/{rt.plural}" if rt.namespaced
                  else f"{base}/{rt.plural}")
    item = f"{collection}/{{name}}"
    writable = "update" in rt.verbs
    paths: dict[str, Obj] = {}
    if not rt.stored:
        return {collection: {"post": _operation(rt, version, "post", ref, params=_WRITE)}}
    paths[collection] = {"get": _operation(rt, version, "list", ref),
                         "post": _operation(rt, version, "post", ref, params=_WRITE)}
    paths[item] = {"get": _operation(rt, version, "get", ref),
                   "delete": _operation(rt, version, "delete", ref, params=("dryRun",))}
    if writable:
        paths[item]["put"] = _operation(rt, version, "put", ref, params=_WRITE)
        paths[item]["patch"] = _operation(rt, version, "patch", ref,
                                          params=(*_WRITE, "force"))
    if rt.status:
        paths[f"{item}/status"] = {
            "get": _operation(rt, version, "get", ref),
            "put": _operation(rt, version, "put", ref, params=_WRITE),
            "patch": _operation(rt, version, "patch", ref, params=(*_WRITE, "force"))}
    return paths


def group_version_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def document(types: list[ResourceType], group: str, version: str) -> Obj | None:
    """The OpenAPI v3 document of one group-version, or None if nothing serves it."""
    served = [rt for rt in types if rt.group == group and version in rt.versions]
    if not served:
        return None
    defs = builtin_definitions()
    schemas: dict[str, Obj] = {}
    paths: dict[str, Obj] = {}
    wanted: set[str] = set()
    for rt in served:
        if rt.custom:
            name = _custom_name(rt, version)
            schemas[name] = _custom_schema(rt, version)
            wanted.add(OBJECT_META)
        else:
            found = _builtin_name(rt, version, defs)
            if found is None:
                continue
            name = found
            wanted.add(name)
        paths.update(_paths(rt, version, f"#/components/schemas/{name}"))
    schemas.update(copy.deepcopy(_closure(wanted, defs)))
    for rt in served:
        served_name = (_custom_name(rt, version) if rt.custom
                       else _builtin_name(rt, version, defs))
        if served_name is not None and served_name in schemas:
            schemas[served_name]["x-kubernetes-group-version-kind"] = [_gvk(rt, version)]
    return {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.31.0"},
            "paths": paths, "components": {"schemas": schemas}}


def index(types: list[ResourceType]) -> Obj:
    """`/openapi/v3`: every group-version with the URL of its document (the hash changes
    when the document does, which is what kubectl's cache keys on)."""
    gvs = sorted({(rt.group, v) for rt in types for v in rt.versions})
    out = {}
    for group, version in gvs:
        doc = document(types, group, version)
        digest = hashlib.sha512(json.dumps(doc, sort_keys=True).encode()).hexdigest().upper()
        out[group_version_path(group, version)] = {
            "serverRelativeURL": f"/openapi/v3/{group_version_path(group, version)}"
                                 f"?hash={digest}"}
    return {"paths": out}
