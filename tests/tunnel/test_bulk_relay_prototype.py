"""scripts.bench.bulk_parity's prototypes do the work docs/performance.md says they do, so
its figures are of working relays: the C per-read path (`bulk_relay.c`, as a program and
as a library under trio) moves a stream's bytes intact both ways, at once, with the
tunnel's windows smaller than the transfer; and
the measuring-only TLS 1.3 suite choice (ctypes, CPython 3.11's layout) really changes the
suite a handshake negotiates."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import ssl
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from nodeagent.testing import memtls
from scripts.bench.splice_bulk import Pair, _certs, set_tls13_ciphersuites

HEADERS = Path("/usr/include/openssl/ssl.h")


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> str:
    """A TLS handshake between two contexts in memory; the negotiated suite."""
    cipher = memtls.handshake(server_ctx, client_ctx).client.cipher()
    assert cipher is not None
    return cipher[0]


def _contexts(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    _certs(tmp_path)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    client = ssl.create_default_context(cafile=tmp_path / "cert.pem")
    return server, client


def test_the_tunnel_negotiates_aes_256_gcm_unless_the_bench_sets_the_suites(
        tmp_path: Path) -> None:
    server, client = _contexts(tmp_path)
    assert _handshake(server, client) == "TLS_AES_256_GCM_SHA384"
    set_tls13_ciphersuites(server, "TLS_AES_128_GCM_SHA256")
    set_tls13_ciphersuites(client, "TLS_AES_128_GCM_SHA256")
    assert _handshake(server, client) == "TLS_AES_128_GCM_SHA256"
    with pytest.raises(ValueError, match="refused"):
        set_tls13_ciphersuites(client, "TLS_NO_SUCH_SUITE")


def _pump(sock: socket.socket, data: bytes, got: list[bytes]) -> None:
    """Send `data` and half-close while a thread reads all the peer sends."""
    def read() -> None:
        chunks = []
        while chunk := sock.recv(1 << 20):
            chunks.append(chunk)
        got.append(b"".join(chunks))
    reader = threading.Thread(target=read)
    reader.start()
    view = memoryview(data)
    while view:
        # Odd sizes: reads that do not line up with frames or TLS records.
        view = view[sock.send(view[:77_777]):]
    sock.shutdown(socket.SHUT_WR)
    reader.join(timeout=120)
    assert not reader.is_alive()


@pytest.mark.slow
@pytest.mark.needs("gcc")
@pytest.mark.skipif(not HEADERS.exists(), reason="needs libssl-dev (OpenSSL's headers)")
@pytest.mark.skipif(not Path("/usr/include/http_parser.h").exists(),
                    reason="needs libhttp-parser-dev (the relay's HTTP front's parser)")
@pytest.mark.parametrize(("driver", "suites"), [("program", ""),
                                               ("program", "TLS_AES_128_GCM_SHA256"),
                                               ("trio", "")])
def test_the_c_relay_moves_both_directions_intact(tmp_path: Path, driver: str,
                                                  suites: str) -> None:
    """`program`: bulk_relay's own poll loop; `trio`: the library under a trio loop."""
    from scripts.bench import bulk_parity

    relay = bulk_parity.build_relay(tmp_path)
    (tmp_path / "certs").mkdir()
    _certs(tmp_path / "certs")
    command = [str(relay)] if driver == "program" else [
        sys.executable, "-P", bulk_parity.__file__, "--trio-endpoint",
        str(tmp_path / "bulk_relay.so")]
    pair = Pair(None, tmp_path / "certs", command=command,
                env={"BULK_CIPHERSUITES": suites, "PYTHONPATH": str(bulk_parity.ROOT)})
    try:
        # Streams one after another on one tunnel (a new one once the last has ended at
        # both ends): a stream ending early, cutting the other way short, showed in about
        # one in six.
        for _ in range(6):
            # 9 MiB each way at once: more than a stream's 2 MiB window and the
            # connection's 8 MiB, so credit has to come back in WINDOW frames.
            up, down = os.urandom(9 << 20), os.urandom(9 << 20)
            client = socket.create_connection(("127.0.0.1", pair.up_port), timeout=120)
            pair.sink.settimeout(30)
            target, _ = pair.sink.accept()
            target.settimeout(120)
            at_target: list[bytes] = []
            at_client: list[bytes] = []
            thread = threading.Thread(target=_pump, args=(target, down, at_target))
            thread.start()
            _pump(client, up, at_client)
            thread.join(timeout=120)
            client.close()
            target.close()
            assert len(at_target) == 1 and len(at_client) == 1
            assert hashlib.sha256(at_target[0]).digest() == hashlib.sha256(up).digest()
            assert hashlib.sha256(at_client[0]).digest() == hashlib.sha256(down).digest()
    finally:
        pair.close()


