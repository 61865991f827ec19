"""A prototype, not product code: the floor of `h2_front` (a client and a server HTTP/2
connection passing h2load's request head, ten per read, and a 1 KiB response, in memory)
with nghttp2's C library (libnghttp2.so.14, through cffi's ABI mode) in place of the `h2`
library, beside `h2` itself in the same run: what an `H2Session` on compiled HTTP/2 would
spend per request at least, callbacks into Python included (a header each, a frame each,
the body's read).

    .venv/bin/python -m scripts.bench.h2_nghttp2 [--rounds 3] [--requests 20000]

Needs libnghttp2 (Debian's libnghttp2-14, there with curl) and cffi.
"""

from __future__ import annotations

import argparse
import ctypes.util
import os
import statistics
import sys
import time
from typing import Any

from scripts.bench.h2_front import floor
from scripts.bench.http_front import BODY

CDEF = """
typedef struct nghttp2_session nghttp2_session;
typedef struct nghttp2_session_callbacks nghttp2_session_callbacks;
typedef struct { size_t length; int32_t stream_id; uint8_t type; uint8_t flags;
                 uint8_t reserved; } nghttp2_frame_hd;
typedef struct { nghttp2_frame_hd hd; } nghttp2_frame;
typedef struct { uint8_t *name; uint8_t *value; size_t namelen; size_t valuelen;
                 uint8_t flags; } nghttp2_nv;
typedef union { int fd; void *ptr; } nghttp2_data_source;
typedef ssize_t (*nghttp2_data_source_read_callback)(
    nghttp2_session *, int32_t, uint8_t *, size_t, uint32_t *, nghttp2_data_source *, void *);
typedef struct { nghttp2_data_source source;
                 nghttp2_data_source_read_callback read_callback; } nghttp2_data_provider;
typedef struct { int32_t settings_id; uint32_t value; } nghttp2_settings_entry;
int nghttp2_session_callbacks_new(nghttp2_session_callbacks **);
void nghttp2_session_callbacks_set_on_frame_recv_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, const nghttp2_frame *, void *));
void nghttp2_session_callbacks_set_on_header_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, const nghttp2_frame *, const uint8_t *, size_t,
            const uint8_t *, size_t, uint8_t, void *));
void nghttp2_session_callbacks_set_on_data_chunk_recv_callback(nghttp2_session_callbacks *,
    int (*)(nghttp2_session *, uint8_t, int32_t, const uint8_t *, size_t, void *));
int nghttp2_session_server_new(nghttp2_session **, const nghttp2_session_callbacks *, void *);
int nghttp2_session_client_new(nghttp2_session **, const nghttp2_session_callbacks *, void *);
int nghttp2_submit_settings(nghttp2_session *, uint8_t, const nghttp2_settings_entry *,
                            size_t);
int32_t nghttp2_submit_request(nghttp2_session *, const void *, const nghttp2_nv *, size_t,
                               const nghttp2_data_provider *, void *);
int nghttp2_submit_response(nghttp2_session *, int32_t, const nghttp2_nv *, size_t,
                            const nghttp2_data_provider *);
ssize_t nghttp2_session_mem_recv(nghttp2_session *, const uint8_t *, size_t);
ssize_t nghttp2_session_mem_send(nghttp2_session *, const uint8_t **);
"""

HEADERS_FRAME = 0x01
END_STREAM = 0x01
HEAD = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/bench"),
        (b":authority", b"127.0.0.1:8080"), (b"accept", b"*/*"),
        (b"accept-encoding", b"gzip, deflate"), (b"user-agent", b"h2load nghttp2/1.52.0")]
RESPONSE = [(b":status", b"200"), (b"content-type", b"text/plain"),
            (b"content-length", b"1024")]


