"""The shared small HTTP server (nodeagent.ops.jsonhttp), driven over in-memory streams."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator

import h11
import trio
import trio.testing

from nodeagent.ops.jsonhttp import (
    HttpStatus,
    JsonRoutes,
    Reply,
    Request,
    StreamingReply,
    serve_http,
)


class Client:
    """An h11 client on the other end of a memory stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    async def send(self, method: str, target: str) -> None:
        await self.stream.send_all(self.conn.send(h11.Request(
            method=method, target=target, headers=[("host", "x")])) or b"")
        await self.stream.send_all(self.conn.send(h11.EndOfMessage()) or b"")

    async def event(self) -> object:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(bytes(await self.stream.receive_some(65536)))

    async def response(self) -> tuple[int, bytes]:
        head = await self.event()
        assert isinstance(head, h11.Response)
        body = b""
        while True:
            event = await self.event()
            if isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return head.status_code, body

    async def get(self, target: str, method: str = "GET") -> tuple[int, bytes]:
        await self.send(method, target)
        result = await self.response()
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        return result


async def test_json_routes_keep_alive_head_errors_and_statuses(nursery: trio.Nursery) -> None:
    def broken() -> object:
        raise RuntimeError("boom")

    async def status() -> object:
        return {"state": "up"}

    routes = JsonRoutes({"/status": status, "/broken": broken,
                         "/readyz": lambda: HttpStatus(503, {"ready": False})})
    server_side, client_side = trio.testing.memory_stream_pair()
    nursery.start_soon(serve_http, server_side, routes)
    client = Client(client_side)
    # Several requests on one connection; query strings and a trailing slash are ignored.
    assert await client.get("/status?x=1") == (200, b'{\n "state": "up"\n}\n')
    assert await client.get("/status/") == (200, b'{\n "state": "up"\n}\n')
    assert await client.get("/status", method="HEAD") == (200, b"")
    code, body = await client.get("/nope")
    assert code == 404 and json.loads(body)["routes"] == ["/broken", "/readyz", "/status"]
    assert (await client.get("/status", method="POST"))[0] == 405
    code, body = await client.get("/broken")
    assert code == 500 and "boom" in json.loads(body)["error"]
    assert await client.get("/readyz") == (503, b'{\n "ready": false\n}\n')
    assert json.loads((await client.get("/"))[1]) == {"routes": ["/broken", "/readyz",
                                                                 "/status"]}


async def test_malformed_request_gets_400_and_the_connection_closes() -> None:
    server_side, client_side = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_http, server_side, JsonRoutes({}))
        await client_side.send_all(b"GET / HTTP/1.1\r\nno colon here\r\n\r\n")
        received = b""
        with trio.fail_after(5):
            while chunk := await client_side.receive_some(65536):
                received += chunk
    assert received.startswith(b"HTTP/1.1 400 ")
    assert b"malformed request" in received


async def test_streaming_reply_cleans_up_as_soon_as_the_client_leaves() -> None:
    state = {"open": 0, "closed": 0}
    sent = trio.Event()

    async def chunks() -> AsyncGenerator[bytes, None]:
        state["open"] += 1
        try:
            while True:
                yield b"{}\n"
                sent.set()
                await trio.sleep(0.01)
        finally:
            state["closed"] += 1

    async def handler(request: Request) -> Reply | StreamingReply:
        return StreamingReply(chunks())

    server_side, client_side = trio.testing.memory_stream_pair()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_http, server_side, handler)
            client = Client(client_side)
            await client.send("GET", "/watch")
            assert isinstance(await client.event(), h11.Response)
            await sent.wait()
            await client_side.aclose()
    # serve_http returned (the nursery exited) with the generator already finalized.
    assert state == {"open": 1, "closed": 1}


async def _streamed(request_head: bytes, parts: list[bytes]) -> bytes:
    """What serve_http writes for a StreamingReply of `parts` (then the end), read to
    the connection's close."""
    async def chunks() -> AsyncGenerator[bytes, None]:
        for part in parts:
            yield part

    async def handler(request: Request) -> Reply | StreamingReply:
        return StreamingReply(chunks())

    server_side, client_side = trio.testing.memory_stream_pair()
    received = b""
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_http, server_side, handler)
            await client_side.send_all(request_head)
            while chunk := await client_side.receive_some(65536):
                received += chunk
    return received


async def test_a_streaming_reply_is_chunked_for_http_1_1_and_close_delimited_for_1_0(
        ) -> None:
    parts = [b'{"version":1}\n', b"", b"x" * 70_000 + b"\n", b"{}\n"]
    # HTTP/1.1: framed chunks, each part whole, the empty one left out (it would end
    # the body), then the last chunk; h11 on the other end reads exactly the parts.
    received = await _streamed(b"GET /w HTTP/1.1\r\nhost: x\r\n\r\n", parts)
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert body == (b'e\r\n{"version":1}\n\r\n' + b"11171\r\n" + b"x" * 70_000 + b"\n\r\n"
                    + b"3\r\n{}\n\r\n" + b"0\r\n\r\n")
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/w", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(received)
    events = []
    while (event := client.next_event()) is not h11.NEED_DATA:
        events.append(event)
        if isinstance(event, h11.EndOfMessage):
            break
    assert b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data)) == \
        b"".join(parts)
    assert isinstance(events[-1], h11.EndOfMessage)
    # HTTP/1.0 has no chunks: the body is the parts as they are, ended by the close.
    received = await _streamed(b"GET /w HTTP/1.0\r\n\r\n", parts)
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"chunked" not in head and body == b"".join(parts)
