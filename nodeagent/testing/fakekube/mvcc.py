"""The etcd-like core of the store: every type's live objects and their past versions,
under one global revision.

Each commit bumps the revision, stamps it on the object as its resourceVersion and records
the new version (or the deletion), so a consistent snapshot of any type can be read at any
revision not yet compacted; paginated lists read one. `compact` forgets versions older
than a revision, keeping each object's last version before it.
"""

from __future__ import annotations

import bisect

from nodeagent.testing.fakekube.objects import Obj, ObjKey, TypeKey, obj_key


class VersionedObjects:
    def __init__(self, start_revision: int) -> None:
        self.revision = start_revision
        self.compacted = 0
        self.live: dict[TypeKey, dict[ObjKey, Obj]] = {}
        self._versions: dict[TypeKey, dict[ObjKey, list[tuple[int, Obj | None]]]] = {}
        self._uids: dict[str, tuple[TypeKey, ObjKey]] = {}

    def register(self, key: TypeKey) -> None:
        self.live.setdefault(key, {})
        self._versions.setdefault(key, {})

    def unregister(self, key: TypeKey) -> None:
        self.live.pop(key, None)
        self._versions.pop(key, None)

    def has_uid(self, uid: str | None) -> bool:
        """Whether a live object has this uid (what owner references point at)."""
        return uid in self._uids

    def commit(self, key: TypeKey, type_: str, obj: Obj) -> int:
        """Record `obj` (ADDED, MODIFIED, or DELETED) at the next revision; returns it."""
        self.revision += 1
        obj["metadata"]["resourceVersion"] = str(self.revision)
        okey = obj_key(obj)
        uid = obj["metadata"].get("uid")
        if type_ == "DELETED":
            self.live[key].pop(okey, None)
            self._uids.pop(uid, None)
            self._versions[key].setdefault(okey, []).append((self.revision, None))
        else:
            self.live[key][okey] = obj
            if uid:
                self._uids[uid] = (key, okey)
            self._versions[key].setdefault(okey, []).append((self.revision, obj))
        return self.revision

    def compact(self, revision: int) -> None:
        """Forget versions superseded at or before `revision` (> `compacted`)."""
        self.compacted = revision
        for table in self._versions.values():
            for okey in list(table):
                versions = table[okey]
                i = bisect.bisect_right(versions, revision, key=lambda v: v[0])
                kept = versions[max(i - 1, 0):]
                if kept and kept[0][0] <= revision and kept[0][1] is None:
                    kept = kept[1:]
                if kept:
                    table[okey] = kept
                else:
                    del table[okey]

    def snapshot(self, key: TypeKey, revision: int) -> dict[ObjKey, Obj]:
        """The type's objects as they were at `revision`."""
        if revision >= self.revision:
            return self.live[key]
        out: dict[ObjKey, Obj] = {}
        for okey, versions in self._versions[key].items():
            i = bisect.bisect_right(versions, revision, key=lambda v: v[0])
            obj = versions[i - 1][1] if i else None
            if obj is not None:
                out[okey] = obj
        return out
