"""Simulated agents for scripts.bench.config_propagation: `--count` config watches (nodes
`n{first}` … `n{first+count-1}`) against a controller's config stream, over TLS, each
presenting its own node certificate issued here from the controller's CA (`--ca-cert`,
`--ca-key`: the bench measures config delivery, not signing).

Runs in a process of its own, so the controller's CPU and RSS are measured alone. Each
applied config is one line on stdout, `A <node index> <version> <CLOCK_MONOTONIC>` (the
clock is system-wide, so the bench compares it with the time it made the change); `C
<count>` once every watch has applied a first config.

What a real agent does not do, kept out of what is measured: the report lines are
written by one task, every few milliseconds (the time in a line is the apply's own: a
write and a flush per apply was a tenth of this process's CPU at a fan-out); and once
every watch is open, the cyclic GC no longer walks the thousands of watches' objects
(`gcfreeze`, as the controller does): a real agent's collector walks one watch, and here
each full collection walked them all (in a py-spy profile of the fan-outs, a fifth of
this process's samples fell in allocations, where those collections run).

`--receive-only`: no agent code at all, to see the delivery apart from the agents'
parsing (which on a real cluster each node does on its own CPU, in parallel; here
thousands of them share this machine's cores with the controller). Each watch is a TLS
connection with its node certificate that sends the GET and, for each config line that
arrives, reports the time its last byte was read (`A` lines as above; the version is read
from the line's first bytes, nothing else of it is parsed). What a real agent then
spends to parse and apply the line is what the normal mode measures per agent.

    .venv/bin/python -m scripts.bench.lib.config_clients --port P --ca-cert F --ca-key F \\
        --first 0 --count 2500 [--receive-only]
"""

from __future__ import annotations

import argparse
import functools
import io
import random
import ssl
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from nodeagent.config import NodeConfig
from nodeagent.configstream.client import WatchStatus, watch_config
from nodeagent.ops.logs import configure
from nodeagent.runtime.gcfreeze import freeze_survivors_forever
from nodeagent.trust import pki
from tunnel.backoff import Backoff
from tunnel.transports.tls import TLSStream

REPORT_EVERY = 0.005  # seconds between writes of the report lines
OPENING = 300  # watches connecting at once, at most (about)


VERSION_PREFIX = b'{"version":'


async def receive_only(port: int, context: ssl.SSLContext, name: str,
                       applied: Callable[[int], Awaitable[None]]) -> None:
    """One watch that reads bytes and notes each config line's arrival (see the module
    docstring), reconnecting as the agents' watch does; the body's chunk framing
    (`3f2\\r`, `\\r`) splits on the same newlines and is skipped, as are heartbeats and
    the response head."""
    while True:
        try:
            stream = TLSStream(await trio.open_tcp_stream("127.0.0.1", port), context,
                               server_hostname="127.0.0.1")
            async with stream:
                await stream.do_handshake()
                await stream.send_all(f"GET /v1/config/nodes/{name}?after=-1 HTTP/1.1\r\n"
                                      "Host: 127.0.0.1\r\n\r\n".encode())
                buffer = b""
                while data := await stream.receive_some(1 << 16):
                    buffer += data
                    if b"\n" not in data:
                        continue
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if line.startswith(VERSION_PREFIX):
                            end = line.index(b",", len(VERSION_PREFIX))
                            await applied(int(line[len(VERSION_PREFIX):end]))
        except (OSError, trio.BrokenResourceError):
            pass
        await trio.sleep(0.2 + random.random())


async def run(port: int, ca: pki.CertificateAuthority, first: int, count: int,
              receive: bool = False) -> None:
    contexts: dict[str, ssl.SSLContext] = {}
    for i in range(first, first + count):
        cert = pki.issue_client_certificate(ca, f"n{i}")
        contexts[f"n{i}"] = pki.client_ssl_context(ca.certificate_pem, cert.certificate_pem,
                                                   cert.key_pem)
    started: set[int] = set()
    out = io.StringIO()

    async def apply(index: int, config: NodeConfig) -> None:
        await applied(index, config.version)

    async def applied(index: int, version: int) -> None:
        out.write(f"A {index} {version} {time.monotonic():.6f}\n")
        if index not in started:
            started.add(index)
            if len(started) == count:
                out.write(f"C {count}\n")
                nursery.start_soon(freeze_survivors_forever)

    async def report() -> None:
        while True:
            await trio.sleep(REPORT_EVERY)
            if out.tell():
                sys.stdout.write(out.getvalue())
                sys.stdout.flush()
                out.seek(0)
                out.truncate()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(report)
        for i in range(first, first + count):
            name = f"n{i}"
            if receive:
                nursery.start_soon(receive_only, port, contexts[name], name,
                                   functools.partial(applied, i))
            else:
                nursery.start_soon(functools.partial(
                    watch_config, open_stream=functools.partial(
                        trio.open_tcp_stream, "127.0.0.1", port),
                    host="127.0.0.1", path=f"/v1/config/nodes/{name}",
                    tls=functools.partial(contexts.__getitem__, name), model=NodeConfig,
                    apply=functools.partial(apply, i), status=WatchStatus(name),
                    backoff=Backoff(initial=0.2, maximum=2.0)))
            if i % 100 == 99:
                await trio.sleep(0.01)  # let earlier watches connect: no deep SYN burst
                # At most ~OPENING watches without their first config: on a busy machine
                # thousands of handshakes at once outlasted the watches' handshake
                # timeout, and their retries kept the controller busy for minutes.
                while i + 1 - first - len(started) > OPENING:  # noqa: ASYNC110
                    await trio.sleep(0.05)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.lib.config_clients",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ca-cert", type=Path, required=True)
    parser.add_argument("--ca-key", type=Path, required=True)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--receive-only", action="store_true",
                        help="note each config line's arrival, parse nothing (see above)")
    args = parser.parse_args()
    configure(level="warning")  # an "applied" log line per watch per change costs CPU here
    ca = pki.CertificateAuthority.load(args.ca_cert.read_bytes(), args.ca_key.read_bytes())
    try:
        trio.run(run, args.port, ca, args.first, args.count, args.receive_only)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
