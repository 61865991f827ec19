"""The controller's config watch stream, over HTTP/1.1 (`ops.jsonhttp`'s server).

    GET /v1/config/nodes/{node}?after=N     an agent's NodeConfig
    GET /v1/config/servers/{id}?after=N     the servers' RoutesConfig
    Authorization: Bearer <token>

The answer is `200`, `Content-Type: application/x-ndjson`, chunked, and never ends: one
line `{"version": V, "config": {...}}` at once if the subscriber's current version V is
newer than `after` (an unknown node gets an empty NodeConfig at version 0), then one line
per new version, and `{}` as a heartbeat every `heartbeat` seconds so either side notices a
dead peer. A slow subscriber is never queued for: each wake-up sends only the newest
version. Agents reach this through their tunnel; servers directly.

Authentication is one replaceable piece (`authorize`): today the shared agent token from a
Secret; with node identity it becomes the certificate's node name, which must match the
path.
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import json
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from typing import Any

import trio

from nodeagent.config import NodeConfig
from nodeagent.controller.compute import ConfigVersions
from nodeagent.ops.jsonhttp import (
    Reply,
    Request,
    StreamingReply,
    serve_http,
    text_reply,
)
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.controller.stream")
MAX_REQUEST_BYTES = 16 * 1024


class ConfigStreamServer:
    def __init__(self, versions: ConfigVersions, token: Callable[[], str], *,
                 heartbeat: float = 15.0, request_timeout: float = 10.0) -> None:
        self.versions = versions
        self._token = token
        self.heartbeat = heartbeat
        self.request_timeout = request_timeout
        self._changed = trio.Event()
        self.subscribers: Counter[str] = Counter()  # key → open watches

    def notify(self) -> None:
        """New versions are in `versions`: wake every watch."""
        self._changed.set()
        self._changed = trio.Event()

    def authorize(self, headers: dict[str, str]) -> bool:
        presented = headers.get("authorization", "")
        expected = f"Bearer {self._token()}"
        return hmac.compare_digest(presented.encode(), expected.encode())

    async def run(self, host: str, port: int, *,
                  task_status: trio.TaskStatus[list[trio.SocketListener]]
                  = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        log.info("config stream listening", address=f"{host}:{port}")
        task_status.started(listeners)
        await trio.serve_listeners(functools.partial(
            serve_http, handler=self.answer, idle_timeout=self.request_timeout,
            max_request_bytes=MAX_REQUEST_BYTES), listeners)

    async def answer(self, request: Request) -> Reply | StreamingReply:
        parts = request.path.strip("/").split("/")
        if request.method != "GET" or len(parts) != 4 or parts[:2] != ["v1", "config"] \
                or parts[2] not in ("nodes", "servers") or not parts[3]:
            return _close(text_reply(404, "use /v1/config/nodes/NAME or "
                                          "/v1/config/servers/ID\n"))
        if not self.authorize(dict(request.headers)):
            log.warning("config watch refused: bad token", path=request.path)
            return _close(text_reply(401, "missing or wrong bearer token\n"))
        try:
            after = int(request.query.get("after", ["-1"])[0])
        except ValueError:
            return _close(text_reply(400, "after must be an integer\n"))
        return StreamingReply(self._watch(parts[2], parts[3], after))

    async def _watch(self, kind: str, name: str, after: int) -> AsyncGenerator[bytes, None]:
        key = f"node/{name}" if kind == "nodes" else "servers"
        self.subscribers[key] += 1
        log.info("config watch opened", subscriber=name, kind=kind, after=after)
        try:
            while True:
                changed = self._changed
                current = self.versions.get(key)
                if current is None and key.startswith("node/"):
                    current = (0, NodeConfig())
                if current is not None and current[0] > after:
                    after = current[0]
                    yield _line({"version": current[0],
                                 "config": current[1].model_dump(mode="json",
                                                                 exclude={"version"})})
                    continue
                with trio.move_on_after(self.heartbeat):
                    await changed.wait()
                    continue
                yield _line({})
        finally:
            self.subscribers[key] -= 1
            if not self.subscribers[key]:
                del self.subscribers[key]
            log.info("config watch closed", subscriber=name, kind=kind)


def _line(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc, separators=(",", ":")) + "\n").encode()


def _close(reply: Reply) -> Reply:
    # A refused watcher reconnects with backoff; no reason to keep its connection.
    return dataclasses.replace(reply, headers=(*reply.headers, ("connection", "close")))