def nghttp2_floor(requests: int, batch: int = 10) -> tuple[float, float]:
    """µs of CPU per request nghttp2 (via cffi) spends: server side, client side. The
    server collects each request's header fields into a list (what `H2Session` hands on)
    and answers when the request ends; the client collects the response's fields and
    counts the body."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    lib: Any = ffi.dlopen(ctypes.util.find_library("nghttp2") or "libnghttp2.so.14")

    def nva(fields: list[tuple[bytes, bytes]]) -> tuple[Any, list[Any]]:
        keep: list[Any] = []
        arr = ffi.new("nghttp2_nv[]", len(fields))
        for i, (n, v) in enumerate(fields):
            cn, cv = ffi.new("uint8_t[]", n), ffi.new("uint8_t[]", v)
            keep += (cn, cv)
            arr[i].name, arr[i].value = cn, cv
            arr[i].namelen, arr[i].valuelen = len(n), len(v)
            arr[i].flags = 0
        return arr, keep

    head_nv, keep_head = nva(HEAD)
    resp_nv, keep_resp = nva(RESPONSE)
    body = ffi.from_buffer(BODY)
    heads: dict[int, list[tuple[bytes, bytes]]] = {}
    got = [0]
    server_ptr = ffi.new("nghttp2_session **")
    client_ptr = ffi.new("nghttp2_session **")

    @ffi.callback("ssize_t(nghttp2_session *, int32_t, uint8_t *, size_t, uint32_t *,"
                  " nghttp2_data_source *, void *)")
    def read_body(session: Any, sid: int, buf: Any, length: int, flags: Any, src: Any,
                  user: Any) -> int:
        ffi.memmove(buf, body, len(BODY))
        flags[0] = 0x01  # NGHTTP2_DATA_FLAG_EOF
        return len(BODY)

    provider = ffi.new("nghttp2_data_provider *")
    provider.read_callback = read_body

    @ffi.callback("int(nghttp2_session *, const nghttp2_frame *, const uint8_t *, size_t,"
                  " const uint8_t *, size_t, uint8_t, void *)")
    def on_header(session: Any, frame: Any, name: Any, namelen: int, value: Any,
                  valuelen: int, flags: int, user: Any) -> int:
        heads.setdefault(frame.hd.stream_id, []).append(
            (ffi.unpack(ffi.cast("char *", name), namelen),
             ffi.unpack(ffi.cast("char *", value), valuelen)))
        return 0

    @ffi.callback("int(nghttp2_session *, const nghttp2_frame *, void *)")
    def on_server_frame(session: Any, frame: Any, user: Any) -> int:
        hd = frame.hd
        if hd.type == HEADERS_FRAME and hd.flags & END_STREAM:
            heads.pop(hd.stream_id, None)
            lib.nghttp2_submit_response(session, hd.stream_id, resp_nv, len(RESPONSE),
                                        provider)
        return 0

    @ffi.callback("int(nghttp2_session *, const nghttp2_frame *, void *)")
    def on_client_frame(session: Any, frame: Any, user: Any) -> int:
        if frame.hd.type == HEADERS_FRAME:
            heads.pop(frame.hd.stream_id, None)
        return 0

    @ffi.callback("int(nghttp2_session *, uint8_t, int32_t, const uint8_t *, size_t, void *)")
    def on_data(session: Any, flags: int, sid: int, data: Any, length: int, user: Any) -> int:
        got[0] += length
        return 0

    def callbacks(on_frame: Any) -> Any:
        ptr = ffi.new("nghttp2_session_callbacks **")
        lib.nghttp2_session_callbacks_new(ptr)
        lib.nghttp2_session_callbacks_set_on_frame_recv_callback(ptr[0], on_frame)
        lib.nghttp2_session_callbacks_set_on_header_callback(ptr[0], on_header)
        lib.nghttp2_session_callbacks_set_on_data_chunk_recv_callback(ptr[0], on_data)
        return ptr[0]

    lib.nghttp2_session_server_new(server_ptr, callbacks(on_server_frame), ffi.NULL)
    lib.nghttp2_session_client_new(client_ptr, callbacks(on_client_frame), ffi.NULL)
    server, client = server_ptr[0], client_ptr[0]
    settings = ffi.new("nghttp2_settings_entry[]", [(3, 100)])  # MAX_CONCURRENT_STREAMS
    lib.nghttp2_submit_settings(server, 0, settings, 1)
    lib.nghttp2_submit_settings(client, 0, settings, 1)
    out = ffi.new("const uint8_t **")

    def drain(session: Any) -> bytes:
        parts = []
        while (n := lib.nghttp2_session_mem_send(session, out)) > 0:
            parts.append(ffi.buffer(out[0], n)[:])
        return b"".join(parts)

    def feed(session: Any, data: bytes) -> None:
        if data and lib.nghttp2_session_mem_recv(session, data, len(data)) != len(data):
            raise RuntimeError("nghttp2 refused the input")

    feed(server, drain(client))
    feed(client, drain(server))
    pending = drain(client)
    in_server = in_client = 0.0
    clock = time.process_time
    for _ in range(requests // batch):
        t0 = clock()
        for _ in range(batch):
            lib.nghttp2_submit_request(client, ffi.NULL, head_nv, len(HEAD), ffi.NULL,
                                       ffi.NULL)
        wire = pending + drain(client)
        t1 = clock()
        feed(server, wire)
        answer = drain(server)
        t2 = clock()
        feed(client, answer)
        pending = drain(client)
        t3 = clock()
        in_server += t2 - t1
        in_client += (t1 - t0) + (t3 - t2)
    n = requests // batch * batch
    if got[0] < n * len(BODY):
        raise RuntimeError(f"only {got[0]} body bytes for {n} requests")
    del keep_head, keep_resp
    return in_server / n * 1e6, in_client / n * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.h2_nghttp2",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
        server, client = floor(args.requests)
        rows.setdefault("h2: server side µs/request", []).append(server)
        rows.setdefault("h2: client side µs/request", []).append(client)
        server, client = nghttp2_floor(args.requests)
        rows.setdefault("nghttp2: server side µs/request", []).append(server)
        rows.setdefault("nghttp2: client side µs/request", []).append(client)
    print(f"\n{'measure':34} median (min-max) over {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, values in rows.items():
        print(f"{name:34} {statistics.median(values):,.1f} "
              f"({min(values):,.1f}-{max(values):,.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