# ---------------------------------------------------------------- connections and HTTP
# The same C relay as scripts.bench.tunnel --c-relay runs it: a TCP mapping's
# connections, many at once, and the HTTP front routing by Host.

HTTP_HEADERS = Path("/usr/include/http_parser.h")


def needs_c_relay(test: Any) -> Any:
    """Slow, and needs what the relay is built with."""
    for mark in (pytest.mark.slow, pytest.mark.needs("gcc"),
                 pytest.mark.skipif(not HEADERS.exists(),
                                    reason="needs libssl-dev (OpenSSL's headers)"),
                 pytest.mark.skipif(not HTTP_HEADERS.exists(),
                                    reason="needs libhttp-parser-dev (the HTTP front's "
                                           "parser)")):
        test = mark(test)
    return test


def _free_ports(count: int) -> list[int]:
    """Ports free now and distinct from each other and from the relay's listeners (held
    open together while chosen: two picks one after the other may give the same port)."""
    socks = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Relay:
    """The C relay's server and agent processes on loopback, the tunnel on port `tunnel`,
    `maps` the server's LISTEN TARGET pairs."""

    def __init__(self, tmp: Path, tunnel: int, maps: list[str]) -> None:
        import resource
        import subprocess

        from scripts.bench import bulk_parity

        # Thousands of sockets at once, in this process and in the relay's (inherited).
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
        relay = bulk_parity.build_relay(tmp)
        certs = tmp / "certs"
        certs.mkdir()
        _certs(certs)
        self.server = subprocess.Popen([str(relay), "server", str(tunnel), str(certs),
                                        *maps],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
        assert self.server.stdout is not None and self.server.stderr is not None
        assert self.server.stdout.readline().strip() == "listening"
        self.agent = subprocess.Popen([str(relay), "agent", str(tunnel), str(certs)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True)
        assert self.agent.stdout is not None
        assert self.agent.stdout.readline().strip() == "ready"
        assert self.server.stdout.readline().strip() == "ready"
        assert self.server.stderr.readline().startswith("bulk_relay: TLSv1.3")
        assert self.agent.stderr is not None
        assert self.agent.stderr.readline().startswith("bulk_relay: TLSv1.3")
        self.open_now()  # both loops running: their epoll descriptors made
        self.fds_at_start = self.fds()

    def fds(self) -> tuple[int, int]:
        return tuple(len(os.listdir(f"/proc/{p.pid}/fd"))  # type: ignore[return-value]
                     for p in (self.server, self.agent))

    def open_now(self) -> list[str]:
        """Each side's count of open streams and HTTP connections (SIGUSR1)."""
        import signal

        out = []
        for proc in (self.server, self.agent):
            assert proc.stderr is not None
            proc.send_signal(signal.SIGUSR1)
            out.append(proc.stderr.readline().strip())
        return out

    def settled(self) -> None:
        """Nothing left open: each side's descriptors back to their count at the start,
        and no stream or HTTP connection in either's tables."""
        import time

        deadline = time.monotonic() + 30
        while self.fds() != self.fds_at_start and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self.fds() == self.fds_at_start
        assert self.open_now() == ["bulk_relay: streams=0 http_connections=0"] * 2

    def close(self) -> None:
        for proc in (self.agent, self.server):
            proc.terminate()
            proc.wait()
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()


def _echo_target(close_first: bool) -> socket.socket:
    """A target in a thread: echoes what each connection sends until its EOF, then closes;
    with `close_first`, closes once `SIZE` bytes are echoed (before the client does)."""
    import selectors

    listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
    listener.setblocking(False)

    def serve() -> None:
        sel = selectors.DefaultSelector()
        sel.register(listener, selectors.EVENT_READ)
        got: dict[socket.socket, int] = {}
        while True:
            for key, _ in sel.select():
                if key.fileobj is listener:
                    try:
                        conn, _ = listener.accept()
                    except BlockingIOError:
                        continue
                    except OSError:
                        return  # the test closed the listener
                    conn.setblocking(True)
                    got[conn] = 0
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                conn = key.fileobj  # type: ignore[assignment]
                data = conn.recv(65536)
                if data:
                    conn.sendall(data)
                    got[conn] += len(data)
                if not data or (close_first and got[conn] >= SIZE):
                    sel.unregister(conn)
                    del got[conn]
                    conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener


SIZE = 3000  # bytes each connection sends: more than one read at either end at times


def _connections(port: int, count: int, close_first: bool) -> None:
    """`count` connections open at once through the relay, each sending SIZE random
    bytes and checking their echo; then the client closes (its FIN crosses first), or
    with `close_first` waits for the target's EOF and closes after it."""
    socks = []
    sent = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", port), timeout=60)
        data = os.urandom(SIZE)
        s.sendall(data)
        socks.append(s)
        sent.append(data)
    for s, data in zip(socks, sent, strict=True):
        got = b""
        while len(got) < SIZE:
            chunk = s.recv(SIZE - len(got))
            assert chunk, "EOF before the echo"
            got += chunk
        assert got == data
        if not close_first:
            s.shutdown(socket.SHUT_WR)
        assert s.recv(1) == b""  # the other way's EOF: the stream ended at both ends
        s.close()


@needs_c_relay
@pytest.mark.parametrize("close_first", [False, True], ids=["client-closes", "target-first"])
def test_the_c_relay_carries_many_connections_and_forgets_them(
        tmp_path: Path, close_first: bool) -> None:
    target = _echo_target(close_first)
    listen, tunnel = _free_ports(2)
    relay = Relay(tmp_path, tunnel, [str(listen), str(target.getsockname()[1])])
    try:
        # 1,500 at once, three times: the slots and the descriptors of the first
        # rounds' streams are reused by the next ones.
        for _ in range(3):
            _connections(listen, 1500, close_first)
            relay.settled()
    finally:
        relay.close()
        target.close()


@needs_c_relay
def test_the_c_relay_resets_the_client_when_the_dial_is_refused(tmp_path: Path) -> None:
    listen, nothing, tunnel = _free_ports(3)  # nothing listens on `nothing`
    relay = Relay(tmp_path, tunnel, [str(listen), str(nothing)])
    try:
        for _ in range(20):
            # Reset, not closed: no EOF and no byte. On loopback the RST may come before
            # connect() has returned, and is then connect()'s error.
            with pytest.raises(ConnectionResetError):
                with socket.create_connection(("127.0.0.1", listen), timeout=30) as s:
                    s.sendall(b"x")
                    s.recv(1)
        relay.settled()
    finally:
        relay.close()


def _upstream(name: str) -> Any:
    """An HTTP/1.1 keep-alive upstream in a thread answering `name`, the method, the path
    and the length of the body it read."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self) -> None:
            size = int(self.headers.get("Content-Length") or 0)
            got = len(self.rfile.read(size)) if size else 0
            body = f"{name} {self.command} {self.path} {got}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@needs_c_relay
def test_the_c_relays_http_front_routes_each_request_by_host(tmp_path: Path) -> None:
    """Two Hosts, two upstreams, one keep-alive client connection: each request reaches
    its Host's upstream (a new tunnel stream when the Host changes), bodies included; an
    unknown Host closes the connection; nothing is left open after."""
    import http.client

    a, b = _upstream("a"), _upstream("b")
    listen, tunnel = _free_ports(2)
    routes = f"http:a.test={a.server_address[1]},B.Test={b.server_address[1]}"
    relay = Relay(tmp_path, tunnel, [str(listen), routes])
    try:
        conn = http.client.HTTPConnection("127.0.0.1", listen, timeout=30)
        conn.connect()
        sock = conn.sock
        for i, host in enumerate(["a.test", "a.test", "b.test:80", "a.test", "b.test",
                                  "b.test"]):
            body = os.urandom(100_000 * (i % 2))  # a body larger than one read, at times
            conn.request("POST" if body else "GET", f"/{i}", body=body or None,
                         headers={"Host": host})
            resp = conn.getresponse()
            assert resp.status == 200
            method = "POST" if body else "GET"
            assert resp.read().decode() == f"{host[0]} {method} /{i} {len(body)}"
            assert conn.sock is sock  # the same client connection throughout
        conn.request("GET", "/", headers={"Host": "c.test"})
        with pytest.raises((http.client.RemoteDisconnected, ConnectionResetError)):
            conn.getresponse()
        conn.close()
        relay.settled()
    finally:
        relay.close()
        a.shutdown()
        b.shutdown()


@needs_c_relay
def test_the_c_agent_serves_a_real_nodeagent_servers_mappings(tmp_path: Path) -> None:
    """The C relay's agent side (BULK_HELLO: the protocol's HELLO, PINGs answered) in
    place of the Python agent, behind this tree's nodeagent server: the same frames, so
    the prototype's per-connection work is the product's. Connections in both close
    orders carry their bytes, a refused dial resets the client, nothing stays open."""
    import json
    import subprocess

    from nodeagent.testing.procs import NodeagentProcess
    from nodeagent.testing.standalone import TOKEN, make_certs
    from scripts.bench import bulk_parity

    certs = make_certs(tmp_path)
    relay_dir = tmp_path / "relay"
    relay_dir.mkdir()
    (relay_dir / "ca.pem").write_bytes(certs.ca.read_bytes())
    relay = bulk_parity.build_relay(relay_dir)
    echo, echo_close = _echo_target(False), _echo_target(True)
    tunnel, *listens = _free_ports(4)
    targets = [echo.getsockname()[1], echo_close.getsockname()[1], _free_ports(1)[0]]
    cfg = {
        "server_id": "cloud-test", "tunnel": f"tls://127.0.0.1:{tunnel}",
        "tls": {"cert_file": str(certs.server_cert), "key_file": str(certs.server_key)},
        "tokens": [{"node": "edge-1", "token": TOKEN}],
        "tcp": [{"name": f"m{i}", "listen": f"127.0.0.1:{port}", "node": "edge-1",
                 "target": f"127.0.0.1:{target}"}
                for i, (port, target) in enumerate(zip(listens, targets, strict=True))],
        "debug_socket": str(tmp_path / "server.sock"),
        "keepalive": {"interval": 1, "timeout": 3},
    }
    server = NodeagentProcess("server", cfg, tmp_path, "server", log_level="info").start()
    agent = None
    try:
        server.wait_ready()
        agent = subprocess.Popen(
            [str(relay), "agent", f"127.0.0.1:{tunnel}", str(relay_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "BULK_HELLO": json.dumps({"node": "edge-1", "token": TOKEN})})
        assert agent.stdout is not None and agent.stderr is not None
        assert agent.stdout.readline().strip() == "ready"
        assert agent.stderr.readline().startswith("bulk_relay: TLSv1.3")
        server.wait_for(lambda s: any(a["node"] == "edge-1" for a in s["agents"]),
                        what="the C agent connected")
        fds = len(os.listdir(f"/proc/{agent.pid}/fd"))
        for _ in range(2):
            _connections(listens[0], 300, close_first=False)
            _connections(listens[1], 300, close_first=True)
        for _ in range(5):
            with pytest.raises(ConnectionResetError):
                with socket.create_connection(("127.0.0.1", listens[2]), timeout=30) as s:
                    s.sendall(b"x")
                    s.recv(1)
        time.sleep(2.5)  # keepalive PINGs answered: the tunnel is still up after
        _connections(listens[0], 10, close_first=False)
        deadline = time.monotonic() + 30
        while len(os.listdir(f"/proc/{agent.pid}/fd")) != fds and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(os.listdir(f"/proc/{agent.pid}/fd")) == fds
        agent.send_signal(signal.SIGUSR1)
        assert agent.stderr.readline().strip() == "bulk_relay: streams=0 http_connections=0"
        assert agent.poll() is None
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait()
            for pipe in (agent.stdout, agent.stderr):
                if pipe is not None:
                    pipe.close()
        server.stop()
        echo.close()
        echo_close.close()
