"""What the debug views cost per stream: open, 1-byte echo, close, bare vs noted.

`nodeagent debug streams` reads the tunnel's own stream table and byte counters when asked;
the only work added on the data path is per stream, when it opens: the opening side's
`tracked_opener` (a weak-keyed note of when and for what, and the stream-setup histogram)
and the accepting side's note in its handler. This runs two TunnelConnections in one
process over loopback TCP (as scripts.bench.tunnel_cpu does) and measures process CPU per
open+echo+close, alternating bare and noted rounds so machine noise hits both; prints the
median CPU per stream bare and noted, the difference and the ratio. From the repository
root:

    .venv/bin/python -m scripts.bench.stream_notes_cost [--opens 3000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Histogram

from nodeagent.ops.streamviews import StreamNotes, opener_from_metadata, tracked_opener
from scripts.bench.lib.loopback import allow_any_peer, tcp_pair
from tunnel import protocol as p
from tunnel.endpoint import (
    EndpointSettings,
    IncomingStream,
    TunnelConnection,
)
from tunnel.transports import PeerInfo, StreamTransport

T = p.Target("127.0.0.1", 9)
NOTED = {"on": False}
ACCEPTOR_NOTES = StreamNotes()


async def echo(incoming: IncomingStream) -> None:
    if NOTED["on"]:  # what the agent's and the server's stream handlers add
        ACCEPTOR_NOTES.note(incoming.stream, opener_from_metadata(incoming.metadata))
    stream = await incoming.accept()
    while data := await stream.receive_some(65536):
        await stream.send_all(data)
    await stream.send_eof()


async def run(opens: int, rounds: int) -> dict[str, Any]:
    a, b = tcp_pair()
    settings = EndpointSettings(ping_interval=0, open_rate=1e9)
    d = TunnelConnection(StreamTransport(trio.SocketStream(trio.socket.from_stdlib_socket(a)),
                                         PeerInfo("a")), p.Role.DIALER, settings, None)
    acc = TunnelConnection(StreamTransport(
        trio.SocketStream(trio.socket.from_stdlib_socket(b)), PeerInfo("b")),
        p.Role.ACCEPTOR, settings, echo)
    setup = Histogram("setup_seconds", "x", ["direction"], registry=CollectorRegistry())
    noted = tracked_opener(d.open_stream, StreamNotes(), setup.labels("to-node").observe)
    results: dict[str, list[float]] = {"bare": [], "noted": []}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(acc.accept_handshake, allow_any_peer)
        await d.dial_handshake(p.Hello(identity={"node": "bench"}))
        await nursery.start(d.run)
        await nursery.start(acc.run)
        for _ in range(rounds):
            for name, opener in (("bare", d.open_stream), ("noted", noted)):
                NOTED["on"] = name == "noted"
                t0 = time.process_time()
                for _ in range(opens):
                    stream = await opener(T, {"origin": "203.0.113.9:4242"})
                    await stream.send_all(b"x")
                    await stream.receive_some()
                    await stream.send_eof()
                    while await stream.receive_some():
                        pass
                    await stream.aclose()
                results[name].append((time.process_time() - t0) / opens * 1e6)
        nursery.cancel_scope.cancel()
    bare, noted_us = statistics.median(results["bare"]), statistics.median(results["noted"])
    return {"bare_cpu_us": round(bare, 1), "noted_cpu_us": round(noted_us, 1),
            "added_us": round(noted_us - bare, 1), "ratio": round(noted_us / bare, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.stream_notes_cost",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--opens", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    out = trio.run(run, args.opens, args.rounds)
    print(f"open+echo+close, CPU per stream (median of {args.rounds} rounds of "
          f"{args.opens}): bare {out['bare_cpu_us']} us, noted {out['noted_cpu_us']} us, "
          f"+{out['added_us']} us, ratio {out['ratio']}")


if __name__ == "__main__":
    main()
