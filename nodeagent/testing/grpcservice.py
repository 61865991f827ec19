"""A stock gRPC service (grpcio, bytes in and out: no protoc, no generated code) for the
HTTP/2 tests and benchmarks: every kind of call, errors, a call that hangs until
cancelled, and which server answered.

`/test.Echo/Unary` echoes the request prefixed by the server's name and `:`;
`ServerStream` answers N messages (N = the request as a decimal number, each `name:i`);
`ClientStream` answers the concatenated requests' length as decimal; `Bidi` echoes each
message as it arrives; `Fail` aborts with PERMISSION_DENIED "nope: <request>"; `Hang`
waits until the call is cancelled (its deadline or the client's cancel) and counts the
cancellation in `GrpcEcho.cancelled`; `Who` answers the server's name.
Needs the `grpcio` package (the test extra).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

MAX_MESSAGE = 32 * 1024 * 1024
OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE),
           ("grpc.max_send_message_length", MAX_MESSAGE)]


@dataclass
class GrpcEcho:
    """One running gRPC server (threads: it stands for an ordinary program on a node)."""

    name: str
    server: Any = None
    port: int = 0
    calls: int = 0
    cancelled: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _count(self) -> None:
        with self._lock:
            self.calls += 1

    def unary(self, request: bytes, context: Any) -> bytes:
        self._count()
        return self.name.encode() + b":" + request

    def who(self, request: bytes, context: Any) -> bytes:
        self._count()
        return self.name.encode()

    def server_stream(self, request: bytes, context: Any) -> Iterator[bytes]:
        self._count()
        for i in range(int(request or b"0")):
            yield f"{self.name}:{i}".encode()

    def client_stream(self, requests: Iterator[bytes], context: Any) -> bytes:
        self._count()
        return str(sum(len(r) for r in requests)).encode()

    def bidi(self, requests: Iterator[bytes], context: Any) -> Iterator[bytes]:
        self._count()
        yield from requests

    def fail(self, request: bytes, context: Any) -> bytes:
        self._count()
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "nope: " + request.decode())
        return b""

    def hang(self, request: bytes, context: Any) -> bytes:
        self._count()
        done = threading.Event()
        context.add_callback(done.set)
        done.wait(60)
        if not context.is_active():
            self.cancelled.set()
        return b""

    def start(self, host: str = "127.0.0.1") -> GrpcEcho:
        handlers = {
            "Unary": grpc.unary_unary_rpc_method_handler(self.unary),
            "Who": grpc.unary_unary_rpc_method_handler(self.who),
            "ServerStream": grpc.unary_stream_rpc_method_handler(self.server_stream),
            "ClientStream": grpc.stream_unary_rpc_method_handler(self.client_stream),
            "Bidi": grpc.stream_stream_rpc_method_handler(self.bidi),
            "Fail": grpc.unary_unary_rpc_method_handler(self.fail),
            "Hang": grpc.unary_unary_rpc_method_handler(self.hang),
        }
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=OPTIONS)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Echo", handlers),))
        self.port = server.add_insecure_port(f"{host}:0")
        server.start()
        self.server = server
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None)


def channel(address: str, authority: str | None = None) -> Any:
    """A plaintext channel (h2c prior knowledge) whose calls carry `authority` as
    :authority (the Host the front routes by)."""
    options: list[tuple[str, Any]] = list(OPTIONS)
    if authority is not None:
        options.append(("grpc.default_authority", authority))
    return grpc.insecure_channel(address, options=options)


def method(ch: Any, name: str, kind: str = "unary_unary") -> Any:
    """A bytes-in, bytes-out callable for /test.Echo/<name>."""
    return getattr(ch, kind)(f"/test.Echo/{name}", request_serializer=None,
                             response_deserializer=None)


__all__ = ["GrpcEcho", "channel", "method"]
