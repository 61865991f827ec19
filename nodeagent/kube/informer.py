"""List+watch into a local cache, the way client-go's reflector does it, on trio.

`Informer.run` LISTs (paginated) and WATCHes from the list's resourceVersion with bookmarks,
following the resourceVersion of every event (BOOKMARKs included) so a reconnect resumes
exactly where the stream stopped: no event is missed or seen twice. When the server says
the version is gone (410, as an HTTP status or as an ERROR event in the stream) the informer
relists — it never asks for the stale version again — and the cache reports the difference
between what it held and the new list as ADDED/MODIFIED/DELETED. Watches carry a jittered
server-side `timeoutSeconds` and a slightly longer client read timeout; errors back off
exponentially with jitter, capped.

`Cache` holds one resource type's objects by (namespace, name) and notifies handlers
synchronously; `Debouncer` turns a burst of notifications into one recompute. Nothing here
starts a task on its own: `run()` methods run in a nursery the caller owns and report
`task_status.started()` once they are useful (the informer after its first sync).
"""

from __future__ import annotations

import builtins
import math
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

import trio

from nodeagent.kube.client import KubeClient, Object, Selector, WatchEvent, object_key
from nodeagent.kube.errors import Gone, KubeError
from nodeagent.kube.resources import Resource
from nodeagent.ops.logs import get_logger
from tunnel.backoff import Backoff

log = get_logger("nodeagent.kube.informer")

CacheEventType = Literal["ADDED", "MODIFIED", "DELETED"]
Key = tuple[str, str]  # (namespace or "", name)


@dataclass(frozen=True)
class CacheEvent:
    """A change to the cache: `object` is the new state (the last known one for DELETED)."""

    type: CacheEventType
    object: Object
    old: Object | None = None


Handler = Callable[[CacheEvent], None]


