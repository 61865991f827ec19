"""The REST API's routing: a request's path and method become a call on the store, a
discovery or OpenAPI document, or a review; a watch comes back as a `WatchRequest` for
`watchstream.py` to serve.

Paths follow kube-apiserver's: /api/v1/..., /apis/<group>/<version>/..., with
namespaces/<ns>/ before namespaced resources, and the status subresource. Tables for
kubectl (`table.py`) are served when the Accept header asks for them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from nodeagent.testing.fakekube import discovery, openapi
from nodeagent.testing.fakekube.admission import check_unknown_fields
from nodeagent.testing.fakekube.authentication import Authenticator
from nodeagent.testing.fakekube.connection import Request, Response, json_response
from nodeagent.testing.fakekube.errors import ApiError, bad_request, no_such_resource
from nodeagent.testing.fakekube.rbac import Decision, RequestAttributes, UserInfo
from nodeagent.testing.fakekube.registry import ResourceType
from nodeagent.testing.fakekube.reviews import (
    RulesOf,
    access_review,
    rules_review,
    token_review,
)
from nodeagent.testing.fakekube.scale import SCALE_VERBS, has_scale, serve_scale
from nodeagent.testing.fakekube.store import Store
from nodeagent.testing.fakekube.table import to_table, wants_table


@dataclass
class WatchRequest:
    rt: ResourceType
    version: str
    namespace: str | None
    query: dict[str, str]


class RestApi:
    def __init__(self, store: Store, authenticator: Authenticator,
                 decide: Callable[[RequestAttributes], Decision],
                 rules_of: RulesOf | None = None) -> None:
        self._store = store
        self._authenticator = authenticator
        self._decide = decide
        self._rules_of = rules_of

    def route(self, request: Request, user: UserInfo, server_address: str
              ) -> Response | WatchRequest:
        method, path, query = request.method, request.path, request.query
        types = list(self._store.types.values())
        parts = [unquote(p) for p in path.split("/") if p]
        if path == "/version":
            return json_response(200, discovery.SERVER_VERSION)
        if parts == ["api"]:
            return json_response(200, discovery.api_versions(server_address))
        if parts == ["apis"]:
            return json_response(200, discovery.group_list(types))
        if parts[:2] == ["openapi", "v3"]:
            if len(parts) == 2:
                return json_response(200, openapi.index(types))
            rest = parts[2:]
            doc = None
            if rest[:1] == ["api"] and len(rest) == 2:
                doc = openapi.document(types, "", rest[1])
            elif rest[:1] == ["apis"] and len(rest) == 3:
                doc = openapi.document(types, rest[1], rest[2])
            if doc is None:
                raise no_such_resource()
            return json_response(200, doc)
        if len(parts) == 2 and parts[0] == "apis":
            group_doc = discovery.group(types, parts[1])
            if group_doc is None:
                raise no_such_resource()
            return json_response(200, group_doc)
        if parts[:1] == ["api"] and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise no_such_resource()
        if not rest:
            return json_response(200, discovery.resource_list(types, group, version))
        namespace: str | None = None
        if (rest[0] == "namespaces" and len(rest) >= 3
                and (t := self._store.types.get((group, rest[2]))) is not None
                and t.namespaced):
            namespace, rest = rest[1], rest[2:]
        if len(rest) > 3:
            raise no_such_resource()
        rt = self._store.resolve(group, version, rest[0])
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if rt.namespaced and name is not None and namespace is None:
            raise no_such_resource()
        if not rt.namespaced and namespace is not None:
            raise no_such_resource()
        if sub == "scale" and has_scale(rt) and name is not None:
            verb = _verb(method, name, query)
            if verb not in SCALE_VERBS:
                raise ApiError(405, "MethodNotAllowed",
                               "the server does not allow this method on the requested "
                               "resource")
            content_type = request.headers.get("content-type", "").split(";")[0].strip()
            return json_response(200, serve_scale(
                self._store, rt, version, namespace, name, verb or "", content_type,
                request.body, query.get("fieldManager")))
        if sub not in (None, "status") or (sub == "status" and not rt.status):
            raise no_such_resource()
        verb = _verb(method, name, query)
        if verb is None or verb not in rt.verbs:
            raise ApiError(405, "MethodNotAllowed",
                           "the server does not allow this method on the requested resource")
        if verb == "watch":
            return WatchRequest(rt, version, namespace, query)
        return self._call(verb, rt, version, namespace, name, sub, request, user)

    def _call(self, verb: str, rt: ResourceType, version: str, namespace: str | None,
              name: str | None, sub: str | None, request: Request, user: UserInfo
              ) -> Response:
        store, query, headers, body = self._store, request.query, request.headers, request.body
        field_manager = query.get("fieldManager")
        if rt.custom and query.get("fieldValidation") == "Strict" and verb in (
                "create", "update", "patch"):
            check_unknown_fields(rt, version, _patch_document(request) if verb == "patch"
                                 else _body(body))
        table = verb in ("list", "get") and wants_table(headers.get("accept", ""))
        if verb == "list":
            listed = store.list(
                rt, version, namespace, label=query.get("labelSelector"),
                field=query.get("fieldSelector"), limit=query_int(query.get("limit")),
                continue_token=query.get("continue") or None,
                resource_version=query.get("resourceVersion"),
                resource_version_match=query.get("resourceVersionMatch"))
            return json_response(200, to_table(rt, version, listed, query.get("includeObject"))
                                 if table else listed)
        if verb == "get":
            got = store.get(rt, version, namespace, name or "")
            return json_response(200, to_table(rt, version, got, query.get("includeObject"))
                                 if table else got)
        if verb == "create":
            doc = _body(body)
            if rt.key == ("authentication.k8s.io", "tokenreviews"):
                return json_response(201, token_review(doc, self._authenticator))
            if rt.key == ("authorization.k8s.io", "selfsubjectrulesreviews"):
                assert self._rules_of is not None
                return json_response(201, rules_review(doc, user, self._rules_of))
            if rt.group == "authorization.k8s.io":
                return json_response(201, access_review(rt, doc, user, namespace,
                                                        self._decide))
            return json_response(201, store.create(rt, version, namespace, doc,
                                                   field_manager=field_manager,
                                                   dry_run=query.get("dryRun") == "All"))
        if verb == "update":
            return json_response(200, store.update(rt, version, namespace, name or "",
                                                   _body(body), subresource=sub,
                                                   field_manager=field_manager))
        if verb == "patch":
            content_type = headers.get("content-type", "").split(";")[0].strip()
            return json_response(200, store.patch(rt, version, namespace, name or "",
                                                  content_type, body, subresource=sub,
                                                  field_manager=field_manager,
                                                  force=query.get("force") == "true"))
        if verb == "delete":
            options = _body(body) if body.strip() else {}
            for key in ("propagationPolicy", "gracePeriodSeconds"):
                if key in query:
                    options.setdefault(key, query[key])
            code, obj = store.delete(rt, version, namespace, name or "", options)
            return json_response(code, obj)
        if verb == "deletecollection":
            listed = store.list(rt, version, namespace, label=query.get("labelSelector"),
                                field=query.get("fieldSelector"))
            for item in listed["items"]:
                meta = item["metadata"]
                store.delete(rt, version, meta.get("namespace"), meta["name"])
            listed["items"] = [{**i, "apiVersion": rt.api_version(version), "kind": rt.kind}
                               for i in listed["items"]]
            return json_response(200, listed)
        raise AssertionError(verb)


def _verb(method: str, name: str | None, query: dict[str, str]) -> str | None:
    if name is None:
        if method == "GET":
            return "watch" if query.get("watch") in ("true", "1") else "list"
        return {"POST": "create", "DELETE": "deletecollection"}.get(method)
    return {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method)


def query_int(value: str | None) -> int | None:
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise bad_request(f"invalid integer {value!r}") from None


def _patch_document(request: Request) -> Any:
    """A merge or apply patch as the partial object it is (None for a JSON patch, a list
    of operations, which names no fields to check)."""
    content_type = request.headers.get("content-type", "").split(";")[0].strip()
    if content_type not in ("application/merge-patch+json", "application/apply-patch+yaml",
                            "application/strategic-merge-patch+json"):
        return None
    try:
        import yaml  # apply patches may be YAML; JSON is YAML too

        return yaml.safe_load(request.body)
    except yaml.YAMLError:
        return None


def _body(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise bad_request(f"the body of the request was in an unknown format: {exc}") from None
