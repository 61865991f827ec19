"""core/v1 Events about an object: what is wrong with *their* object, told to the user.

The same (object, type, reason, message) within `window` seconds bumps `count` and
`lastTimestamp` of the existing Event instead of creating another, as client-go's
EventCorrelator does, so a controller that re-reconciles a broken object every few seconds
shows one Event with a count, not hundreds. Recording is best effort: a failed write is
logged and dropped, never raised into the reconcile loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import trio

from nodeagent.kube.client import KubeClient, Object
from nodeagent.kube.errors import KubeError, NotFound
from nodeagent.kube.resources import EVENTS
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.kube.events")

EventType = Literal["Normal", "Warning"]
MAX_MESSAGE = 1024


def rfc3339(when: datetime | None = None) -> str:
    return (when or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")


def object_reference(obj: Mapping[str, Any]) -> Object:
    """The involvedObject reference for an object (needs kind and apiVersion set)."""
    meta = obj.get("metadata") or {}
    ref: Object = {
        "apiVersion": obj.get("apiVersion", ""),
        "kind": obj.get("kind", ""),
        "name": meta.get("name", ""),
    }
    for field in ("namespace", "uid", "resourceVersion"):
        if meta.get(field):
            ref[field] = meta[field]
    return ref


@dataclass
class _Seen:
    name: str
    namespace: str
    count: int
    at: float


class EventRecorder:
    """Writes Events for one component (e.g. `nodeagent-controller`)."""

    def __init__(
        self,
        client: KubeClient,
        *,
        component: str,
        instance: str | None = None,
        window: float = 600.0,
        max_tracked: int = 4096,
    ) -> None:
        self.client = client
        self.component = component
        self.instance = instance
        self.window = window
        self.max_tracked = max_tracked
        self._seen: OrderedDict[tuple[Any, ...], _Seen] = OrderedDict()
        self._lock = trio.Lock()

    async def normal(self, obj: Mapping[str, Any], reason: str, message: str) -> Object | None:
        return await self.record(obj, reason=reason, message=message, type="Normal")

    async def warning(self, obj: Mapping[str, Any], reason: str, message: str) -> Object | None:
        return await self.record(obj, reason=reason, message=message, type="Warning")

    async def record(
        self, obj: Mapping[str, Any], *, reason: str, message: str, type: EventType = "Normal"
    ) -> Object | None:
        """Create or bump the Event; returns it, or None if the API write failed."""
        ref = object_reference(obj)
        message = message[:MAX_MESSAGE]
        key = (
            ref.get("uid") or (ref["kind"], ref.get("namespace"), ref["name"]),
            type,
            reason,
            message,
        )
        async with self._lock:
            try:
                return await self._record(ref, key, reason=reason, message=message, type=type)
            except KubeError as exc:
                log.warning(
                    "event not recorded",
                    object=f"{ref['kind']}/{ref['name']}",
                    reason=reason,
                    error=str(exc),
                )
                return None

    async def _record(
        self, ref: Object, key: tuple[Any, ...], *, reason: str, message: str, type: EventType
    ) -> Object:
        now = time.monotonic()
        stamp = rfc3339()
        seen = self._seen.get(key)
        if seen is not None and now - seen.at < self.window:
            try:
                event = await self.client.patch(
                    EVENTS,
                    seen.name,
                    {"count": seen.count + 1, "lastTimestamp": stamp},
                    namespace=seen.namespace,
                )
            except NotFound:  # expired (events have a TTL) or deleted: start over
                del self._seen[key]
            else:
                seen.count, seen.at = seen.count + 1, now
                self._seen.move_to_end(key)
                return event
        namespace = ref.get("namespace") or "default"  # cluster-scoped objects: "default"
        body: Object = {
            "metadata": {"name": f"{ref['name']}.{time.time_ns():x}", "namespace": namespace},
            "involvedObject": ref,
            "reason": reason,
            "message": message,
            "type": type,
            "count": 1,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "source": {
                "component": self.component,
                **({"host": self.instance} if self.instance else {}),
            },
            "reportingComponent": self.component,
            "reportingInstance": self.instance or "",
        }
        event = await self.client.create(EVENTS, body)
        self._seen[key] = _Seen(event["metadata"]["name"], namespace, 1, now)
        while len(self._seen) > self.max_tracked:
            self._seen.popitem(last=False)
        return event
