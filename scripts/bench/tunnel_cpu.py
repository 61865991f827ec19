"""In-process micro benchmark of the tunnel endpoints: CPU time per unit of work.

Two TunnelConnections (dialer and acceptor) in one trio process over a loopback TCP
connection (plain StreamTransport; with --tls over the tunnel's TLSStream), streams handled by an
echo/sink handler (`--relays`: streams relayed to a TCP echo as the agent relays them,
dialed by the splice loop with no task where the tree can, `--handler-task`: by a
handler task per stream as before; `--egress`: streams a real nodeagent `Server` takes
from an agent's tunnel and dials, the intercepted path's server side). Measures process
CPU time, which a busy shared machine disturbs far less than wall-clock throughput. Run
from the repository root:

    .venv/bin/python -m scripts.bench.tunnel_cpu [--mib 512] [--tls] [--no-fast-path]

Prints one JSON object: CPU seconds per GB of bulk, CPU µs per request/response (on one
stream and on `--parallel` streams) and per open+echo+close. To A/B tunnel changes, run
another checkout's `tunnel` under this benchmark (-P keeps the current directory off the
front of sys.path, so PYTHONPATH decides):

    PYTHONPATH=/path/to/other/tree:. .venv/bin/python -P -m scripts.bench.tunnel_cpu
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import time
from collections.abc import AsyncIterator

import trio

from scripts.bench.lib.loopback import allow_any_peer, tcp_pair
from tunnel import protocol as p
from tunnel.endpoint import EndpointSettings, IncomingStream, TunnelConnection
from tunnel.relay import relay_incoming
from tunnel.tcp import connect_tcp
from tunnel.transports import PeerInfo, StreamTransport, TLSStream

T = p.Target("127.0.0.1", 9)


RELAY_TARGET: list[int] = []  # the C echo's port, when --relays asks for one
# Trees from before tunnel/spliceloop.py have no on_finished (tunnel_instructions --tree).
HANDS_OVER = "on_finished" in inspect.signature(relay_incoming).parameters
# Trees from before the reader's StreamTaker dial every stream in a handler task.
TAKES_STREAMS = "take_stream" in inspect.signature(TunnelConnection).parameters


def take_relay(incoming: IncomingStream) -> bool:
    """The agent's path where the tree has it (Agent.take_stream): a stream to an IP
    literal is dialed, answered and spliced by the splice loop, with no task."""
    if incoming.metadata.get("mode") != "relay":
        return False
    from tunnel.relay import relay_incoming_now
    return relay_incoming_now(incoming, "127.0.0.1", RELAY_TARGET[0], timeout=5, mark=None,
                              on_accepted=_ignore, on_refused=_ignore, on_finished=_ignore)


async def sink_or_echo(incoming: IncomingStream) -> None:
    if incoming.metadata.get("mode") == "relay":
        await relay_to_echo(incoming)
        return
    stream = await incoming.accept()
    echo = incoming.metadata.get("mode") == "echo"
    while data := await stream.receive_some(256 * 1024):
        if echo:
            await stream.send_all(data)
    await stream.send_eof()


async def relay_to_echo(incoming: IncomingStream) -> None:
    """The agent's path for a stream the server opens: dial the target, accept, splice;
    handed over to the connection's splice loop where the tree has one."""
    dial = functools.partial(connect_tcp, "127.0.0.1", RELAY_TARGET[0], connect_timeout=5)
    if HANDS_OVER:
        await relay_incoming(incoming, dial, on_finished=_ignore)
    else:  # a tree from before the splice loop: the handler waits for the end
        await relay_incoming(incoming, dial)


def _ignore(*args: object) -> None:
    pass


@contextlib.asynccontextmanager
async def echo_target() -> AsyncIterator[int]:
    """benchtool's C echo in a process of its own: its CPU is not this process's."""
    import socket
    import tempfile
    from pathlib import Path

    from scripts.bench.lib.tools import build_benchtool
    tool = build_benchtool(Path(tempfile.gettempdir()) / "nodeagent-benchtool")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    proc = await trio.lowlevel.open_process([str(tool), "echo", str(port)])
    try:
        for _ in range(200):
            try:
                (await trio.open_tcp_stream("127.0.0.1", port)).socket.close()
                break
            except OSError:
                await trio.sleep(0.02)
        yield port
    finally:
        proc.terminate()
        await proc.wait()


EGRESS_TOKEN = "bench-egress-token-0123456789"


@contextlib.asynccontextmanager
async def egress_server(port: int, settings: EndpointSettings) -> AsyncIterator[
        TunnelConnection]:
    """A nodeagent server (its TunnelServer, data-path policy and openers, as in
    production) allowing egress to 127.0.0.1:`port`, and an agent's tunnel connection to
    it over loopback TCP: the agent's side of the intercepted path opens streams on it."""
    from nodeagent.config import ServerConfig
    from nodeagent.server.server import Server
    server = Server(ServerConfig.model_validate({
        "tunnel": {"url": "tcp://127.0.0.1:0", "insecure": True},
        "tokens": [{"node": "edge-1", "token": EGRESS_TOKEN}], "debug_socket": "",
        "egress": [f"127.0.0.1/32:{port}"], "keepalive": {"interval": 3600}}))
    a, b = tcp_pair()
    agent = TunnelConnection(StreamTransport(trio.SocketStream(trio.socket.from_stdlib_socket(
        a)), PeerInfo("agent")), p.Role.DIALER, settings, None)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.tunnel.handle_transport, StreamTransport(
            trio.SocketStream(trio.socket.from_stdlib_socket(b)), PeerInfo("server")))
        await agent.dial_handshake(p.Hello(identity={"node": "edge-1",
                                                     "token": EGRESS_TOKEN}))
        await nursery.start(agent.run)
        yield agent
        nursery.cancel_scope.cancel()


