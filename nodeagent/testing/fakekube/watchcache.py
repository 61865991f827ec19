"""The store's watch side: each type's event history and the watchers it feeds.

The store publishes every committed event here; each open `Watcher` filters it (namespace,
label and field selectors) and queues what it should see, so a watcher's queue always holds
everything up to the store's revision. A watcher that falls `limit` events behind is closed,
as the real server drops watchers that cannot keep up. History is replayed to watches that
start from an older resourceVersion, until `compact` forgets it.
"""

from __future__ import annotations

import copy
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import trio

from nodeagent.testing.fakekube.objects import Obj, TypeKey, obj_key
from nodeagent.testing.fakekube.selectors import (
    FieldRequirement,
    Requirement,
    fields_match,
    labels_match,
)


@dataclass
class HistoryEvent:
    revision: int
    type: str  # ADDED, MODIFIED, DELETED
    object: Obj  # new state; for DELETED the last state, with the deletion's revision
    previous: Obj | None


class Watcher:
    """One watch's filter and queue. The HTTP layer drains `receive`; `render` turns a
    stored object into what this watch serves (its version)."""

    def __init__(self, render: Callable[[Obj], Obj], namespace: str | None,
                 labels: list[Requirement], fields: list[FieldRequirement], limit: int,
                 on_close: Callable[[Watcher], None]) -> None:
        self._render, self._on_close = render, on_close
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
        self.send.send_nowait((out[0], self._render(out[1])))

    def close(self) -> None:
        self.send.close()
        self._on_close(self)


class WatchCache:
    """Per type: the history of committed events and the open watchers."""

    def __init__(self) -> None:
        self._history: dict[TypeKey, deque[HistoryEvent]] = {}
        self._watchers: dict[TypeKey, set[Watcher]] = {}

    def register(self, key: TypeKey) -> None:
        self._history.setdefault(key, deque())
        self._watchers.setdefault(key, set())

    def unregister(self, key: TypeKey) -> None:
        """Close the type's watchers and forget its history."""
        for w in list(self._watchers.get(key, ())):
            w.close()
        self._history.pop(key, None)
        self._watchers.pop(key, None)

    def publish(self, key: TypeKey, event: HistoryEvent) -> None:
        self._history[key].append(event)
        for watcher in list(self._watchers[key]):
            watcher.offer(event)

    def since(self, key: TypeKey, revision: int) -> list[HistoryEvent]:
        """The type's events after `revision` (the caller checks it is not compacted)."""
        return [e for e in self._history[key] if e.revision > revision]

    def compact(self, revision: int) -> None:
        for history in self._history.values():
            while history and history[0].revision <= revision:
                history.popleft()

    def watch(self, key: TypeKey, render: Callable[[Obj], Obj], namespace: str | None,
              labels: list[Requirement], fields: list[FieldRequirement], limit: int,
              backlog: Iterable[HistoryEvent]) -> Watcher:
        """A watcher that has been offered `backlog`, then sees every publish."""
        watcher = Watcher(render, namespace, labels, fields, limit,
                          on_close=lambda w: self._watchers.get(key, set()).discard(w))
        for event in backlog:
            watcher.offer(event)
        self._watchers[key].add(watcher)
        return watcher
