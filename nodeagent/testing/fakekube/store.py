"""The fake API server's storage: an etcd-like revisioned store with the API's verbs.

One global revision counts every write (like etcd's): `mvcc.py` keeps every object's
versions so paginated lists are consistent snapshots, and each write publishes an event to
the watch cache (`watchcache.py`), which hands it to watchers synchronously at commit.
`compact()` forgets history and old versions, after which watches from older versions and
continue tokens from older snapshots get 410 Expired.

This module owns the verbs (get, list, watch, create, update, patch, server-side apply,
delete) and what follows from a write as the real control plane does it: generation,
finalizers, namespace deletion, garbage collection of dependents, CRDs becoming served
resources. Per-kind defaulting and validation is `admission.py`; the errors are
`errors.py`. No I/O here apart from trio memory channels: `server.py` turns HTTP into calls
on this.
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
import random
import uuid
from collections.abc import Iterable
from typing import Any

import yaml

from nodeagent.testing.fakekube.admission import ClusterIPs, admit, admit_custom, validate_metadata
from nodeagent.testing.fakekube.errors import (
    ApiError,
    Causes,
    already_exists,
    bad_request,
    conflict,
    expired,
    invalid,
    no_such_resource,
    not_found,
)
from nodeagent.testing.fakekube.mvcc import VersionedObjects
from nodeagent.testing.fakekube.objects import Obj, ObjKey, TypeKey, external, now_rfc3339, obj_key
from nodeagent.testing.fakekube.patch import (
    PatchError,
    apply_patch,
    json_patch,
    leaf_paths,
    merge_patch,
)
from nodeagent.testing.fakekube.registry import ResourceType, builtin_types, type_from_crd
from nodeagent.testing.fakekube.selectors import (
    FieldRequirement,
    Requirement,
    SelectorError,
    fields_match,
    labels_match,
    parse_field_selector,
    parse_label_selector,
)
from nodeagent.testing.fakekube.servicestatus import admit_service_status
from nodeagent.testing.fakekube.watchcache import HistoryEvent, WatchCache, Watcher

_GENERATE_CHARS = "bcdfghjklmnpqrstvwxz2456789"
DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


def _strip_for_generation(obj: Obj) -> Obj:
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}



class Store:
    """Every type's objects at every revision, and the API's verbs on them."""

    def __init__(self, *, namespaces: Iterable[str] = DEFAULT_NAMESPACES,
                 history_limit: int | None = None, watch_queue_limit: int = 10_000,
                 start_revision: int = 100, rng: random.Random | None = None) -> None:
        self._objects = VersionedObjects(start_revision)
        self.history_limit = history_limit
        self.watch_queue_limit = watch_queue_limit
        self._rng = rng or random.Random()
        self.types: dict[TypeKey, ResourceType] = {}
        self._watch_cache = WatchCache()
        self._apply_owners: dict[tuple[TypeKey, ObjKey], dict[str, set[tuple[str, ...]]]] = {}
        self._cluster_ips = ClusterIPs()
        for rt in builtin_types():
            self.register(rt)
        for ns in namespaces:
            self.create(self.types[("", "namespaces")], "v1", None,
                        {"metadata": {"name": ns}})

    @property
    def revision(self) -> int:
        return self._objects.revision

    @property
    def compacted(self) -> int:
        return self._objects.compacted

    # -- types ------------------------------------------------------------------------------

    def register(self, rt: ResourceType) -> None:
        self.types[rt.key] = rt
        self._objects.register(rt.key)
        self._watch_cache.register(rt.key)

    def unregister(self, key: TypeKey) -> None:
        self._watch_cache.unregister(key)
        self._objects.unregister(key)
        self.types.pop(key, None)

    def resolve(self, group: str, version: str, plural: str) -> ResourceType:
        rt = self.types.get((group, plural))
        if rt is None or version not in rt.versions:
            raise no_such_resource()
        return rt

    def type_for(self, api_version: str, kind: str) -> tuple[ResourceType, str]:
        group, _, version = api_version.rpartition("/")
        for rt in self.types.values():
            if rt.group == group and rt.kind == kind and version in rt.versions:
                return rt, version
        raise KeyError(f"no resource for {api_version} {kind}")

    # -- the revisioned log -----------------------------------------------------------------

    def _commit(self, rt: ResourceType, type_: str, obj: Obj, previous: Obj | None) -> Obj:
        revision = self._objects.commit(rt.key, type_, obj)
        if type_ == "DELETED":
            self._apply_owners.pop((rt.key, obj_key(obj)), None)
        self._watch_cache.publish(rt.key, HistoryEvent(revision, type_, obj, previous))
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
        self._objects.compact(rev)
        self._watch_cache.compact(rev)
        return rev

    # -- reads ------------------------------------------------------------------------------

    def live(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        obj = self._objects.live[rt.key].get((namespace or "" if rt.namespaced else "", name))
        if obj is None:
            raise not_found(rt, name)
        return obj

    def objects(self, rt: ResourceType) -> list[Obj]:
        return [copy.deepcopy(o) for _, o in sorted(self._objects.live[rt.key].items())]

    def get(self, rt: ResourceType, version: str, namespace: str | None, name: str) -> Obj:
        return external(rt, self.live(rt, namespace, name), version)

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
        objects = self._objects.snapshot(rt.key, snap)
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
                "items": [external(rt, o, version, typed=rt.custom) for _, o in selected]}

    def watch(self, rt: ResourceType, version: str, namespace: str | None, *,
              label: str | None = None, field: str | None = None,
              resource_version: str | None = None) -> Watcher:
        labels, fields = self._selectors(rt, label, field)
        backlog: list[HistoryEvent]
        if resource_version in (None, "", "0"):
            # "Start at most recent": synthetic ADDED events for the current state first.
            backlog = [HistoryEvent(self.revision, "ADDED", obj, None)
                       for _, obj in sorted(self._objects.live[rt.key].items())]
        else:
            since = _parse_rv(resource_version)
            if since < self.compacted:
                raise expired(f"too old resource version: {since} ({self.compacted})")
            backlog = self._watch_cache.since(rt.key, since)
        return self._watch_cache.watch(
            rt.key, lambda obj: external(rt, obj, version), namespace, labels, fields,
            self.watch_queue_limit, backlog)

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
            if ("", meta["namespace"]) not in self._objects.live[("", "namespaces")]:
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
        causes = validate_metadata(rt, obj)
        if causes:
            raise invalid(rt, meta["name"], causes)
        if obj_key(obj) in self._objects.live[rt.key]:
            raise already_exists(rt, meta["name"])
        for f in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds",
                  "selfLink", "managedFields"):
            meta.pop(f, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        if rt.status and not (rt.status_on_create or keep_status):
            obj.pop("status", None)
        admit(rt, obj, None, self._cluster_ips)
        if rt.custom:
            obj = admit_custom(rt, obj)
        if dry_run:
            return external(rt, obj, version)
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
                raise no_such_resource()
            result = copy.deepcopy(old)
            if "status" in new:
                result["status"] = copy.deepcopy(new["status"])
            else:
                result.pop("status", None)
            if rt.key == ("", "services"):
                causes: Causes = []
                admit_service_status(result, causes)
                if causes:
                    raise invalid(rt, name, causes)
        elif subresource:
            raise no_such_resource()
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
            causes = validate_metadata(rt, result)
            if causes:
                raise invalid(rt, name, causes)
            admit(rt, result, old, self._cluster_ips)
            if rt.custom:
                result = admit_custom(rt, result)
            if _strip_for_generation(result) != _strip_for_generation(old):
                result["metadata"]["generation"] = int(old["metadata"].get("generation", 1)) + 1
        result["apiVersion"] = old["apiVersion"]
        result["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
        if not result["metadata"].get("finalizers"):
            result["metadata"].pop("finalizers", None)
        if result == old:
            return external(rt, old, version)  # no-op writes do not bump the revision
        if result["metadata"].get("deletionTimestamp") and not result["metadata"].get(
                "finalizers"):
            self._commit(rt, "DELETED", result, old)
            self._after_delete(rt, result)
            return external(rt, result, version)
        self._commit(rt, "MODIFIED", result, old)
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            self._crd_changed(result)
        return external(rt, result, version)

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
        current = external(rt, old, version)
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
        merged, owned = apply_patch(external(rt, old, version), applied,
                                    owners.get(field_manager, set()), others)
        merged["metadata"].pop("resourceVersion", None)
        result = self._replace(rt, version, old, self._check_body(rt, version, merged),
                               subresource)
        if key[1] in self._objects.live.get(rt.key, {}):
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
                return 202, external(rt, old, version)
            marked = copy.deepcopy(old)
            marked["metadata"]["deletionTimestamp"] = now_rfc3339()
            marked["metadata"]["deletionGracePeriodSeconds"] = 0
            self._commit(rt, "MODIFIED", marked, old)
            return 202, external(rt, marked, version)
        gone = copy.deepcopy(old)
        self._commit(rt, "DELETED", gone, old)
        self._after_delete(rt, gone, orphan=options.get("propagationPolicy") == "Orphan")
        return 200, external(rt, gone, version)

    def _after_delete(self, rt: ResourceType, obj: Obj, *, orphan: bool = False) -> None:
        if rt.key == ("apiextensions.k8s.io", "customresourcedefinitions"):
            spec = obj.get("spec") or {}
            key = (spec.get("group", ""), (spec.get("names") or {}).get("plural", ""))
            custom = self.types.get(key)
            if custom is not None and custom.custom:
                for o in list(self._objects.live[key].values()):
                    self._commit(custom, "DELETED", copy.deepcopy(o), o)
                self.unregister(key)
        self._collect_garbage(obj["metadata"].get("uid"), orphan=orphan)

    def _collect_garbage(self, owner_uid: str | None, *, orphan: bool) -> None:
        """Dependents of a deleted owner: deleted when no owner is left (background
        propagation), or released from the reference (orphan)."""
        if not owner_uid:
            return
        for tkey, table in list(self._objects.live.items()):
            rt = self.types.get(tkey)
            if rt is None:
                continue
            for obj in list(table.values()):
                refs = obj["metadata"].get("ownerReferences") or []
                if not any(r.get("uid") == owner_uid for r in refs):
                    continue
                remaining = [r for r in refs if r.get("uid") != owner_uid]
                if orphan or any(self._objects.has_uid(r.get("uid")) for r in remaining):
                    released = copy.deepcopy(obj)
                    released["metadata"]["ownerReferences"] = remaining
                    if not remaining:
                        del released["metadata"]["ownerReferences"]
                    self._commit(rt, "MODIFIED", released, obj)
                elif obj_key(obj) in table:
                    ns, name = obj_key(obj)
                    self.delete(rt, rt.versions[0], ns or None, name)

    def _delete_namespace_contents(self, namespace: str) -> None:
        for tkey, table in list(self._objects.live.items()):
            rt = self.types.get(tkey)
            if rt is None or not rt.namespaced:
                continue
            for key in [k for k in table if k[0] == namespace]:
                if key in table:
                    self.delete(rt, rt.versions[0], namespace, key[1])

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
        current = self._objects.live[crd_type.key][obj_key(crd)]
        updated = copy.deepcopy(current)
        updated["status"] = wanted
        self._commit(crd_type, "MODIFIED", updated, current)


def _paths(doc: Obj) -> set[tuple[str, ...]]:
    return {p for p in leaf_paths(doc) if p}


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


__all__ = ["DEFAULT_NAMESPACES", "HistoryEvent", "Store", "Watcher"]
