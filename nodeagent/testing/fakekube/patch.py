"""Patch formats the fake API server accepts: JSON merge patch (RFC 7386), JSON patch
(RFC 6902) and a server-side apply approximation.

Apply here is "create or merge, remembering what each field manager set": fields a manager
applied before and leaves out now are removed (unless another manager also applied them),
maps merge recursively and lists are replaced whole (real SSA merges `listType: map` lists
by key; nodeagent's writes do not rely on that).
"""

from __future__ import annotations

import copy
from typing import Any


class PatchError(ValueError):
    def __init__(self, message: str, *, code: int = 422) -> None:
        super().__init__(message)
        self.code = code


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, null deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"invalid JSON pointer {path!r}", code=400)
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _resolve(doc: Any, parts: list[str]) -> Any:
    node = doc
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise PatchError(f"path /{'/'.join(parts)} does not exist")
    return node


def _add(doc: Any, parts: list[str], value: Any) -> Any:
    if not parts:
        return value
    parent = _resolve(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        index = len(parent) if last == "-" else int(last) if last.isdigit() else -1
        if not 0 <= index <= len(parent):
            raise PatchError(f"index {last} out of range")
        parent.insert(index, value)
    else:
        raise PatchError(f"cannot add at /{'/'.join(parts)}")
    return doc


def _remove(doc: Any, parts: list[str]) -> Any:
    if not parts:
        raise PatchError("cannot remove the whole document")
    parent = _resolve(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent.pop(int(last))
    raise PatchError(f"path /{'/'.join(parts)} does not exist")


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 operations: add, remove, replace, move, copy, test."""
    if not isinstance(operations, list):
        raise PatchError("a JSON patch is a list of operations", code=400)
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"bad JSON patch operation {op!r}", code=400)
        kind, parts = op["op"], _pointer(op["path"])
        if kind == "add":
            doc = _add(doc, parts, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            _remove(doc, parts)
        elif kind == "replace":
            _resolve(doc, parts)
            if parts:
                _remove(doc, parts)
            doc = _add(doc, parts, copy.deepcopy(op.get("value")))
        elif kind in ("move", "copy"):
            source = _pointer(op.get("from", ""))
            value = copy.deepcopy(_resolve(doc, source))
            if kind == "move":
                _remove(doc, source)
            doc = _add(doc, parts, value)
        elif kind == "test":
            if _resolve(doc, parts) != op.get("value"):
                raise PatchError(f"testing value /{'/'.join(parts)} failed")
        else:
            raise PatchError(f"unknown JSON patch operation {kind!r}", code=400)
    return doc


def leaf_paths(doc: Any, prefix: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """Paths of the leaves of nested maps (a list is one leaf)."""
    if isinstance(doc, dict) and doc:
        out: set[tuple[str, ...]] = set()
        for key, value in doc.items():
            out |= leaf_paths(value, (*prefix, key))
        return out
    return {prefix}


def _deep_merge(target: Any, patch: Any) -> Any:
    if isinstance(target, dict) and isinstance(patch, dict):
        result = dict(target)
        for key, value in patch.items():
            result[key] = _deep_merge(result.get(key), value)
        return result
    return copy.deepcopy(patch)


def _delete_path(doc: dict[str, Any], path: tuple[str, ...]) -> None:
    node: Any = doc
    trail = []
    for part in path[:-1]:
        if not isinstance(node, dict) or part not in node:
            return
        trail.append((node, part))
        node = node[part]
    if isinstance(node, dict):
        node.pop(path[-1], None)
    for parent, key in reversed(trail):  # prune maps the removal emptied
        if parent[key] == {}:
            del parent[key]


def apply_patch(existing: dict[str, Any], applied: dict[str, Any],
                previous: set[tuple[str, ...]], others: set[tuple[str, ...]]
                ) -> tuple[dict[str, Any], set[tuple[str, ...]]]:
    """Merge `applied` into `existing`; drop paths this manager set before and no longer
    sets (unless `others` hold them). Returns the result and this manager's new paths."""
    owned = {p for p in leaf_paths(applied) if p}
    result = _deep_merge(existing, applied)
    for path in previous - owned - others:
        if path and path[0] not in ("apiVersion", "kind") and path[:2] != ("metadata", "name"):
            _delete_path(result, path)
    return result, owned
