"""Instructions per unary gRPC call through the front's two `H2Session`s, in memory.

What the `h2` library and `h2session` spend on a unary gRPC call crossing the front,
without sockets, tasks or routing: a client `h2` connection (as grpcio) sends a call to
the front's server-side session, the front's client-side session sends it on to a
backend `h2` connection, which answers (head, one message, `grpc-status` trailers), and
the answer goes back the same way; ten calls per read, each with its own `grpc-timeout`
(grpcio sends the time left, a new value per call). The count includes the two plain
`h2` peers (about half). They run the same `h2` code, so the cuts `h2session` makes
inside `h2` (the frame repr, the inbound validation) apply to them too: the front's
share of those is about half the difference (its two connections of the four; the
frames and heads each receives are alike); the Huffman cut is the front's alone (its
encoders). `scripts.bench.h2_bidi --instructions --unary` counts the front alone.

    .venv/bin/python -m scripts.bench.h2_floor --tree /work/base     # callgrind, A/B
    .venv/bin/python -m scripts.bench.h2_floor --off huffman,onepass  # what a cut saves

`--off` undoes the front's cuts in this tree's run (comma-separated): `repr` (the lazy
frame repr), `onepass` (the inbound header
validation in one pass, its character checks by patterns in C; `h2`'s chain of checks
instead), `huffman` (Huffman coding of
literals back on), and `novalidation`: all of `h2`'s inbound header validation off,
what it costs at all, not a variant the front could use.
Each count is two callgrind runs (--calls and three times that), the difference over
the difference in calls: start-up cancels out. `--calls N --run` runs the calls (what
callgrind counts).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scripts.bench.h2_budget import GRPC_MESSAGE, GRPC_REQUEST, GRPC_RESPONSE, GRPC_TRAILERS
from scripts.bench.lib.tools import callgrind_instructions

# The same call as the budget's unary floor (which times `h2` alone, without `h2session`).
REQUEST = GRPC_REQUEST
UPSTREAM = [*REQUEST, (b"x-forwarded-for", b"127.0.0.1"), (b"x-forwarded-proto", b"http")]
RESPONSE = GRPC_RESPONSE
TRAILERS = GRPC_TRAILERS
MESSAGE = GRPC_MESSAGE
OFF = ("repr", "onepass", "huffman", "novalidation")


def _undo(off: set[str]) -> None:
    """Put `h2`'s own back where `off` says (this process only)."""
    import h2.connection
    import h2.stream
    import hpack

    from nodeagent.http import h2session

    if "repr" in off:
        vars(h2.connection).pop("repr", None)
    if "onepass" in off and hasattr(h2session, "_h2_validate_headers"):
        h2.stream.validate_headers = h2session._h2_validate_headers  # type: ignore[attr-defined]
    init = h2session.H2Session.__init__

    def patched(self: h2session.H2Session, **kwargs: object) -> None:
        init(self, **kwargs)  # type: ignore[arg-type]
        if "huffman" in off:
            self.conn.encoder = hpack.Encoder()
        if "novalidation" in off:
            self.conn.config.validate_inbound_headers = False

    h2session.H2Session.__init__ = patched  # type: ignore[method-assign]


def run(calls: int, off: set[str]) -> None:
    """`calls` unary calls client → front (two sessions) → backend and back."""
    import h2.config
    import h2.connection
    import h2.events

    from nodeagent.http.h2session import DataIn, H2Session, HeadersIn, TrailersIn

    _undo(off)
    client = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding=None))
    backend = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=False, header_encoding=None))
    front, up = H2Session(client_side=False), H2Session(client_side=True)
    client.initiate_connection()
    backend.initiate_connection()
    front.start()
    up.start()
    front.receive(client.data_to_send())
    up.receive(backend.data_to_send())
    client.receive_data(front.data_to_send())
    backend.receive_data(up.data_to_send())
    front.receive(client.data_to_send())
    up.receive(backend.data_to_send())
    backend.receive_data(up.data_to_send())
    client.receive_data(front.data_to_send())
    batch = 10
    for _ in range(calls // batch):
        for _ in range(batch):
            sid = client.get_next_available_stream_id()
            timeout = (b"grpc-timeout", b"%du" % (29_999_000 + sid))
            client.send_headers(sid, [*REQUEST, timeout])
            client.send_data(sid, MESSAGE, end_stream=True)
        to_client: dict[int, int] = {}
        to_up: dict[int, int] = {}
        for ev in front.receive(client.data_to_send()):
            if type(ev) is HeadersIn:
                usid = up.next_stream_id()
                to_client[usid], to_up[ev.stream_id] = ev.stream_id, usid
                up.send_headers(usid, [*UPSTREAM, ev.headers[-1]])
            elif type(ev) is DataIn:
                up.send_data(to_up[ev.stream_id], ev.data, end=True)
                front.acknowledge(ev.stream_id, ev.flow_length)
        for bev in backend.receive_data(up.data_to_send()):
            if isinstance(bev, h2.events.RequestReceived):
                backend.send_headers(bev.stream_id, RESPONSE)
            elif isinstance(bev, h2.events.DataReceived):
                backend.acknowledge_received_data(bev.flow_controlled_length, bev.stream_id)
                backend.send_data(bev.stream_id, bev.data)
                backend.send_headers(bev.stream_id, TRAILERS, end_stream=True)
        for ev in up.receive(backend.data_to_send()):
            if type(ev) is HeadersIn:
                front.send_headers(to_client[ev.stream_id], ev.headers)
            elif type(ev) is DataIn:
                front.send_data(to_client[ev.stream_id], ev.data)
                up.acknowledge(ev.stream_id, ev.flow_length)
            elif type(ev) is TrailersIn:
                front.send_headers(to_client[ev.stream_id], ev.trailers, end=True)
        backend.receive_data(up.data_to_send())
        for cev in client.receive_data(front.data_to_send()):
            if isinstance(cev, h2.events.DataReceived):
                client.acknowledge_received_data(cev.flow_controlled_length, cev.stream_id)
        front.receive(client.data_to_send())


def per_call(tree: Path, calls: int, off: str) -> float:
    """Instructions per call with `tree`'s packages (`off`: cuts undone)."""
    counts = [callgrind_instructions(tree, "scripts.bench.h2_floor",
                                     ["--run", "--calls", str(n), "--off", off],
                                     ("nodeagent",))
              for n in (calls, 3 * calls)]
    return (counts[1] - counts[0]) / (2 * calls)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.h2_floor",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--tree", type=Path, help="another checkout, counted beside this one")
    parser.add_argument("--off", default="", help=f"cuts undone, of {', '.join(OFF)}")
    parser.add_argument("--run", action="store_true", help="run the calls (under callgrind)")
    args = parser.parse_args()
    off = set(filter(None, args.off.split(",")))
    if off - set(OFF):
        parser.error(f"--off takes {', '.join(OFF)}")
    if args.run:
        run(args.calls, off)
        return 0
    here = Path(__file__).resolve().parents[2]
    rows = [("this tree", here, "")]
    rows += [(f"this tree, {name} off", here, name) for name in sorted(off)]
    if len(off) > 1:
        rows.append((f"this tree, {args.off} off", here, args.off))
    if args.tree:
        rows.append((str(args.tree), args.tree.resolve(), ""))
    first = None
    for label, tree, undo in rows:
        count = per_call(tree, args.calls, undo)
        first = first or count
        print(f"{label:40} {count:12,.0f} instructions per call ({count / first - 1:+.1%})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
