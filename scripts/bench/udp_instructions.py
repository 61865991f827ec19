"""The UDP datagram path's cost in machine instructions, this tree against another.

Wall clock and CPU time per datagram move by half from one run to the next on this
small shared machine; instruction counts do not. One trio process holds the whole path
a public UDP mapping's datagram takes, with the production code on both sides:

    client socket -> the server's mapping (server.udpmappings.UdpMappingRelay.serve)
      -> tunnel (two TunnelConnections over loopback TCP with TLS)
      -> the agent's flow (tunnel.udp.FlowPoller) -> a UDP sink socket

`--echo` makes the sink answer each datagram, so the replies come back the same way
(DNS's shape: per datagram the cost of a query and its answer). The harness sends
`--datagrams` 1,400-byte datagrams in bursts of `--burst` (32), each burst waiting until
the sink has them all (no drops; `--burst 1 --echo`: one query at a time, what every
wake-up on the way costs a resolver at a paced rate), under valgrind's callgrind twice,
with N and with N/5 datagrams; the difference divided by the difference in datagrams
is the path's instructions per datagram, start-up, handshake and the client's and
sink's own work included equally for both trees. Rounds alternate between the trees:

    .venv/bin/python -m scripts.bench.udp_instructions --tree /path/to/other/checkout

`--tree` is a checkout (e.g. `git worktree add /tmp/before main`) whose `tunnel` and
`nodeagent` packages are compared with this one's. Prints one JSON object: instructions
per datagram for each tree (median over `--rounds`) and the ratio's median, min and max.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, cast

import trio
import trio.lowlevel

ROOT = Path(__file__).resolve().parents[2]
DATAGRAM = 1400
BURST = 32


async def harness(count: int, echo: bool, burst_size: int = BURST) -> None:
    # Imported here: the tree under test comes first on PYTHONPATH.
    from nodeagent.config import UdpMapping
    from nodeagent.ops.logs import StructuredLogger
    from nodeagent.ops.metrics import Metrics
    from nodeagent.ops.streamviews import StreamNotes
    from nodeagent.server.datapath import DataPath
    from nodeagent.server.udpmappings import UdpMappingRelay
    from nodeagent.trust import pki
    from scripts.bench.lib.loopback import allow_any_peer, tcp_pair
    from tunnel import protocol as p
    from tunnel.endpoint import EndpointSettings, IncomingStream, TunnelConnection
    from tunnel.stream import TunnelStream
    from tunnel.transports import PeerInfo, StreamTransport, TLSStream
    from tunnel.udp import FlowPoller, connect_udp

    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    sink.setblocking(False)
    sink_port = sink.getsockname()[1]
    poller = FlowPoller()

    async def agent_handler(incoming: IncomingStream) -> None:  # the agent's flow path
        target = incoming.target
        sock = connect_udp(target.host, target.port)
        stream = await incoming.accept()
        poller.add(stream, sock, idle_timeout=600)
        incoming.hand_over()

    a, b = tcp_pair()
    ca = pki.create_ca("micro")
    cert = pki.issue_server_certificate(ca, ["localhost"], [])
    ta = TLSStream(trio.SocketStream(trio.socket.from_stdlib_socket(a)),
                   pki.client_ssl_context(ca.certificate_pem), server_hostname="localhost")
    tb = TLSStream(trio.SocketStream(trio.socket.from_stdlib_socket(b)),
                   pki.server_ssl_context(cert.certificate_pem, cert.key_pem),
                   server_side=True)
    settings = EndpointSettings(ping_interval=0, open_rate=1e9)
    agent = TunnelConnection(StreamTransport(ta, PeerInfo("server")), p.Role.DIALER,
                             settings, agent_handler)
    server = TunnelConnection(StreamTransport(tb, PeerInfo("agent")), p.Role.ACCEPTOR,
                              settings, None)

    class Opener:  # the DataPath's open_flow, without the policy around it
        async def open_flow(self, node: str, target: p.Target, origin: str,
                            idle_timeout: float) -> TunnelStream:
            return await server.open_stream(target, {"origin": origin, "idle": "600"})

    relay = UdpMappingRelay(datapath=cast(DataPath, Opener()), notes=StreamNotes(),
                            metrics=Metrics("server"),
                            log=StructuredLogger("bench"))
    mapping_sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    mapping_sock.bind(("127.0.0.1", 0))
    mapping_sock.setblocking(False)
    config = UdpMapping.model_validate({
        "listen": f"127.0.0.1:{mapping_sock.getsockname()[1]}", "node": "edge-1",
        "target": f"127.0.0.1:{sink_port}", "idle_timeout": 600})
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.connect(mapping_sock.getsockname())
    client.setblocking(False)
    payload = b"x" * DATAGRAM

    async def received(sock: socket.socket, want: int) -> None:
        got = 0
        while got < want:
            await trio.lowlevel.wait_readable(sock)
            while got < want:
                try:
                    data, peer = sock.recvfrom(65_535)
                except BlockingIOError:
                    break
                got += 1
                if echo and sock is sink:
                    sink.sendto(data, peer)

    async with trio.open_nursery() as nursery:
        async with trio.open_nursery() as handshakes:
            handshakes.start_soon(ta.do_handshake)
            handshakes.start_soon(tb.do_handshake)
        nursery.start_soon(server.accept_handshake, allow_any_peer)
        await agent.dial_handshake(p.Hello(identity={"node": "edge-1"}))
        await nursery.start(agent.run)
        await nursery.start(server.run)
        nursery.start_soon(poller.run)
        nursery.start_soon(relay.serve, "bench", config, mapping_sock)
        sent = 0
        while sent < count:
            # The first datagram alone: it opens the flow (a flow still opening queues
            # only a few), then bursts.
            burst = min(burst_size if sent else 1, count - sent)
            for _ in range(burst):
                client.send(payload)
            with trio.fail_after(30):
                async with trio.open_nursery() as waiting:
                    waiting.start_soon(received, sink, burst)
                    if echo:
                        waiting.start_soon(received, client, burst)
            sent += burst
        nursery.cancel_scope.cancel()


def instructions(tree: Path, count: int, echo: bool, burst: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{ROOT}", PYTHONHASHSEED="0")
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             # This harness by its path, whichever tree: the other tree's own copy may
             # lack this one's options; its `tunnel` and `nodeagent` come first.
             sys.executable, "-P", str(Path(__file__).resolve()), "--run",
             str(count), "--burst", str(burst), *(["--echo"] if echo else [])],
            cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"harness failed in {tree}:\n{proc.stderr[-3000:]}")
    match = re.search(r"Collected : (\d+)", proc.stderr)
    if match is None:
        raise SystemExit(f"no instruction count from callgrind:\n{proc.stderr[-2000:]}")
    return int(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, help="another checkout to compare with")
    parser.add_argument("--datagrams", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--echo", action="store_true", help="the sink answers each datagram")
    parser.add_argument("--burst", type=int, default=BURST,
                        help=f"datagrams sent before waiting for them (default {BURST}; "
                             "1: one at a time, a resolver's shape at a paced rate)")
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)  # the harness itself
    args = parser.parse_args()
    if args.run is not None:
        trio.run(harness, args.run, args.echo, args.burst)
        return
    small = args.datagrams // 5
    trees = {"this": ROOT, **({"other": args.tree.resolve()} if args.tree else {})}
    per: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            big = instructions(tree, args.datagrams, args.echo, args.burst)
            little = instructions(tree, small, args.echo, args.burst)
            per[name].append((big - little) / (args.datagrams - small))
            print(f"{name}: {per[name][-1]:,.0f} instructions/datagram", file=sys.stderr)
    result: dict[str, Any] = {
        "echo": args.echo, "burst": args.burst, "datagrams": args.datagrams,
        **{f"{name}_instructions_per_datagram": statistics.median(values)
           for name, values in per.items()}}
    if "other" in per:
        ratios = [a / b for a, b in zip(per["this"], per["other"], strict=True)]
        result["ratio_this_to_other"] = {"median": statistics.median(ratios),
                                         "min": min(ratios), "max": max(ratios)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
