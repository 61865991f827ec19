"""Micro benchmark of the HTTP front's request parsing: CPU µs per request head.

Three ways to read the same keep-alive requests (head + end of message, as the front asks):
- `h11-per-request`: a fresh `h11.Connection` per request (the front before one reader per
  connection), fed the request, two `next_event()` calls;
- `reader-h11`: `RequestReader(fast=False)`, one per connection, every request through h11;
- `reader`: `RequestReader()`, one per connection, llhttp's fast path.

Prints CPU µs per request for each way and each head (wrk's, a browser's). From the
repository root:

    .venv/bin/python -m scripts.bench.http_parse [--n 50000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import h11

from nodeagent.http.request import EndOfRequest, RequestHead, RequestReader

HEADS = {
    # What wrk sends in scripts.bench.tunnel's HTTP test.
    "wrk": b"GET /1k.bin HTTP/1.1\r\nHost: 10.77.1.2:8080\r\n\r\n",
    # A browser-like GET: 9 fields, ~500 bytes.
    "browser": (
        b"GET /static/app.js?v=3 HTTP/1.1\r\nHost: shop.example.com\r\n"
        b"User-Agent: Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0\r\n"
        b"Accept: */*\r\nAccept-Language: en-US,en;q=0.5\r\nAccept-Encoding: gzip, deflate, br\r\n"
        b"Referer: https://shop.example.com/\r\nConnection: keep-alive\r\n"
        b"Cookie: session=4f2a9c0e1b7d4e7f9a3c2b1d0e9f8a7b; theme=dark\r\n"
        b"Sec-Fetch-Dest: script\r\nSec-Fetch-Mode: no-cors\r\n\r\n"
    ),
}


def h11_per_request(head: bytes, n: int) -> None:
    for _ in range(n):
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
        conn.receive_data(head)
        assert type(conn.next_event()) is h11.Request
        assert type(conn.next_event()) is h11.EndOfMessage


def reader(fast: bool) -> Callable[[bytes, int], None]:
    def run(head: bytes, n: int) -> None:
        r = RequestReader(64 * 1024, fast=fast)
        for _ in range(n):
            r.feed(head)
            assert type(r.next()) is RequestHead
            assert type(r.next()) is EndOfRequest
            r.start_next()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench.http_parse",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50_000)
    args = ap.parse_args()
    ways = {
        "h11-per-request": h11_per_request,
        "reader-h11": reader(False),
        "reader": reader(True),
    }
    for name, head in HEADS.items():
        for way, fn in ways.items():
            fn(head, 1000)  # warm up
            best = float("inf")
            for _ in range(3):  # the best of three: a shared machine only adds time
                t0 = time.process_time()
                fn(head, args.n)
                best = min(best, time.process_time() - t0)
            print(f"{name:8} {way:16} {best / args.n * 1e6:6.2f} µs per request")


if __name__ == "__main__":
    main()
