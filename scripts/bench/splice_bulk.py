"""One TCP stream through the tunnel's production path, CPU per GB of each endpoint.

`scripts.bench.tunnel` measures throughput against `ssh -R` in network namespaces, where
two cores shared by iperf3, the tunnel and ssh decide the ratio. This measures what the
tunnel's own code costs per byte, which the machine's load moves far less: a server and
an agent, each in a process of its own, over TLS on loopback (the `tls://` transport's
`TLSStream`); the server's TCP listener splices each client connection into a stream
(`relay_connection` with `on_finished`: the splice loop), the agent relays each stream to
its target (`relay_incoming`: the splice loop). Up (client → target: the server's splice
loop reads and sends, the agent's reader writes into the target's socket) and down
(target → client: the agent sends). The client and the target are threads of this
process (blocking sockets, 1 MiB buffers), so their CPU is not counted; each endpoint's
CPU is read from /proc before and after each transfer.

    .venv/bin/python -m scripts.bench.splice_bulk                          # this tree
    .venv/bin/python -m scripts.bench.splice_bulk --tree /work/base-bulk   # A/B, interleaved
    .venv/bin/python -m scripts.bench.splice_bulk --tree /work/base-bulk --syscalls --mib 128

`--rr`: request/response latency too, 64-byte round trips through a stream of their own
to an echo target, alone and beside an up transfer (a bulk stream must not starve the
others), p50 and p99.

`--syscalls`: each endpoint's system calls per 128 MiB as well (`strace -c -f` attached
around each transfer, total and by name; strace slows the endpoints, so their CPU figures
in such a run are not comparable with a run without it).

With `--tree`, the other checkout's `tunnel` package runs the endpoints of every other
run (PYTHONPATH, -P), round by round. Prints each run and then one JSON object: per tree,
direction and side, the median CPU s/GB with its min-max, and the ratios of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUF = 1024 * 1024
TICK = os.sysconf("SC_CLK_TCK")
# The calls `--syscalls` reports by name (the rest are summed in `other`): the same keys
# every round, so the summary can take their medians.
SYSCALLS = ("epoll_wait", "epoll_ctl", "poll", "recvfrom", "readv", "read", "sendto",
            "sendmsg", "write", "writev")


# ------------------------------------------------------------------ the endpoints


def _endpoint(role: str, tunnel_port: int, certs: Path, ports: list[int]) -> None:
    """A child process: one tunnel endpoint (server: acceptor with TCP listeners that map
    listener i to target ports[i] on the agent's side; agent: dialer relaying to targets)."""
    import functools
    import ssl

    import trio

    from tunnel import protocol as p
    from tunnel.endpoint import EndpointSettings, IncomingStream, TunnelConnection
    from tunnel.relay import relay_connection, relay_incoming
    from tunnel.tcp import connect_tcp
    from tunnel.transports import PeerInfo, StreamTransport, TLSStream

    def done(result: object) -> None:
        pass

    async def allow(hello: p.Hello, peer: PeerInfo) -> p.Hello:
        return p.Hello(identity={"server": "bench"})

    settings = EndpointSettings(ping_interval=0)

    def suites(ctx: ssl.SSLContext) -> ssl.SSLContext:
        if os.environ.get("BULK_CIPHERSUITES"):
            set_tls13_ciphersuites(ctx, os.environ["BULK_CIPHERSUITES"])
        return ctx

    def negotiated(tls: TLSStream) -> None:
        print(f"{role}: {tls.ssl_object.version()} {tls.ssl_object.cipher()}",
              file=sys.stderr, flush=True)

    async def server() -> None:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(certs / "cert.pem", certs / "key.pem")
        suites(ctx)
        lst = trio.socket.socket()
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await lst.bind(("127.0.0.1", tunnel_port))
        lst.listen()
        print("listening", flush=True)
        sock, _ = await lst.accept()
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = TLSStream(trio.SocketStream(sock), ctx, server_side=True)
        await tls.do_handshake()
        negotiated(tls)
        conn = TunnelConnection(StreamTransport(tls, PeerInfo("agent")), p.Role.ACCEPTOR,
                                settings, None)
        await conn.accept_handshake(allow)
        async with trio.open_nursery() as nursery:
            await nursery.start(conn.run)

            async def serve(port: int, target: int, *,
                            task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                            ) -> None:
                listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
                task_status.started()

                async def handle(client: trio.SocketStream) -> None:
                    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    await relay_connection(client, functools.partial(
                        conn.open_stream, p.Target("127.0.0.1", target)), on_finished=done)

                await trio.serve_listeners(handle, listeners)

            for i in range(0, len(ports), 2):
                await nursery.start(serve, ports[i], ports[i + 1])
            print("ready", flush=True)

    async def agent() -> None:
        ctx = suites(ssl.create_default_context(cafile=certs / "cert.pem"))
        stream = await trio.open_tcp_stream("127.0.0.1", tunnel_port)
        stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = TLSStream(stream, ctx, server_hostname="localhost")
        await tls.do_handshake()

        async def handler(incoming: IncomingStream) -> None:
            t = incoming.target
            await relay_incoming(incoming, functools.partial(
                connect_tcp, t.host, t.port, connect_timeout=5), on_finished=done)

        conn = TunnelConnection(StreamTransport(tls, PeerInfo("server")), p.Role.DIALER,
                                settings, handler)
        await conn.dial_handshake(p.Hello(identity={"node": "bench"}))
        print("ready", flush=True)
        await conn.run()

    profile_to = os.environ.get("SPLICE_BULK_PROFILE")  # a directory: cProfile each side
    if profile_to:
        import cProfile
        import signal
        profiler = cProfile.Profile()

        def stop(*_: object) -> None:
            profiler.disable()
            profiler.dump_stats(f"{profile_to}/{role}.prof")
            os._exit(0)

        signal.signal(signal.SIGTERM, stop)
        profiler.enable()
    trio.run(server if role == "server" else agent)


def set_tls13_ciphersuites(ctx: object, suites: str) -> None:
    """SSL_CTX_set_ciphersuites on an `ssl.SSLContext`: Python 3.11's ssl cannot choose
    TLS 1.3 suites, so the SSL_CTX* is read at CPython 3.11's offset (right after the
    object header) and checked before it is used: measuring only."""
    import ctypes
    import ssl

    assert isinstance(ctx, ssl.SSLContext)
    libssl = ctypes.CDLL("libssl.so.3")  # the one the ssl module has loaded
    libssl.SSL_CTX_set_ciphersuites.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    libssl.SSL_CTX_get_options.argtypes = [ctypes.c_void_p]
    libssl.SSL_CTX_get_options.restype = ctypes.c_uint64
    ptr = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value
    if ptr is None or libssl.SSL_CTX_get_options(ptr) != ctx.options:
        raise RuntimeError("not CPython 3.11's _ssl layout: cannot set TLS 1.3 suites")
    if libssl.SSL_CTX_set_ciphersuites(ptr, suites.encode()) != 1:
        raise ValueError(f"OpenSSL refused the TLS 1.3 suites {suites!r}")


# ------------------------------------------------------------------ the driver


def _cpu(pid: int) -> float:
    return sum(_cpu_parts(pid))


def _cpu_parts(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK  # utime, stime


def _minor_faults(pid: int) -> int:
    """Page faults of `pid` so far that read nothing from disk: mostly fresh anonymous
    pages, which a large allocation the C heap took from the kernel anew costs per 4 KiB."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def _send(sock: socket.socket, size: int) -> None:
    buf = memoryview(b"x" * BUF)
    left = size
    while left:
        n = sock.send(buf[:min(left, BUF)])
        left -= n
    sock.shutdown(socket.SHUT_WR)


def _drain(sock: socket.socket) -> int:
    buf = bytearray(BUF)
    total = 0
    while n := sock.recv_into(buf):
        total += n
    sock.shutdown(socket.SHUT_WR)  # both ways ended: the splice ends at both ends
    return total


class Pair:
    """A server and an agent process of one tree, with a sink and a source target."""

    def __init__(self, tree: Path | None, certs: Path, callgrind: Path | None = None, *,
                 command: list[str] | None = None, env: dict[str, str] | None = None,
                 syscalls: Path | None = None, echo: bool = False) -> None:
        """`command`: another endpoint program taking the same arguments (role, tunnel
        port, certificate directory, listen/target port pairs) and printing the same
        lines, instead of this tree's or `tree`'s Python endpoints
        (`scripts.bench.bulk_parity` runs its C relay so); `env`: added to theirs."""
        self.callgrind = callgrind
        self.syscalls = syscalls  # a directory: strace -c around each transfer
        # Minor page faults per MiB of each endpoint too (this harness's main() sets it;
        # a subclass whose endpoints are other processes leaves it off).
        self.count_faults = False
        self.sink = socket.create_server(("127.0.0.1", 0))
        self.source = socket.create_server(("127.0.0.1", 0))
        ports = [_free_port() for _ in range(3)]
        self.up_port, self.down_port = ports[1], ports[2]
        env = dict(os.environ, **(env or {}))
        cmd: list[str] = []
        if callgrind is not None:  # instructions: counters zeroed and dumped per transfer
            cmd = ["valgrind", "--tool=callgrind", "--collect-atstart=yes",
                   f"--callgrind-out-file={callgrind}/callgrind.%p"]
        if command is not None:
            cmd += command
        else:
            env["PYTHONPATH"] = str(ROOT) if tree is None else f"{tree}:{ROOT}"
            # -P: not this script's directory first on sys.path. By path: the other tree
            # may not have this module, only its `tunnel` is wanted.
            cmd += [sys.executable, "-P", str(Path(__file__).resolve()), "--endpoint"]
        common = [str(ports[0]), str(certs)]
        targets = [str(ports[1]), str(self.sink.getsockname()[1]),
                   str(ports[2]), str(self.source.getsockname()[1])]
        self.rr_port = 0
        if echo:  # a third listener, to an echo target (threads of this process)
            self.rr_port = _free_port()
            targets += [str(self.rr_port), str(_echo_server())]
        self.server = subprocess.Popen([*cmd, "server", *common, *targets], env=env,
                                       stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.server.stdout is not None
        assert self.server.stdout.readline().strip() == "listening"
        self.agent = subprocess.Popen([*cmd, "agent", *common], env=env,
                                      stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.agent.stdout is not None
        assert self.agent.stdout.readline().strip() == "ready"
        assert self.server.stdout.readline().strip() == "ready"
        print(f"server pid {self.server.pid}, agent pid {self.agent.pid}", file=sys.stderr,
              flush=True)

    def transfer(self, direction: str, size: int) -> dict[str, float]:
        """One stream of `size` bytes; CPU s/GB of each endpoint and Gbit/s."""
        pids = {"server": self.server.pid, "agent": self.agent.pid}
        if self.callgrind is not None:
            for pid in pids.values():
                subprocess.run(["callgrind_control", "-z", str(pid)], check=True,
                               capture_output=True)
        tracers = self._trace(pids) if self.syscalls is not None else {}
        before = self.cpu() | (self.faults() if self.count_faults else {})
        t0 = time.perf_counter()
        client = socket.create_connection(
            ("127.0.0.1", self.up_port if direction == "up" else self.down_port))
        target, _ = (self.sink if direction == "up" else self.source).accept()
        sender, receiver = (client, target) if direction == "up" else (target, client)
        got: list[int] = []
        reader = threading.Thread(target=lambda: got.append(_drain(receiver)))
        reader.start()
        _send(sender, size)
        reader.join()
        sender.recv(1)  # the other way's EOF: the splice is over at both ends
        elapsed = time.perf_counter() - t0
        client.close()
        target.close()
        assert got == [size], (got, size)
        after = self.cpu() | (self.faults() if self.count_faults else {})
        out = {f"{k}_s_per_gb": (after[k] - before[k]) / (size / 1e9) for k in after
               if not k.endswith("_faults")}
        if self.count_faults:
            for k in pids:
                out[f"{k}_faults_per_mib"] = (
                    after[f"{k}_faults"] - before[f"{k}_faults"]) / (size / BUF)
        out["gbps"] = size * 8 / elapsed / 1e9
        if self.callgrind is not None:
            for k, pid in pids.items():
                out[f"{k}_instructions_per_mib"] = self._instructions(pid) / (size / BUF)
        for k, (tracer, path) in tracers.items():
            tracer.send_signal(signal.SIGINT)  # detach: strace writes its table
            tracer.wait()
            per = 128 * BUF / size
            for name, calls in _strace_counts(path.read_text()).items():
                out[f"{k}_{name}_per_128mib"] = calls * per
        return out

    def _trace(self, pids: dict[str, int]) -> dict[str, tuple[subprocess.Popen[bytes], Path]]:
        """strace -c attached to each endpoint (all its threads), once it has attached."""
        assert self.syscalls is not None
        tracers = {}
        for k, pid in pids.items():
            path = self.syscalls / f"{k}.{pid}.{time.monotonic_ns()}"
            tracer = subprocess.Popen(["strace", "-c", "-f", "-p", str(pid), "-o", str(path)],
                                      stderr=subprocess.PIPE)
            assert tracer.stderr is not None
            line = tracer.stderr.readline()  # "strace: Process N attached"
            if b"attached" not in line:
                raise RuntimeError(f"strace did not attach to {pid}: {line!r}")
            tracer.stderr.close()
            tracers[k] = (tracer, path)
        return tracers

    def rr(self, *, beside: int = 0, count: int = 1000) -> dict[str, float]:
        """p50 and p99 µs of `count` 64-byte round trips through a stream of their own to
        the echo target (`echo`), alone or while an up transfer of `beside` bytes runs."""
        bulk = None
        if beside:
            bulk = threading.Thread(target=self.transfer, args=("up", beside))
            bulk.start()
            time.sleep(0.3)  # the bulk stream under way
        sock = socket.create_connection(("127.0.0.1", self.rr_port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times = []
        try:
            for _ in range(count + 100):
                t0 = time.perf_counter()
                sock.sendall(b"r" * 64)
                got = 0
                while got < 64:
                    got += len(sock.recv(64 - got))
                times.append(time.perf_counter() - t0)
                if bulk is not None and not bulk.is_alive():
                    raise RuntimeError("the bulk transfer ended first: raise --mib")
        finally:
            sock.close()
            if bulk is not None:
                bulk.join()
        times = sorted(times[100:])
        key = "beside_bulk" if beside else "alone"
        return {f"rr_{key}_p50_us": times[len(times) // 2] * 1e6,
                f"rr_{key}_p99_us": times[int(len(times) * 0.99)] * 1e6}

    def cpu(self) -> dict[str, float]:
        """CPU seconds (user + system, and system alone) each endpoint has used so far."""
        out = {}
        for side, pid in (("server", self.server.pid), ("agent", self.agent.pid)):
            user, system = _cpu_parts(pid)
            out[side], out[f"{side}_sys"] = user + system, system
        return out

    def faults(self) -> dict[str, int]:
        """Minor page faults of each endpoint so far."""
        return {f"{side}_faults": _minor_faults(proc.pid)
                for side, proc in (("server", self.server), ("agent", self.agent))}

    def _instructions(self, pid: int) -> int:
        """Instructions since the last zeroing (callgrind_control -d dumps and zeroes)."""
        assert self.callgrind is not None
        before = set(self.callgrind.glob(f"callgrind.{pid}*"))
        subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
        (dump,) = set(self.callgrind.glob(f"callgrind.{pid}*")) - before
        for line in dump.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
        raise RuntimeError(f"no totals in {dump}")

    def close(self) -> None:
        for proc in (self.agent, self.server):
            proc.terminate()
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.sink.close()
        self.source.close()


def _echo_server() -> int:
    """A TCP echo server on threads of this process (daemons); its port."""
    listener = socket.create_server(("127.0.0.1", 0))

    def echo(conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return int(listener.getsockname()[1])


def _strace_counts(table: str) -> dict[str, int]:
    """Calls by name (SYSCALLS, the rest as `other`) and in all (`syscalls`) from the
    table `strace -c` writes."""
    counts = dict.fromkeys((*SYSCALLS, "other", "syscalls"), 0)
    for line in table.splitlines():
        parts = line.split()
        # % time, seconds, usecs/call, calls, [errors,] name
        if len(parts) < 5 or not parts[3].isdigit() or parts[-1] == "total":
            continue
        name, calls = parts[-1], int(parts[3])
        counts[name if name in SYSCALLS else "other"] += calls
        counts["syscalls"] += calls
    return counts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _certs(path: Path) -> None:
    from nodeagent.trust import pki
    ca = pki.create_ca("bench")
    cert = pki.issue_server_certificate(ca, ["localhost"], [])
    # The CA signs the leaf: the client trusts the chain through it.
    (path / "cert.pem").write_bytes(cert.certificate_pem + ca.certificate_pem)
    (path / "key.pem").write_bytes(cert.key_pem)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.splice_bulk",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="bytes per transfer")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", type=Path, help="another checkout to compare with")
    parser.add_argument("--instructions", action="store_true",
                        help="the endpoints under valgrind's callgrind: instructions per MiB "
                             "too (~50x slower: use --mib 32)")
    parser.add_argument("--rr", action="store_true",
                        help="request/response latency too, alone and beside a bulk stream")
    parser.add_argument("--syscalls", action="store_true",
                        help="system calls per 128 MiB of each endpoint too (strace -c; its "
                             "CPU figures are then not comparable: use --mib 128)")
    args = parser.parse_args()
    trees: dict[str, Path | None] = {"this": None}
    if args.tree is not None:
        trees["other"] = args.tree.resolve()
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        certs = Path(tmp)
        _certs(certs)
        for rnd in range(args.rounds):
            # The order alternates round by round: whichever tree ran first in a round
            # came out slower in fixed-order runs.
            order = list(trees.items())
            for name, tree in order if rnd % 2 == 0 else order[::-1]:
                grind = Path(tempfile.mkdtemp(dir=tmp)) if args.instructions else None
                pair = Pair(tree, certs, grind,
                            syscalls=Path(tempfile.mkdtemp(dir=tmp)) if args.syscalls else None,
                            echo=args.rr)
                pair.count_faults = True
                try:
                    pair.transfer("up", (4 if grind else 64) * BUF)  # warm up
                    for direction in ("up", "down"):
                        r = pair.transfer(direction, args.mib * BUF)
                        runs.setdefault(f"{name} {direction}", []).append(r)
                        print(f"round {rnd + 1} {name:5} {direction:4} "
                              + " ".join(f"{k}={v:.3f}" for k, v in r.items()),
                              file=sys.stderr, flush=True)
                    if args.rr:
                        # Beside 1 GiB at least (a few seconds), fewer round trips:
                        # each waits behind bulk (milliseconds).
                        r = pair.rr() | pair.rr(beside=max(args.mib, 1024) * BUF, count=300)
                        runs.setdefault(f"{name} rr", []).append(r)
                        print(f"round {rnd + 1} {name:5} rr   "
                              + " ".join(f"{k}={v:.0f}" for k, v in r.items()),
                              file=sys.stderr, flush=True)
                finally:
                    pair.close()
    summary: dict[str, object] = {"load_average": os.getloadavg()}
    for key, rs in runs.items():
        summary[key] = {k: [round(statistics.median(r[k] for r in rs), 3),
                            round(min(r[k] for r in rs), 3), round(max(r[k] for r in rs), 3)]
                        for k in rs[0]}
    if "other" in trees:
        ratios = {}
        for direction in ("up", "down", "rr") if args.rr else ("up", "down"):
            this, other = runs[f"this {direction}"], runs[f"other {direction}"]
            for k in this[0]:
                rr = [a[k] / b[k] for a, b in zip(this, other, strict=True) if b[k]]
                if rr:  # (a count that is 0 in the other tree has no ratio)
                    ratios[f"{direction} {k}"] = [round(statistics.median(rr), 3),
                                                  round(min(rr), 3), round(max(rr), 3)]
        summary["this/other, per round (median, min, max)"] = ratios
    print(json.dumps(summary))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--endpoint":
        role, tport, certdir, *rest = sys.argv[2:]
        _endpoint(role, int(tport), Path(certdir), [int(x) for x in rest])
    else:
        main()