def _labels_match(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


class Cache:
    """The objects of one resource type, by (namespace, name). Treat objects as read-only.

    Handlers run synchronously inside the informer's task, in event order; they must not
    block (typically they call `Debouncer.trigger()`). Secondary indexes (`add_index`) map
    a key function's values to objects, e.g. EndpointSlices by their service name label.
    """

    def __init__(self, resource: Resource) -> None:
        self.resource = resource
        self.resource_version = ""
        self.synced = trio.Event()
        self._objects: dict[Key, Object] = {}
        # The objects sorted by key, kept until the next change: the controller lists
        # its 10,000 Services, Pods and EndpointSlices at every recompute and the leader
        # its Services every second, and each sort of a large cache allocated a tuple per
        # object (tens of ms at 10,000 objects, and young collections on the way).
        self._sorted: builtins.list[Object] | None = None
        self._handlers: list[Handler] = []
        self._index_fns: dict[str, Callable[[Object], Iterable[str]]] = {}
        self._indexes: dict[str, dict[str, dict[Key, Object]]] = {}
        self._changed = trio.Event()

    @property
    def has_synced(self) -> bool:
        return self.synced.is_set()

    def __len__(self) -> int:
        return len(self._objects)

    def __contains__(self, key: object) -> bool:
        return key in self._objects

    def keys(self) -> list[Key]:
        return sorted(self._objects)

    def get(self, name: str, namespace: str | None = None) -> Object | None:
        return self._objects.get((namespace or "", name))

    def list(
        self, namespace: str | None = None, label_selector: Mapping[str, str] | None = None
    ) -> list[Object]:
        """Objects sorted by (namespace, name), optionally in one namespace / with labels.
        A new list each call (the caller may change it); the objects are the cache's."""
        if self._sorted is None:
            self._sorted = [obj for _, obj in sorted(self._objects.items(),
                                                     key=lambda item: item[0])]
        if namespace is None and not label_selector:
            return builtins.list(self._sorted)
        return [
            obj
            for obj in self._sorted
            if (namespace is None or object_key(obj)[0] == namespace)
            and (not label_selector or _labels_match(obj, label_selector))
        ]

    def add_handler(self, handler: Handler) -> Callable[[], None]:
        """Call `handler` for every change; returns a function that removes it."""
        self._handlers.append(handler)
        return lambda: self._handlers.remove(handler)

    def add_index(self, name: str, key_fn: Callable[[Object], Iterable[str]]) -> None:
        self._index_fns[name] = key_fn
        self._indexes[name] = {}
        for key, obj in self._objects.items():
            self._index(name, key, obj)

    def by_index(self, name: str, value: str) -> builtins.list[Object]:
        return [obj for _, obj in sorted(self._indexes[name].get(value, {}).items())]

    async def wait_until(self, predicate: Callable[[Cache], bool]) -> None:
        """Return once `predicate(cache)` holds (checked after every change)."""
        while not predicate(self):
            await self._changed.wait()

    # -- updates, driven by the informer ----------------------------------------------------

    def _index(self, name: str, key: Key, obj: Object) -> None:
        for value in self._index_fns[name](obj):
            self._indexes[name].setdefault(value, {})[key] = obj

    def _unindex(self, key: Key, obj: Object) -> None:
        for name, fn in self._index_fns.items():
            for value in fn(obj):
                bucket = self._indexes[name].get(value)
                if bucket is not None:
                    bucket.pop(key, None)
                    if not bucket:
                        del self._indexes[name][value]

    def _notify(self, event: CacheEvent) -> None:
        for handler in list(self._handlers):
            try:
                handler(event)
            except Exception as exc:  # a handler bug must not stop the informer
                log.error(
                    "cache handler failed",
                    resource=str(self.resource),
                    handler=getattr(handler, "__qualname__", repr(handler)),
                    error=repr(exc),
                    exc_info=True,
                )
        self._changed.set()
        self._changed = trio.Event()

    def _put(self, obj: Object) -> None:
        key = object_key(obj)
        old = self._objects.get(key)
        if old is not None:
            if _version(old) == _version(obj):
                return  # the same write seen twice (e.g. a replay): not a change
            self._unindex(key, old)
        self._objects[key] = obj
        self._sorted = None
        for name in self._index_fns:
            self._index(name, key, obj)
        self._notify(CacheEvent("ADDED" if old is None else "MODIFIED", obj, old))

    def _remove(self, obj: Object) -> None:
        key = object_key(obj)
        old = self._objects.pop(key, None)
        if old is None:
            return  # never held (deleted before we listed it): nothing changed
        self._sorted = None
        self._unindex(key, old)
        self._notify(CacheEvent("DELETED", obj, old))

    def _replace(self, items: builtins.list[Object], resource_version: str) -> None:
        """A relist: report only what changed relative to the cache's contents."""
        fresh = {object_key(obj): obj for obj in items}
        for key in sorted(set(self._objects) - set(fresh)):
            self._remove(self._objects[key])
        for key, obj in sorted(fresh.items()):
            old = self._objects.get(key)
            if old is None or _version(old) != _version(obj):
                self._put(obj)
        self.resource_version = resource_version
        if not self.synced.is_set():
            self.synced.set()
            self._changed.set()
            self._changed = trio.Event()


def _version(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion", ""))


class Informer:
    """Keeps `cache` equal to the server's objects of one resource type (list+watch)."""

    def __init__(
        self,
        client: KubeClient,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: Selector = None,
        field_selector: Selector = None,
        watch_timeout: float = 300.0,
        page_size: int = 500,
        backoff: Backoff | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.client = client
        self.resource = resource
        self.namespace = namespace
        self.label_selector = label_selector
        self.field_selector = field_selector
        self.watch_timeout = watch_timeout
        self.page_size = page_size
        self.cache = Cache(resource)
        self._backoff = backoff or Backoff(initial=0.8, maximum=30.0)
        self._rng = rng or random.Random()
        self._version: str | None = None
        self.lists = 0  # counters for tests, metrics and the debug socket
        self.watches = 0
        self.gone = 0
        self.errors = 0
        # Why the watch had to be opened again: "closed" (the server ended it, as it does
        # at timeoutSeconds), "expired" (410 Gone: relisted), "error" (backed off)
        self.restarts: dict[str, int] = {"closed": 0, "expired": 0, "error": 0}
        self._log = log.bind(resource=str(resource))

    @property
    def has_synced(self) -> bool:
        return self.cache.has_synced

    async def run(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        """List, then watch forever; reports started after the first complete list.

        Each run starts with a list (diffed against what the cache already holds), so an
        informer can be run again after its task was cancelled.
        """
        reported = False
        self._version = None
        while True:
            listing = self._version is None
            try:
                if self._version is None:
                    await self._relist()
                    if not reported:
                        task_status.started()
                        reported = True
                    continue
                await self._watch(self._version)
                self.restarts["closed"] += 1
            except Gone as exc:
                self.gone += 1
                self.restarts["expired"] += 1
                self._version = None  # never retry a compacted version: relist
                self._log.info("watch restarted", reason="410", message=exc.message)
                if listing:  # the list's own continue token expired; do not spin
                    await trio.sleep(self._backoff.next_delay())
            except KubeError as exc:
                self.errors += 1
                self.restarts["error"] += 1
                delay = self._backoff.next_delay()
                self._log.warning(
                    "list/watch failed",
                    error=str(exc),
                    retry_in=round(delay, 3),
                    stage="list" if listing else "watch",
                )
                await trio.sleep(delay)

    async def _relist(self) -> None:
        self.lists += 1
        result = await self.client.list(
            self.resource,
            namespace=self.namespace,
            label_selector=self.label_selector,
            field_selector=self.field_selector,
            limit=self.page_size,
        )
        self.cache._replace(result.items, result.resource_version)
        self._version = result.resource_version
        self._backoff.reset()
        self._log.debug(
            "listed", objects=len(result.items), resource_version=result.resource_version
        )

    def _timeout_seconds(self) -> int:
        return max(1, math.ceil(self.watch_timeout * (1.0 + 0.25 * self._rng.random())))

    async def _watch(self, version: str) -> None:
        self.watches += 1
        timeout = self._timeout_seconds()
        started = trio.current_time()
        async with self.client.watch(
            self.resource,
            namespace=self.namespace,
            resource_version=version,
            label_selector=self.label_selector,
            field_selector=self.field_selector,
            timeout_seconds=timeout,
            allow_bookmarks=True,
        ) as stream:
            async for event in stream:
                self._apply(event)
                self._backoff.reset()
        if stream.events == 0 and trio.current_time() - started < timeout / 2:
            # A server that closes watches at once would otherwise be hammered.
            await trio.sleep(self._backoff.next_delay())

    def _apply(self, event: WatchEvent) -> None:
        if event.type in ("ADDED", "MODIFIED"):
            event.object.setdefault("apiVersion", self.resource.api_version)
            event.object.setdefault("kind", self.resource.kind)
            self.cache._put(event.object)
        elif event.type == "DELETED":
            self.cache._remove(event.object)
        elif event.type != "BOOKMARK":
            self._log.warning("unknown watch event type", type=event.type)
            return
        version = event.resource_version
        if version:
            self._version = version
            self.cache.resource_version = version


class SharedInformers:
    """One informer (and cache) per resource type and filter, shared by all consumers.

    Register every informer with `informer()`/`cache()` before `run()`; `run()` runs them
    all in its nursery and reports started once every cache has synced.
    """

    def __init__(
        self,
        client: KubeClient,
        *,
        watch_timeout: float = 300.0,
        backoff: Callable[[], Backoff] = lambda: Backoff(initial=0.8, maximum=30.0),
    ) -> None:
        self.client = client
        self.watch_timeout = watch_timeout
        self._backoff = backoff
        self._informers: dict[tuple[Any, ...], Informer] = {}
        self._running = False

    def informer(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: Selector = None,
        field_selector: Selector = None,
    ) -> Informer:
        key = (resource, namespace, _freeze(label_selector), _freeze(field_selector))
        found = self._informers.get(key)
        if found is None:
            if self._running:
                raise RuntimeError("register informers before SharedInformers.run()")
            found = Informer(
                self.client,
                resource,
                namespace=namespace,
                label_selector=label_selector,
                field_selector=field_selector,
                watch_timeout=self.watch_timeout,
                backoff=self._backoff(),
            )
            self._informers[key] = found
        return found

    def cache(self, resource: Resource, **filters: Any) -> Cache:
        return self.informer(resource, **filters).cache

    @property
    def informers(self) -> list[Informer]:
        return list(self._informers.values())

    @property
    def has_synced(self) -> bool:
        return all(i.has_synced for i in self._informers.values())

    async def run(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        self._running = True
        async with trio.open_nursery() as nursery:
            for informer in self._informers.values():  # list concurrently
                nursery.start_soon(informer.run)
            for informer in self._informers.values():
                await informer.cache.synced.wait()
            task_status.started()
            await trio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover


def _freeze(selector: Selector) -> Any:
    if selector is None or isinstance(selector, str):
        return selector
    return tuple(sorted(selector.items()))


class Debouncer:
    """Coalesces bursts of `trigger()` calls into one `callback()` call.

    After the first trigger it waits until `delay` passes without another one, but never
    longer than `max_delay` after the first, so a steady stream of changes still gets
    recomputed. An `urgent` trigger ends the wait at once (someone waits on this change:
    a woken Service's endpoints, for the requests held for it). Triggers during the
    callback schedule one more call after it. A failing callback is logged and counted;
    the next trigger tries again.
    """

    def __init__(
        self,
        callback: Callable[[], Awaitable[None]],
        *,
        delay: float = 0.05,
        max_delay: float = 0.5,
        name: str = "recompute",
    ) -> None:
        self._callback = callback
        self.delay = delay
        self.max_delay = max_delay
        self.name = name
        self._pending = trio.Event()
        self._hurry = trio.Event()
        self._triggers = 0
        self.calls = 0
        self.failures = 0

    def trigger(self, *_: object, urgent: bool = False) -> None:
        """Note a change; usable directly as a `Cache` handler."""
        self._triggers += 1
        self._pending.set()
        if urgent:
            self._hurry.set()

    async def run(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        task_status.started()
        while True:
            await self._pending.wait()
            first = trio.current_time()
            while not self._hurry.is_set():
                seen = self._triggers
                with trio.move_on_at(min(trio.current_time() + self.delay,
                                         first + self.max_delay)):
                    await self._hurry.wait()
                if self._triggers == seen or trio.current_time() >= first + self.max_delay:
                    break
            self._pending = trio.Event()
            self._hurry = trio.Event()
            self.calls += 1
            try:
                await self._callback()
            except Exception as exc:
                self.failures += 1
                log.error("debounced call failed", name=self.name, error=repr(exc), exc_info=True)