async def main(mib: int, rr_count: int, opens: int, parallel: int,
               tls: bool, fast_path: bool = False, relays: int = 0,
               handler_task: bool = False, egress: int = 0) -> dict[str, float]:
    a, b = tcp_pair()
    sa: trio.abc.Stream = trio.SocketStream(trio.socket.from_stdlib_socket(a))
    sb: trio.abc.Stream = trio.SocketStream(trio.socket.from_stdlib_socket(b))
    if tls:  # the tunnel's own TLS layer, as in production (tls://)
        from nodeagent.trust import pki
        ca = pki.create_ca("micro")
        cert = pki.issue_server_certificate(ca, ["localhost"], [])
        ta = TLSStream(sa, pki.client_ssl_context(ca.certificate_pem),
                       server_hostname="localhost")
        tb = TLSStream(sb, pki.server_ssl_context(cert.certificate_pem, cert.key_pem),
                       server_side=True)
        async with trio.open_nursery() as handshakes:
            handshakes.start_soon(ta.do_handshake)
            handshakes.start_soon(tb.do_handshake)
        sa, sb = ta, tb
    settings = EndpointSettings(ping_interval=0, open_rate=1e9)
    if not fast_path:  # (set only when asked: older trees, run for A/B, lack the field)
        settings.send_fast_path = False
    d = TunnelConnection(StreamTransport(sa, PeerInfo("a")), p.Role.DIALER, settings, None)
    takes = {"take_stream": take_relay} if TAKES_STREAMS and not handler_task else {}
    acc = TunnelConnection(StreamTransport(sb, PeerInfo("b")), p.Role.ACCEPTOR, settings,
                           sink_or_echo, **takes)
    out: dict[str, float] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(acc.accept_handshake, allow_any_peer)
        await d.dial_handshake(p.Hello(identity={"node": "micro"}))
        await nursery.start(d.run)
        await nursery.start(acc.run)

        # bulk: one stream, sink
        stream = await d.open_stream(T, {"mode": "sink"})
        chunk = b"x" * (256 * 1024)
        n = mib * 4
        t0 = time.process_time()
        for _ in range(n):
            await stream.send_all(chunk)
        await stream.send_eof()
        assert await stream.receive_some() == b""
        out["bulk_cpu_s_per_gb"] = (time.process_time() - t0) / (n * len(chunk) / 1e9)
        await stream.aclose()

        # request/response on one stream, then on `parallel` streams at once (the HTTP
        # benchmark's shape: 16 connections, so the writer has several streams to batch)
        msg = b"r" * 64

        async def rr(count: int) -> None:
            stream = await d.open_stream(T, {"mode": "echo"})
            for _ in range(count):
                await stream.send_all(msg)
                got = 0
                while got < len(msg):
                    got += len(await stream.receive_some())
            await stream.aclose()

        t0 = time.process_time()
        await rr(rr_count)
        out["rr_cpu_us"] = (time.process_time() - t0) / rr_count * 1e6
        t0 = time.process_time()
        async with trio.open_nursery() as streams:
            for _ in range(parallel):
                streams.start_soon(rr, rr_count // parallel)
        out[f"rr{parallel}_cpu_us"] = (time.process_time() - t0) / (
            rr_count // parallel * parallel) * 1e6

        async def open_echo_close(mode: str, count: int,
                                  opener: TunnelConnection = d, target: p.Target = T) -> float:
            """CPU µs per stream opened in `mode`, echoing one byte, closed both ways."""
            t0 = time.process_time()
            for _ in range(count):
                stream = await opener.open_stream(target, {"mode": mode})
                await stream.send_all(b"x")
                await stream.receive_some()
                await stream.send_eof()
                while await stream.receive_some():
                    pass
                await stream.aclose()
            return (time.process_time() - t0) / count * 1e6

        # open, 1-byte echo, close: the acceptor's handler echoes
        out["open_echo_close_cpu_us"] = await open_echo_close("echo", opens)
        # the same relayed to a TCP echo target (dial, accept, splice): the per-connection
        # work of both tunnel endpoints
        if relays:
            async with echo_target() as port:
                RELAY_TARGET[:] = [port]
                out["open_relay_close_cpu_us"] = await open_echo_close("relay", relays)
        # an intercepted connection's stream, the server's side: a real Server decides
        # it (egress policy), dials the echo target, accepts and splices
        if egress:
            async with echo_target() as port, egress_server(port, settings) as agent:
                out["open_egress_close_cpu_us"] = await open_echo_close(
                    "egress", egress, agent, p.Target("127.0.0.1", port))
        nursery.cancel_scope.cancel()
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.tunnel_cpu",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--rr", type=int, default=20000)
    parser.add_argument("--opens", type=int, default=3000)
    parser.add_argument("--parallel", type=int, default=16)
    parser.add_argument("--relays", type=int, default=0,
                        help="streams relayed to a C echo target (the agent's path)")
    parser.add_argument("--egress", type=int, default=0,
                        help="streams an agent opens that a nodeagent server dials to a C "
                             "echo target (the intercepted path's server side)")
    parser.add_argument("--tls", action="store_true", help="the tunnel's TLS layer too")
    parser.add_argument("--no-fast-path", dest="fast_path", action="store_false",
                        help="EndpointSettings.send_fast_path off (the writer's async send)")
    parser.add_argument("--handler-task", action="store_true",
                        help="relay in a handler task per stream even where the tree can "
                             "dial from the splice loop (relay_incoming_now)")
    args = parser.parse_args()
    print(json.dumps({k: round(v, 3) for k, v in trio.run(
        main, args.mib, args.rr, args.opens, args.parallel, args.tls,
        args.fast_path, args.relays, args.handler_task, args.egress).items()}))
