"""The controller's config watch stream, over HTTP/1.1 (h11 on trio).

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

import hmac
import json
from collections import Counter
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h11
import trio

from nodeagent.config import NodeConfig
from nodeagent.controller.compute import ConfigVersions
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
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        try:
            with trio.move_on_after(self.request_timeout) as scope:
                request = await _next_request(conn, stream)
            if scope.cancelled_caught or request is None:
                return
            await self._serve(conn, stream, request)
        except (h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError,
                OSError) as exc:
            log.debug("config watch ended", reason=repr(exc))
        finally:
            await stream.aclose()

    async def _serve(self, conn: h11.Connection, stream: trio.SocketStream,
                     request: h11.Request) -> None:
        headers = {k.decode().lower(): v.decode(errors="replace") for k, v in request.headers}
        target = urlsplit(request.target.decode(errors="replace"))
        parts = target.path.strip("/").split("/")
        if request.method != b"GET" or len(parts) != 4 or parts[:2] != ["v1", "config"] \
                or parts[2] not in ("nodes", "servers") or not parts[3]:
            return await _reply(conn, stream, 404, "use /v1/config/nodes/NAME or "
                                                   "/v1/config/servers/ID\n")
        if not self.authorize(headers):
            log.warning("config watch refused: bad token", path=target.path)
            return await _reply(conn, stream, 401, "missing or wrong bearer token\n")
        try:
            after = int(parse_qs(target.query).get("after", ["-1"])[0])
        except ValueError:
            return await _reply(conn, stream, 400, "after must be an integer\n")
        key = f"node/{parts[3]}" if parts[2] == "nodes" else "servers"
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=[
            ("content-type", "application/x-ndjson"), ("cache-control", "no-store")])))
        self.subscribers[key] += 1
        log.info("config watch opened", subscriber=parts[3], kind=parts[2], after=after)
        try:
            while True:
                changed = self._changed
                current = self.versions.get(key)
                if current is None and key.startswith("node/"):
                    current = (0, NodeConfig())
                if current is not None and current[0] > after:
                    after = current[0]
                    line = {"version": current[0],
                            "config": current[1].model_dump(mode="json", exclude={"version"})}
                    await _send_line(conn, stream, line)
                    continue
                with trio.move_on_after(self.heartbeat):
                    await changed.wait()
                    continue
                await _send_line(conn, stream, {})
        finally:
            self.subscribers[key] -= 1
            if not self.subscribers[key]:
                del self.subscribers[key]
            log.info("config watch closed", subscriber=parts[3], kind=parts[2])


async def _next_request(conn: h11.Connection, stream: trio.SocketStream) -> h11.Request | None:
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(MAX_REQUEST_BYTES)
            conn.receive_data(data)
            if not data:
                return None
            continue
        if isinstance(event, h11.Request):
            return event
        return None


async def _send_line(conn: h11.Connection, stream: trio.SocketStream, doc: dict[str, Any]
                     ) -> None:
    data = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
    await stream.send_all(conn.send(h11.Data(data=data)))


async def _reply(conn: h11.Connection, stream: trio.SocketStream, status: int,
                 body: str) -> None:
    data = body.encode()
    await stream.send_all(conn.send(h11.Response(status_code=status, headers=[
        ("content-type", "text/plain"), ("content-length", str(len(data))),
        ("connection", "close")])))
    await stream.send_all(conn.send(h11.Data(data=data)))
    await stream.send_all(conn.send(h11.EndOfMessage()))
