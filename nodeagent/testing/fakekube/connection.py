"""One HTTP/1.1 connection of the fake API server: h11 over a trio stream, TLS optional.

`serve_connection` does the TLS handshake (a client certificate, if offered, is handed on
for authentication), reads requests one at a time (bodies capped at the real server's
3 MiB), and passes each to the handler, which answers with `respond` or streams a chunked
body with `send`. A handler ends the connection without a final chunk by raising
`Dropped`; transport errors end it quietly, as a client hanging up would.
"""

from __future__ import annotations

import json
import random
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import h11
import trio

from nodeagent.testing.fakekube.errors import ApiError

MAX_BODY = 3 * 1024 * 1024  # the real API server's request size limit


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-cased names; the last of repeated headers
    impersonate_groups: list[str]  # the one header that repeats
    body: bytes
    peer_cert: Any  # ssl getpeercert() of a TLS client certificate, else None


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


def json_response(status: int, doc: Any, headers: list[tuple[str, str]] | None = None
                  ) -> Response:
    return Response(status, json.dumps(doc).encode(), headers=headers or [])


def error_response(exc: ApiError) -> Response:
    headers = [("Retry-After", "1")] if exc.code in (429, 503) else []
    return json_response(exc.code, exc.status(), headers)


class Dropped(Exception):
    """The connection is to be closed without finishing the response."""


class HttpConnection:
    """The server side of one connection, for a handler to answer on."""

    def __init__(self, stream: trio.abc.Stream, rng: random.Random) -> None:
        self.stream = stream
        self._conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        self._rng = rng

    def audit_id(self) -> str:
        return f"{self._rng.getrandbits(64):016x}"

    async def read_request(self, peer_cert: Any) -> Request | None:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = self._conn.next_event()
            if event is h11.NEED_DATA:
                data = await self.stream.receive_some(65536)
                self._conn.receive_data(bytes(data))  # b"" marks EOF
                continue
            if isinstance(event, h11.ConnectionClosed):
                return None
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY:
                    raise Dropped
            elif isinstance(event, h11.EndOfMessage):
                return None if request is None else _parse(request, bytes(body), peer_cert)
            elif event is h11.PAUSED:
                return None

    async def send(self, event: h11.Event) -> None:
        data = self._conn.send(event)
        if data:
            await self.stream.send_all(data)

    async def respond(self, response: Response) -> None:
        headers = [("Content-Type", response.content_type),
                   ("Content-Length", str(len(response.body))),
                   ("Audit-Id", self.audit_id()),
                   *response.headers]
        await self.send(h11.Response(status_code=response.status, headers=headers))
        await self.send(h11.Data(data=response.body))
        await self.send(h11.EndOfMessage())

    def next_cycle(self) -> bool:
        """Ready for the next request on this connection; False if it must close."""
        if self._conn.our_state is h11.MUST_CLOSE:
            return False
        self._conn.start_next_cycle()
        return True


def _parse(request: h11.Request, body: bytes, peer_cert: Any) -> Request:
    target = urlsplit(request.target.decode("latin-1"))
    return Request(
        method=request.method.decode(), path=target.path,
        query=dict(parse_qsl(target.query, keep_blank_values=True)),
        headers={k.decode().lower(): v.decode("latin-1") for k, v in request.headers},
        impersonate_groups=[v.decode("latin-1") for k, v in request.headers
                            if k.lower() == b"impersonate-group"],
        body=body, peer_cert=peer_cert)


Handler = Callable[[HttpConnection, Request], Awaitable[bool]]


async def serve_connection(stream: trio.abc.Stream, *, ssl_context: ssl.SSLContext | None,
                           handler: Handler, rng: random.Random) -> None:
    """Serve requests on `stream` until the client closes it or `handler` returns False."""
    try:
        peer_cert = None
        if ssl_context is not None:
            tls = trio.SSLStream(stream, ssl_context, server_side=True,
                                 https_compatible=True)
            with trio.fail_after(10):
                await tls.do_handshake()
            peer_cert = tls.getpeercert()
            stream = tls
        http = HttpConnection(stream, rng)
        while True:
            request = await http.read_request(peer_cert)
            if request is None:
                return
            keep = await handler(http, request)
            if not keep or not http.next_cycle():
                return
    except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError,
            h11.ProtocolError, Dropped, ssl.SSLError, OSError):
        pass
    finally:
        await trio.aclose_forcefully(stream)
