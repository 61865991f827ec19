"""The vocabulary every part of the fake shares for stored objects: their type (a plain
dict, as they travel as JSON), their keys, timestamps, and the copy served at a version."""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

from nodeagent.testing.fakekube.registry import ResourceType

Obj = dict[str, Any]
ObjKey = tuple[str, str]  # (namespace or "", name)
TypeKey = tuple[str, str]  # (group, plural)


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def obj_key(obj: Obj) -> ObjKey:
    meta = obj.get("metadata") or {}
    return (meta.get("namespace") or "", meta.get("name") or "")


def external(rt: ResourceType, obj: Obj, version: str, *, typed: bool = True) -> Obj:
    """A copy as served at `version` (conversion "None": only apiVersion changes)."""
    out = copy.deepcopy(obj)
    if typed:
        out["apiVersion"] = rt.api_version(version)
        out["kind"] = rt.kind
    else:
        out.pop("apiVersion", None)
        out.pop("kind", None)
    return out
