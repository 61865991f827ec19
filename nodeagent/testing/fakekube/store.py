"""The fake API server's storage: an etcd-like revisioned store with the API's semantics.

One global revision counts every write (like etcd's). Each write gives the object that
revision as its resourceVersion and appends an event to its type's history; watchers get
events synchronously at commit, so a watcher's queue always holds everything up to the
store's revision. Old versions are kept (MVCC) so paginated lists are consistent
snapshots; `compact()` forgets history and old versions, after which watches from older
versions and continue tokens from older snapshots get 410 Expired.

No I/O here apart from trio memory channels: `server.py` turns HTTP into calls on this.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import copy
import ipaddress
import json
import math
import random
import re
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import trio
import yaml

from nodeagent.testing.fakekube import schema as schemas
from nodeagent.testing.fakekube.patch import (
    PatchError,
    apply_patch,
    json_patch,
    leaf_paths,
    merge_patch,
)
from nodeagent.testing.fakekube.rbacvalidation import admit as admit_rbac
from nodeagent.testing.fakekube.registry import RBAC, ResourceType, builtin_types, type_from_crd
from nodeagent.testing.fakekube.selectors import (
    FieldRequirement,
    Requirement,
    SelectorError,
    fields_match,
    labels_match,
    parse_field_selector,
    parse_label_selector,
)

Obj = dict[str, Any]
# (field, reason, message) of each invalid field, as kube-apiserver reports them.
Causes = list[tuple[str, str, str]]
ObjKey = tuple[str, str]  # (namespace or "", name)
TypeKey = tuple[str, str]  # (group, plural)

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_GENERATE_CHARS = "bcdfghjklmnpqrstvwxz2456789"
DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")
API_AUDIENCE = "https://kubernetes.default.svc"


class ApiError(Exception):
    """An error the API returns as a `Status` object."""

    def __init__(self, code: int, reason: str, message: str, *,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = details

    def status(self) -> Obj:
        doc: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            doc["details"] = self.details
        return doc


def _details(rt: ResourceType, name: str) -> dict[str, Any]:
    d: dict[str, Any] = {"name": name, "kind": rt.plural}
    if rt.group:
        d["group"] = rt.group
    return d


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.qualified} "{name}" not found',
                    details=_details(rt, name))


def conflict(rt: ResourceType, name: str, why: str | None = None) -> ApiError:
    why = why or ("the object has been modified; please apply your changes to the latest "
                  "version and try again")
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rt.qualified} '
                                     f'"{name}": {why}', details=_details(rt, name))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def expired(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def invalid(rt: ResourceType, name: str, causes: Causes) -> ApiError:
    parts = [f"{field}: {detail}" for field, _, detail in causes]
    joined = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    kind = f"{rt.kind}.{rt.group}" if rt.group else rt.kind
    details = {**_details(rt, name), "kind": rt.kind,
               "causes": [{"reason": r, "message": d, "field": f} for f, r, d in causes]}
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {joined}', details=details)


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def obj_key(obj: Obj) -> ObjKey:
    meta = obj.get("metadata") or {}
    return (meta.get("namespace") or "", meta.get("name") or "")


def _strip_for_generation(obj: Obj) -> Obj:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


@dataclass
class HistoryEvent:
    revision: int
    type: str  # ADDED, MODIFIED, DELETED
    object: Obj  # new state; for DELETED the last state, with the deletion's revision
    previous: Obj | None


class Watcher:
    """One watch's filter and queue. The HTTP layer drains `receive`."""

    def __init__(self, store: Store, rt: ResourceType, version: str, namespace: str | None,
                 labels: list[Requirement], fields: list[FieldRequirement], limit: int) -> None:
        self.store, self.rt, self.version = store, rt, version
        self.namespace, self.labels, self.fields = namespace, labels, fields
        self.limit = limit
        self.send, self.receive = trio.open_memory_channel[tuple[str, Obj]](math.inf)
        self.overflowed = False

    def _matches(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        if self.namespace and obj_key(obj)[0] != self.namespace:
            return False
        return labels_match(self.labels, obj) and fields_match(self.fields, obj)

    @property
    def pending(self) -> int:
        return self.send.statistics().current_buffer_used

    def offer(self, event: HistoryEvent) -> None:
        new_ok = self._matches(event.object)
        if event.type == "ADDED":
            out = ("ADDED", event.object) if new_ok else None
        elif event.type == "DELETED":
            out = ("DELETED", event.object) if new_ok else None
        else:
            old_ok = self._matches(event.previous)
            if new_ok:
                out = ("MODIFIED" if old_ok else "ADDED", event.object)
            elif old_ok and event.previous is not None:
                # Left the selection: DELETED with the old content at the new revision.
                gone = copy.deepcopy(event.previous)
                gone["metadata"]["resourceVersion"] = str(event.revision)
                out = ("DELETED", gone)
            else:
                out = None
        if out is None or self.overflowed:
            return
        if self.pending >= self.limit:
            self.overflowed = True  # the real server drops watchers that fall behind
            self.close()
            return
        self.send.send_nowait((out[0], self.store.external(self.rt, out[1], self.version)))

    def close(self) -> None:
        self.send.close()
        self.store._watchers.get(self.rt.key, set()).discard(self)


class Store:
    def __init__(self, *, namespaces: Iterable[str] = DEFAULT_NAMESPACES,
                 history_limit: int | None = None, watch_queue_limit: int = 10_000,
                 start_revision: int = 100, rng: random.Random | None = None) -> None:
        self.revision = start_revision
        self.compacted = 0
        self.history_limit = history_limit
        self.watch_queue_limit = watch_queue_limit
        self._rng = rng or random.Random()
        self.types: dict[TypeKey, ResourceType] = {}
        self._live: dict[TypeKey, dict[ObjKey, Obj]] = {}
        self._mvcc: dict[TypeKey, dict[ObjKey, list[tuple[int, Obj | None]]]] = {}
        self._history: dict[TypeKey, deque[HistoryEvent]] = {}
        self._watchers: dict[TypeKey, set[Watcher]] = {}
        self._uids: dict[str, tuple[TypeKey, ObjKey]] = {}
        self._apply_owners: dict[tuple[TypeKey, ObjKey], dict[str, set[tuple[str, ...]]]] = {}
        self._next_ip = 10
        for rt in builtin_types():
            self.register(rt)
        for ns in namespaces:
            self.create(self.types[("", "namespaces")], "v1", None,
                        {"metadata": {"name": ns}})

    # -- types ------------------------------------------------------------------------------

    def register(self, rt: ResourceType) -> None:
        self.types[rt.key] = rt
        self._live.setdefault(rt.key, {})
        self._mvcc.setdefault(rt.key, {})
        self._history.setdefault(rt.key, deque())
        self._watchers.setdefault(rt.key, set())

    def unregister(self, key: TypeKey) -> None:
        for w in list(self._watchers.get(key, ())):
            w.close()
        for table in (self.types, self._live, self._mvcc, self._history, self._watchers):
            table.pop(key, None)

    def resolve(self, group: str, version: str, plural: str) -> ResourceType:
        rt = self.types.get((group, plural))
        if rt is None or version not in rt.versions:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return rt

    def type_for(self, api_version: str, kind: str) -> tuple[ResourceType, str]:
        group, _, version = api_version.rpartition("/")
        for rt in self.types.values():
            if rt.group == group and rt.kind == kind and version in rt.versions:
                return rt, version
        raise KeyError(f"no resource for {api_version} {kind}")

    def external(self, rt: ResourceType, obj: Obj, version: str, *, typed: bool = True) -> Obj:
        """A copy as served at `version` (conversion "None": only apiVersion changes)."""
        out = copy.deepcopy(obj)
        if typed:
            out["apiVersion"] = rt.api_version(version)
            out["kind"] = rt.kind
        else:
            out.pop("apiVersion", None)
            out.pop("kind", None)
        return out

    # -- the revisioned log -----------------------------------------------------------------

    def _commit(self, rt: ResourceType, type_: str, obj: Obj, previous: Obj | None) -> Obj:
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        key = obj_key(obj)
        uid = obj["metadata"].get("uid")
        if type_ == "DELETED":
            self._live[rt.key].pop(key, None)
            self._uids.pop(uid, None)
            self._apply_owners.pop((rt.key, key), None)
            self._mvcc[rt.key].setdefault(key, []).append((self.revision, None))
        else:
            self._live[rt.key][key] = obj
            if uid:
                self._uids[uid] = (rt.key, key)
            self._mvcc[rt.key].setdefault(key, []).append((self.revision, obj))
        event = HistoryEvent(self.revision, type_, obj, previous)
        self._history[rt.key].append(event)
        for watcher in list(self._watchers[rt.key]):
            watcher.offer(event)
        if self.history_limit is not None:
            oldest = self.revision - self.history_limit
            if oldest > self.compacted:
                self.compact(oldest)
        return obj

    def compact(self, revision: int | None = None) -> int:
        """Forget history and old versions up to `revision` (default: everything)."""
        rev = self.revision if revision is None else min(revision, self.revision)
        if rev <= self.compacted:
            return self.compacted
        self.compacted = rev
        for history in self._history.values():
            while history and history[0].revision <= rev:
                history.popleft()
        for table in self._mvcc.values():
            for key in list(table):
                versions = table[key]
                i = bisect.bisect_right(versions, rev, key=lambda v: v[0])
                kept = versions[max(i - 1, 0):]
                if kept and kept[0][0] <= rev and kept[0][1] is None:
                    kept = kept[1:]
                if kept:
                    table[key] = kept
                else:
                    del table[key]
        return rev

    def _snapshot(self, rt: ResourceType, revision: int) -> dict[ObjKey, Obj]:
        if revision >= self.revision:
            return self._live[rt.key]
        out: dict[tuple[str, str], Obj] = {}
        for key, versions in self._mvcc[rt.key].items():
            i = bisect.bisect_right(versions, revision, key=lambda v: v[0])
            obj = versions[i - 1][1] if i else None
            if obj is not None:
                out[key] = obj
        return out

    # -- reads ------------------------------------------------------------------------------

    def live(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        obj = self._live[rt.key].get((namespace or "" if rt.namespaced else "", name))
        if obj is None:
            raise not_found(rt, name)
        return obj

    def objects(self, rt: ResourceType) -> list[Obj]:
        return [copy.deepcopy(o) for _, o in sorted(self._live[rt.key].items())]

    def get(self, rt: ResourceType, version: str, namespace: str | None, name: str) -> Obj:
        return self.external(rt, self.live(rt, namespace, name), version)

    def _selectors(self, rt: ResourceType, label: str | None, field: str | None
                   ) -> tuple[list[Requirement], list[FieldRequirement]]:
        try:
            return (parse_label_selector(label),
                    parse_field_selector(field, rt.supports_field))
        except SelectorError as exc:
            raise bad_request(f"unable to parse requirement: {exc}") from exc

    def list(self, rt: ResourceType, version: str, namespace: str | None, *,
             label: str | None = None, field: str | None = None, limit: int | None = None,
             continue_token: str | None = None, resource_version: str | None = None,
             resource_version_match: str | None = None) -> Obj:
        labels, fields = self._selectors(rt, label, field)
        start: ObjKey | None = None
        if continue_token:
            snap, start = _decode_continue(continue_token)
            if snap < self.compacted:
                raise expired(
                    "The provided continue parameter is too old to display a consistent list "
                    "result. You can start a new list without the continue parameter, or use "
                    "the continue token in this response to retrieve the remainder of the "
                    "results. Continuing with the provided token results in an inconsistent "
                    "list - objects that were created, modified, or deleted between the time "
                    "the first chunk was returned and now may show up in the list.")
        else:
            snap = self.revision
            if resource_version not in (None, "", "0"):
                wanted = _parse_rv(resource_version)
                if wanted > self.revision:
                    raise ApiError(504, "Timeout", f"Too large resource version: {wanted}, "
                                                   f"current: {self.revision}")
                if resource_version_match == "Exact":
                    if wanted < self.compacted:
                        raise expired(f"too old resource version: {wanted} ({self.compacted})")
                    snap = wanted
        objects = self._snapshot(rt, snap)
        selected = [(k, o) for k, o in sorted(objects.items())
                    if (not namespace or k[0] == namespace) and (start is None or k > start)
                    and labels_match(labels, o) and fields_match(fields, o)]
        meta: Obj = {"resourceVersion": str(snap)}
        if limit and limit > 0 and len(selected) > limit:
            last = selected[limit - 1][0]
            if not labels and not fields:
                meta["remainingItemCount"] = len(selected) - limit
            selected = selected[:limit]
            meta["continue"] = _encode_continue(snap, last)
        return {"kind": f"{rt.kind}List", "apiVersion": rt.api_version(version),
                "metadata": meta,
                "items": [self.external(rt, o, version, typed=rt.custom) for _, o in selected]}

    def watch(self, rt: ResourceType, version: str, namespace: str | None, *,
              label: str | None = None, field: str | None = None,
              resource_version: str | None = None) -> Watcher:
        labels, fields = self._selectors(rt, label, field)
        watcher = Watcher(self, rt, version, namespace, labels, fields,
                          self.watch_queue_limit)
        if resource_version in (None, "", "0"):
            # "Start at most recent": synthetic ADDED events for the current state first.
            for _, obj in sorted(self._live[rt.key].items()):
                watcher.offer(HistoryEvent(self.revision, "ADDED", obj, None))
        else:
            since = _parse_rv(resource_version)
            if since < self.compacted:
                raise expired(f"too old resource version: {since} ({self.compacted})")
            for event in self._history[rt.key]:
                if event.revision > since:
                    watcher.offer(event)
        self._watchers[rt.key].add(watcher)
        return watcher

    # -- writes -----------------------------------------------------------------------------

    def _check_body(self, rt: ResourceType, version: str, body: Any) -> Obj:
        if not isinstance(body, dict):
            raise bad_request("the body of the request was in an unknown format")
        obj = copy.deepcopy(body)
        kind = obj.get("kind")
        if kind and kind != rt.kind:
            raise bad_request(f"the kind in the data ({kind}) does not match the expected "
                              f"kind ({rt.kind})")
        obj["apiVersion"] = rt.api_version(rt.versions[0])
        obj["kind"] = rt.kind
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        return obj

    def _validate_meta(self, rt: ResourceType, obj: Obj) -> Causes:
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

    def _custom_schema(self, rt: ResourceType, obj: Obj) -> Obj:
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

    def create(self, rt: ResourceType, version: str, namespace: str | None, body: Any, *,
               keep_status: bool = False, field_manager: str | None = None,
               dry_run: bool = False) -> Obj:
        if not rt.stored:
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method")
        obj = self._check_body(rt, version, body)
        obj["apiVersion"] = rt.api_version(version)
        meta = obj["metadata"]
        if rt.namespaced:
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                raise bad_request("the namespace of the provided object does not match the "
                                  "namespace sent on the request")
            meta["namespace"] = namespace or meta.get("namespace")
            if not meta["namespace"]:
                raise bad_request("the namespace of the object is missing")
            if ("", meta["namespace"]) not in self._live[("", "namespaces")]:
                raise not_found(self.types[("", "namespaces")], meta["namespace"])
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if meta.get("generateName"):
                suffix = "".join(self._rng.choice(_GENERATE_CHARS) for _ in range(5))
                meta["name"] = meta["generateName"] + suffix
            else:
                raise invalid(rt, "", [("metadata.name", "FieldValueRequired",
                                        "Required value: name or generateName is required")])
        causes = self._validate_meta(rt, obj)
        if causes:
            raise invalid(rt, meta["name"], causes)
        if obj_key(obj) in self._live[rt.key]:
            raise ApiError(409, "AlreadyExists", f'{rt.qualified} "{meta["name"]}" already '
                                                 "exists", details=_details(rt, meta["name"]))
        for f in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds",
                  "selfLink", "managedFields"):
            meta.pop(f, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        if rt.status and not (rt.status_on_create or keep_status):
            obj.pop("status", None)
        self._admit(rt, obj, None)
        if rt.custom:
            obj = self._custom_schema(rt, obj)
        if dry_run:
            return self.external(rt, obj, version)
        self._commit(rt, "ADDED", obj, None)
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._crd_changed(obj)
        return self.get(rt, version, namespace, meta["name"])

    def update(self, rt: ResourceType, version: str, namespace: str | None, name: str,
               body: Any, *, subresource: str | None = None,
               field_manager: str | None = None) -> Obj:
        old = self.live(rt, namespace, name)
        new = self._check_body(rt, version, body)
        new["apiVersion"] = rt.api_version(version)
        meta = new["metadata"]
        if meta.get("name") and meta["name"] != name:
            raise bad_request(f"the name of the object ({meta['name']}) does not match the "
                              f"name on the URL ({name})")
        if rt.namespaced and meta.get("namespace") and meta["namespace"] != (namespace or ""):
            raise bad_request("the namespace of the provided object does not match the "
                              "namespace sent on the request")
        rv = meta.get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(rt, name)
        if not rv and rt.custom:
            raise invalid(rt, name, [("metadata.resourceVersion", "FieldValueInvalid",
                                      "Invalid value: 0x0: must be specified for an update")])
        if meta.get("uid") and meta["uid"] != old["metadata"]["uid"]:
            raise conflict(rt, name, f"Precondition failed: UID in precondition: "
                                     f"{meta['uid']}, UID in object meta: "
                                     f"{old['metadata']['uid']}")
        return self._replace(rt, version, old, new, subresource)

    def _replace(self, rt: ResourceType, version: str, old: Obj, new: Obj,
                 subresource: str | None) -> Obj:
        name = old["metadata"]["name"]
        if subresource == "status":
            if not rt.status:
                raise ApiError(404, "NotFound", "the server could not find the requested "
                                                "resource")
            result = copy.deepcopy(old)
            if "status" in new:
                result["status"] = copy.deepcopy(new["status"])
            else:
                result.pop("status", None)
        elif subresource:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        else:
            result = new
            meta = result["metadata"]
            for f in ("name", "namespace", "uid", "creationTimestamp", "generation",
                      "deletionTimestamp", "deletionGracePeriodSeconds"):
                if f in old["metadata"]:
                    meta[f] = old["metadata"][f]
                else:
                    meta.pop(f, None)
            meta.pop("managedFields", None)
            if rt.status:
                if "status" in old:
                    result["status"] = copy.deepcopy(old["status"])
                else:
                    result.pop("status", None)
            if old["metadata"].get("deletionTimestamp"):
                added = set(meta.get("finalizers") or []) - set(
                    old["metadata"].get("finalizers") or [])
                if added:
                    raise invalid(rt, name, [(
                        "metadata.finalizers", "FieldValueForbidden",
                        f"Forbidden: no new finalizers can be added if the object is being "
                        f"deleted, found new finalizers {json.dumps(sorted(added))}")])
            causes = self._validate_meta(rt, result)
            if causes:
                raise invalid(rt, name, causes)
            self._admit(rt, result, old)
            if rt.custom:
                result = self._custom_schema(rt, result)
            if _strip_for_generation(result) != _strip_for_generation(old):
                result["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        result["apiVersion"] = old["apiVersion"]
        result["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if not result["metadata"].get("finalizers"):
            result["metadata"].pop("finalizers", None)
        if result == old:
            return self.external(rt, old, version)  # no-op writes do not bump the revision
        if result["metadata"].get("deletionTimestamp") and not result["metadata"].get(
                "finalizers"):
            self._commit(rt, "DELETED", result, old)
            self._after_delete(rt, result)
            return self.external(rt, result, version)
        self._commit(rt, "MODIFIED", result, old)
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._crd_changed(result)
        return self.external(rt, result, version)

    def patch(self, rt: ResourceType, version: str, namespace: str | None, name: str,
              content_type: str, body: bytes, *, subresource: str | None = None,
              field_manager: str | None = None, force: bool = False) -> Obj:
        if content_type == "application/apply-patch+yaml":
            return self._apply(rt, version, namespace, name, body, subresource=subresource,
                               field_manager=field_manager)
        try:
            doc = json.loads(body)
        except ValueError as exc:
            raise bad_request(f"error decoding patch: {exc}") from exc
        old = self.live(rt, namespace, name)
        current = self.external(rt, old, version)
        try:
            if content_type in ("application/merge-patch+json",
                                "application/strategic-merge-patch+json"):
                if not isinstance(doc, dict):
                    raise bad_request("a merge patch must be a JSON object")
                patched = merge_patch(current, doc)
            elif content_type == "application/json-patch+json":
                patched = json_patch(current, doc)
            else:
                raise ApiError(415, "UnsupportedMediaType",
                               f"the body of the request was in an unknown format - accepted "
                               f"media types include: application/json-patch+json, "
                               f"application/merge-patch+json, application/apply-patch+yaml, "
                               f"application/strategic-merge-patch+json (got {content_type})")
        except PatchError as exc:
            raise ApiError(exc.code, "Invalid" if exc.code == 422 else "BadRequest",
                           str(exc)) from exc
        if not isinstance(patched, dict):
            raise bad_request("the patch did not produce an object")
        rv = (patched.get("metadata") or {}).get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(rt, name)
        new = self._check_body(rt, version, patched)
        return self._replace(rt, version, old, new, subresource)

    def _apply(self, rt: ResourceType, version: str, namespace: str | None, name: str,
               body: bytes, *, subresource: str | None, field_manager: str | None) -> Obj:
        if not field_manager:
            raise invalid(rt, name, [("fieldManager", "FieldValueRequired",
                                      "Required value: is required for apply patch")])
        try:
            applied = yaml.safe_load(body)
        except yaml.YAMLError as exc:
            raise bad_request(f"error decoding YAML: {exc}") from exc
        if not isinstance(applied, dict):
            raise bad_request("an apply patch must be an object")
        meta = applied.setdefault("metadata", {})
        if meta.get("name") and meta["name"] != name:
            raise bad_request(f"the name of the object ({meta['name']}) does not match the "
                              f"name on the URL ({name})")
        meta["name"] = name
        key = (rt.key, (namespace or "" if rt.namespaced else "", name))
        try:
            old = self.live(rt, namespace, name)
        except ApiError:
            if subresource:
                raise
            created = self.create(rt, version, namespace, applied, field_manager=field_manager)
            self._apply_owners[key] = {field_manager: _paths(applied)}
            return created
        rv = meta.get("resourceVersion")
        if rv and rv != old["metadata"]["resourceVersion"]:
            raise conflict(rt, name)
        owners = self._apply_owners.setdefault(key, {})
        others: set[tuple[str, ...]] = set()
        for manager, paths in owners.items():
            if manager != field_manager:
                others |= paths
        merged, owned = apply_patch(self.external(rt, old, version), applied,
                                    owners.get(field_manager, set()), others)
        merged["metadata"].pop("resourceVersion", None)
        result = self._replace(rt, version, old, self._check_body(rt, version, merged),
                               subresource)
        if key[1] in self._live.get(rt.key, {}):
            self._apply_owners.setdefault(key, {})[field_manager] = owned
        return result

    def delete(self, rt: ResourceType, version: str, namespace: str | None, name: str,
               options: Obj | None = None) -> tuple[int, Obj]:
        """Returns (HTTP status, body): 200 and the object when it is gone, 202 and the
        object when finalizers hold it back."""
        old = self.live(rt, namespace, name)
        options = options or {}
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != old["metadata"]["uid"]:
            raise conflict(rt, name, f"Precondition failed: UID in precondition: {pre['uid']},"
                                     f" UID in object meta: {old['metadata']['uid']}")
        if pre.get("resourceVersion") and pre["resourceVersion"] != old["metadata"][
                "resourceVersion"]:
            raise conflict(rt, name, "Precondition failed: ResourceVersion in precondition: "
                                     f"{pre['resourceVersion']}, ResourceVersion in object "
                                     f"meta: {old['metadata']['resourceVersion']}")
        if rt.key == ("", "namespaces"):
            self._delete_namespace_contents(name)
        if old["metadata"].get("finalizers"):
            if old["metadata"].get("deletionTimestamp"):
                return 202, self.external(rt, old, version)
            marked = copy.deepcopy(old)
            marked["metadata"]["deletionTimestamp"] = now_rfc3339()
            marked["metadata"]["deletionGracePeriodSeconds"] = 0
            self._commit(rt, "MODIFIED", marked, old)
            return 202, self.external(rt, marked, version)
        gone = copy.deepcopy(old)
        self._commit(rt, "DELETED", gone, old)
        self._after_delete(rt, gone, orphan=options.get("propagationPolicy") == "Orphan")
        return 200, self.external(rt, gone, version)

    def _after_delete(self, rt: ResourceType, obj: Obj, *, orphan: bool = False) -> None:
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            spec = obj.get("spec") or {}
            key = (spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))
            custom = self.types.get(key)
            if custom is not None and custom.custom:
                for o in list(self._live[key].values()):
                    self._commit(custom, "DELETED", copy.deepcopy(o), o)
                self.unregister(key)
        self._collect_garbage(obj["metadata"].get("uid"), orphan=orphan)

    def _collect_garbage(self, owner_uid: str | None, *, orphan: bool) -> None:
        """Dependents of a deleted owner: deleted when no owner is left (background
        propagation), or released from the reference (orphan)."""
        if not owner_uid:
            return
        for tkey, table in list(self._live.items()):
            rt = self.types.get(tkey)
            if rt is None:
                continue
            for obj in list(table.values()):
                refs = obj["metadata"].get("ownerReferences") or []
                if not any(r.get("uid") == owner_uid for r in refs):
                    continue
                remaining = [r for r in refs if r.get("uid") != owner_uid]
                if orphan or any(r.get("uid") in self._uids for r in remaining):
                    released = copy.deepcopy(obj)
                    released["metadata"]["ownerReferences"] = remaining
                    if not remaining:
                        del released["metadata"]["ownerReferences"]
                    self._commit(rt, "MODIFIED", released, obj)
                elif obj_key(obj) in table:
                    ns, name = obj_key(obj)
                    self.delete(rt, rt.versions[0], ns or None, name)

    def _delete_namespace_contents(self, namespace: str) -> None:
        for tkey, table in list(self._live.items()):
            rt = self.types.get(tkey)
            if rt is None or not rt.namespaced:
                continue
            for key in [k for k in table if k[0] == namespace]:
                if key in table:
                    self.delete(rt, rt.versions[0], namespace, key[1])

    # -- per-type behaviour -----------------------------------------------------------------

    def _admit(self, rt: ResourceType, obj: Obj, old: Obj | None) -> None:
        """Defaulting and validation the real API server applies to these types."""
        name = obj["metadata"].get("name", "")
        causes: Causes = []
        if rt.key == ("", "secrets"):
            _admit_secret(rt, obj, old, causes)
        elif rt.key == ("", "services"):
            self._admit_service(obj, old, causes)
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

    def _admit_service(self, obj: Obj, old: Obj | None,
                       causes: Causes) -> None:
        spec = obj.setdefault("spec", {})
        spec.setdefault("type", "ClusterIP")
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
            spec["clusterIP"] = str(ipaddress.ip_address("10.96.0.0") + self._next_ip)
            self._next_ip += 1
        if spec.get("clusterIP"):
            spec["clusterIPs"] = [spec["clusterIP"]]

    def _crd_changed(self, crd: Obj) -> None:
        """Serve the CRD's resource and mark it Established, as the apiextensions
        controllers do (here at once, as a separate write)."""
        rt = type_from_crd(crd)
        existing = self.types.get(rt.key)
        if existing is not None and not existing.custom:
            return
        self.register(rt)
        status = crd.get("status") or {}
        names = (crd.get("spec") or {}).get("names") or {}
        storage = [v["name"] for v in crd["spec"].get("versions") or [] if v.get("storage")]
        stored = sorted(set(status.get("storedVersions") or []) | set(storage))
        wanted = {
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
                 "message": "no conflicts found", "lastTransitionTime": now_rfc3339()},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "message": "the initial names have been accepted",
                 "lastTransitionTime": now_rfc3339()},
            ],
            "acceptedNames": names,
            "storedVersions": stored,
        }
        if status.get("acceptedNames") == names and status.get("storedVersions") == stored:
            return
        crd_type = self.types[("apiextensions.k8s.io", "customresourcedefinitions")]
        current = self._live[crd_type.key][obj_key(crd)]
        updated = copy.deepcopy(current)
        updated["status"] = wanted
        self._commit(crd_type, "MODIFIED", updated, current)


def _paths(doc: Obj) -> set[tuple[str, ...]]:
    return {p for p in leaf_paths(doc) if p}


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


def _parse_rv(value: str | None) -> int:
    try:
        rv = int(value or "")
    except ValueError:
        raise bad_request(f'invalid resource version: "{value}"') from None
    if rv < 0:
        raise bad_request(f'invalid resource version: "{value}"')
    return rv


def _encode_continue(revision: int, last: ObjKey) -> str:
    doc = {"v": "meta.k8s.io/v1", "rv": revision, "start": f"{last[0]}/{last[1]}\x00"}
    return base64.urlsafe_b64encode(json.dumps(doc).encode()).decode().rstrip("=")


def _decode_continue(token: str) -> tuple[int, ObjKey]:
    try:
        padded = token + "=" * (-len(token) % 4)
        doc = json.loads(base64.urlsafe_b64decode(padded))
        ns, _, name = doc["start"].rstrip("\x00").partition("/")
        return int(doc["rv"]), (ns, name)
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise bad_request("continue key is not valid: invalid continue token") from None


__all__ = ["API_AUDIENCE", "ApiError", "HistoryEvent", "Store", "Watcher"]
