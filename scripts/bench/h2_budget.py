"""What issue 21's goals leave a front per request on this machine, against what the `h2`
library alone spends per request: the CPU budget behind `scripts.bench.h2`'s goal lines.

A goal of N requests/s on a machine of C cores leaves C / N seconds of CPU per request for
every process on the path: the load generator, the backend, the front and the agent. What
the load generator and the backend spend is measured in the same run; what is left is the
front's and the agent's. The floor is the `h2` library alone, in memory, no socket, task,
route or tunnel, in its cheapest configuration (no header validation or normalisation
either way, no Huffman coding of literals, hpack's debug logging off): a front built on
`h2` spends at least that per request, whatever else it does. Where the floor alone is
over what is left, the goal is out of reach for any front built on `h2` on this machine.

The two floors:
  h2load request   the server side of h2load's request (its head, ten per read) and a 1 KiB
                   response; with an h2c backend, the client side of the same exchange too
  unary call       a grpcio unary call crossing the front: the server side (the call in, the
                   head, message and trailers out) and the client side (the call out, the
                   answer in); ten calls per read, each with its own `grpc-timeout`

    .venv/bin/python -m scripts.bench.h2_budget [--requests 20000]   # the floors alone
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable

import h2.config
import h2.connection
import h2.events

# Importing h2session turns hpack's per-field debug logging off, as in the front.
from nodeagent.http import h2session

H2LOAD_HEAD = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/bench"),
               (b":authority", b"127.0.0.1:8080"), (b"accept", b"*/*"),
               (b"accept-encoding", b"gzip, deflate"), (b"user-agent", b"h2load nghttp2/1.52.0")]
H2LOAD_RESPONSE = [(b":status", b"200"), (b"content-type", b"text/plain"),
                   (b"content-length", b"1024")]
BODY = b"x" * 1024
GRPC_REQUEST = [
    (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/bench.Echo/Unary"),
    (b":authority", b"127.0.0.1:50051"), (b"te", b"trailers"),
    (b"content-type", b"application/grpc"),
    (b"user-agent", b"grpc-python/1.60.0 grpc-c/37.0.0 (linux; chttp2)"),
    (b"grpc-accept-encoding", b"identity,deflate,gzip"), (b"accept-encoding", b"identity,gzip")]
GRPC_RESPONSE = [(b":status", b"200"), (b"content-type", b"application/grpc"),
                 (b"grpc-accept-encoding", b"identity,deflate,gzip")]
GRPC_TRAILERS = [(b"grpc-status", b"0")]
GRPC_MESSAGE = b"\0\0\0\0\x04ping"
BATCH = 10


def _connection(client_side: bool) -> h2.connection.H2Connection:
    """`h2` in its cheapest configuration: nothing validated or normalised, no Huffman."""
    config = h2.config.H2Configuration(
        client_side=client_side, header_encoding=None, validate_inbound_headers=False,
        normalize_inbound_headers=False, validate_outbound_headers=False,
        normalize_outbound_headers=False)
    conn = h2.connection.H2Connection(config=config)
    conn.encoder = h2session._PlainEncoder()
    return conn


def _pair() -> tuple[h2.connection.H2Connection, h2.connection.H2Connection]:
    client, server = _connection(True), _connection(False)
    client.initiate_connection()
    server.initiate_connection()
    server.receive_data(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive_data(client.data_to_send())
    return client, server


def _check_all_answered(ended: int, got: int, each: int) -> None:
    """A floor that lost its answers would time less than the work: every batch must come
    back whole."""
    if ended != BATCH or got != BATCH * each:
        raise RuntimeError(f"{ended} of {BATCH} exchanges ended, {got} bytes of "
                           f"{BATCH * each} came back")


@dataclasses.dataclass
class Floor:
    """µs of CPU per request (or call) `h2` spends on each side of a front."""

    server_side: float
    client_side: float


def h2load_floor(requests: int) -> Floor:
    """The server side of h2load's request and a 1 KiB response; the client side of the
    same exchange (what a front spends again toward an h2c backend)."""
    client, server = _pair()
    clock = time.process_time
    in_server = in_client = 0.0
    for _ in range(requests // BATCH):
        t0 = clock()
        for _ in range(BATCH):
            client.send_headers(client.get_next_available_stream_id(), H2LOAD_HEAD,
                                end_stream=True)
        wire = client.data_to_send()
        t1 = clock()
        for ev in server.receive_data(wire):
            if type(ev) is h2.events.RequestReceived:
                server.send_headers(ev.stream_id, H2LOAD_RESPONSE)
                server.send_data(ev.stream_id, BODY, end_stream=True)
        out = server.data_to_send()
        t2 = clock()
        got = ended = 0
        for ev in client.receive_data(out):
            if type(ev) is h2.events.DataReceived:
                got += ev.flow_controlled_length
            elif type(ev) is h2.events.StreamEnded:
                ended += 1
        client.increment_flow_control_window(got)
        update = client.data_to_send()
        t3 = clock()
        server.receive_data(update)
        t4 = clock()
        in_server += (t2 - t1) + (t4 - t3)
        in_client += (t1 - t0) + (t3 - t2)
        _check_all_answered(ended, got, len(BODY))
    n = requests // BATCH * BATCH
    return Floor(in_server / n * 1e6, in_client / n * 1e6)


def unary_floor(calls: int) -> Floor:
    """A unary gRPC call: the server side (as the front faces grpcio) and the client side
    (as the front faces the backend), each timed apart from its peer."""
    client, server = _pair()
    clock = time.process_time
    in_server = in_client = 0.0
    for _ in range(calls // BATCH):
        t0 = clock()
        for _ in range(BATCH):
            sid = client.get_next_available_stream_id()
            timeout = (b"grpc-timeout", b"%du" % (29_999_000 + sid))
            client.send_headers(sid, [*GRPC_REQUEST, timeout])
            client.send_data(sid, GRPC_MESSAGE, end_stream=True)
        wire = client.data_to_send()
        t1 = clock()
        for ev in server.receive_data(wire):
            if type(ev) is h2.events.DataReceived:
                server.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                server.send_headers(ev.stream_id, GRPC_RESPONSE)
                server.send_data(ev.stream_id, ev.data)
                server.send_headers(ev.stream_id, GRPC_TRAILERS, end_stream=True)
        out = server.data_to_send()
        t2 = clock()
        got = ended = 0
        for ev in client.receive_data(out):
            if type(ev) is h2.events.DataReceived:
                client.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                got += len(ev.data)
            elif type(ev) is h2.events.TrailersReceived:
                ended += (b"grpc-status", b"0") in ev.headers  # the call ended OK
        update = client.data_to_send()
        t3 = clock()
        server.receive_data(update)
        t4 = clock()
        in_server += (t2 - t1) + (t4 - t3)
        in_client += (t1 - t0) + (t3 - t2)
        _check_all_answered(ended, got, len(GRPC_MESSAGE))
    n = calls // BATCH * BATCH
    return Floor(in_server / n * 1e6, in_client / n * 1e6)


def left_per_request(cores: float, rate: float, others_us: float) -> float:
    """µs of CPU per request left for the front and the agent at `rate` requests/s on
    `cores` cores, once the other processes on the path took `others_us` each."""
    return cores / rate * 1e6 - others_us


def best_of(measure: Callable[[int], Floor], n: int, rounds: int = 3) -> Floor:
    """The lowest of `rounds` runs, side by side: a floor, so the least the machine let it
    spend."""
    runs = [measure(n) for _ in range(rounds)]
    return Floor(min(r.server_side for r in runs), min(r.client_side for r in runs))


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.h2_budget",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20000)
    args = parser.parse_args()
    for name, measure in (("h2load request", h2load_floor), ("unary call", unary_floor)):
        floor = best_of(measure, args.requests)
        print(f"{name:16} server side {floor.server_side:6.1f} µs, "
              f"client side {floor.client_side:6.1f} µs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
