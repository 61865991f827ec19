"""Serving a watch over HTTP: a chunked response of JSON lines fed by a store `Watcher`.

A watch lasts `timeoutSeconds` (else 30-60 minutes, as the real server picks), sends
BOOKMARK events when asked and idle for `bookmark_interval`, and ends when the store closes
its watcher (it fell too far behind). A watch from a compacted resourceVersion is accepted
and answered with an ERROR event (410 Expired), as a real server does, unless the fake is
told to answer 410 as the HTTP status. `OpenWatches` tracks open watches so tests can wait
for them or cut them all mid-stream.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import h11
import trio

from nodeagent.testing.fakekube.connection import Dropped, HttpConnection, error_response
from nodeagent.testing.fakekube.errors import ApiError
from nodeagent.testing.fakekube.objects import Obj
from nodeagent.testing.fakekube.requestlog import RecordedRequest
from nodeagent.testing.fakekube.rest import WatchRequest, query_int
from nodeagent.testing.fakekube.store import Store


@dataclass(eq=False)
class _WatchHandle:
    scope: trio.CancelScope
    path: str
    dropped: bool = False


class OpenWatches:
    """The watches being served, for tests to count, wait for and drop."""

    def __init__(self) -> None:
        self._handles: set[_WatchHandle] = set()
        self._changed = trio.Event()

    def count(self, path: str | None = None) -> int:
        return sum(1 for h in self._handles if path is None or path in h.path)

    async def wait_for(self, count: int, path: str | None = None) -> None:
        while self.count(path) < count:
            await self._changed.wait()

    def drop(self) -> int:
        """Cut every open watch connection mid-stream (no final chunk). Returns how many."""
        handles = list(self._handles)
        for handle in handles:
            handle.dropped = True
            handle.scope.cancel()
        return len(handles)

    def _add(self, handle: _WatchHandle) -> None:
        self._handles.add(handle)
        self._change()

    def _discard(self, handle: _WatchHandle) -> None:
        self._handles.discard(handle)
        self._change()

    def _change(self) -> None:
        self._changed.set()
        self._changed = trio.Event()


async def serve_watch(http: HttpConnection, store: Store, watch: WatchRequest,
                      record: RecordedRequest, watches: OpenWatches, *,
                      bookmark_interval: float, gone_as_http_status: bool,
                      rng: random.Random) -> bool:
    """Stream the watch until it times out, is dropped or its watcher closes."""
    rt, version, query = watch.rt, watch.version, watch.query
    timeout = query_int(query.get("timeoutSeconds")) or rng.uniform(1800, 3600)
    bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
    headers = [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked"),
               ("Audit-Id", http.audit_id())]
    try:
        watcher = store.watch(rt, version, watch.namespace,
                              label=query.get("labelSelector"),
                              field=query.get("fieldSelector"),
                              resource_version=query.get("resourceVersion"))
    except ApiError as exc:
        if exc.code != 410 or gone_as_http_status:
            record.status = exc.code
            await http.respond(error_response(exc))
            return True
        # What a real API server does: accept the watch, then send an ERROR event.
        await http.send(h11.Response(status_code=200, headers=headers))
        line = json.dumps({"type": "ERROR", "object": exc.status()}) + "\n"
        await http.send(h11.Data(data=line.encode()))
        await http.send(h11.EndOfMessage())
        return True
    handle = _WatchHandle(trio.CancelScope(deadline=trio.current_time() + timeout),
                          record.path)
    try:
        await http.send(h11.Response(status_code=200, headers=headers))
        watches._add(handle)
        with handle.scope:
            while True:
                event: tuple[str, Obj] | None = None
                with trio.move_on_after(bookmark_interval):
                    try:
                        event = await watcher.receive.receive()
                    except trio.EndOfChannel:
                        break  # the store closed this watcher (it fell too far behind)
                if event is None:
                    if not bookmarks or watcher.pending:
                        continue
                    # Everything up to the store's revision has been sent: say so.
                    event = ("BOOKMARK", {"kind": rt.kind,
                                          "apiVersion": rt.api_version(version),
                                          "metadata": {"resourceVersion":
                                                       str(store.revision)}})
                line = json.dumps({"type": event[0], "object": event[1]}) + "\n"
                await http.send(h11.Data(data=line.encode()))
    finally:
        watches._discard(handle)
        watcher.close()
    if handle.dropped:
        raise Dropped
    await http.send(h11.EndOfMessage())
    return True
