"""HTTP/2 and gRPC end to end through a real `nodeagent server` and agent: curl speaking
h2 (ALPN on the HTTPS listener, h2c prior knowledge on a plaintext one, HTTP/1.1 beside
both), and a stock grpcio client and server through an h2c route: every kind of call,
trailers, deadlines, cancellation, error statuses, 16 MiB messages, the front's own errors
as gRPC status, and each call balanced on its own across three endpoints on two nodes."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import hpack
import hyperframe.frame as hf
import pytest

from nodeagent.http.h2session import PREFACE
from nodeagent.testing.grpcservice import GrpcEcho, channel, method
from nodeagent.testing.procs import NodeagentProcess, rss_kib
from nodeagent.testing.standalone import (
    TOKEN,
    Certs,
    Upstream,
    agent_config,
    free_port,
    server_config,
)
from nodeagent.trust import pki

pytestmark = pytest.mark.needs("root")

MiB = 1024 * 1024


@dataclass
class Site:
    server: NodeagentProcess
    agents: list[NodeagentProcess]
    http_port: int  # the file's HTTP listener: app.test (h1) and grpc.test (h2c)
    ingress_http: int  # balanced.test: three h2c endpoints on two nodes
    ingress_https: int
    ca: Path
    echoes: list[GrpcEcho]


def _listen(port: int) -> str:
    return f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, certs: Certs,
         upstream: Upstream) -> Iterator[Site]:
    tmp = tmp_path_factory.mktemp("h2")
    echoes = [GrpcEcho(f"g{i}").start() for i in range(3)]
    ca = pki.create_ca("h2-test-ca")
    ca.write(tmp / "web-ca.crt", tmp / "web-ca.key")
    web = pki.issue_server_certificate(ca, ["app.test"], [])
    web.write(tmp / "web.crt", tmp / "web.key")
    scfg = server_config(tmp, certs, upstream)
    http_port, ingress_http, ingress_https = free_port(), free_port(), free_port()
    scfg["tokens"].append({"node": "edge-2", "token": TOKEN})
    scfg["http"] = [{"name": "public", "listen": _listen(http_port), "routes": [
        {"host": "app.test", "node": "edge-1", "target": _listen(upstream.http_port)},
        {"host": "grpc.test", "node": "edge-1", "target": _listen(echoes[0].port),
         "backend_protocol": "h2c"},
        {"host": "gone.test", "node": "edge-404", "target": _listen(echoes[0].port),
         "backend_protocol": "h2c"},
    ]}]
    scfg["ingress_http"] = _listen(ingress_http)
    scfg["ingress_https"] = _listen(ingress_https)
    scfg["ingress"] = {
        "rules": [
            {"name": "default/web", "host": "app.test", "backends": [
                {"node": "edge-1", "target": _listen(upstream.http_port)}]},
            {"name": "default/grpc", "host": "balanced.test", "backend_protocol": "h2c",
             "backends": [{"node": "edge-1", "target": _listen(echoes[0].port)},
                          {"node": "edge-1", "target": _listen(echoes[1].port)},
                          {"node": "edge-2", "target": _listen(echoes[2].port)}]},
        ],
        "tls": [{"name": "default/web", "hosts": ["app.test"],
                 "cert_pem": (tmp / "web.crt").read_text(),
                 "key_pem": (tmp / "web.key").read_text()}],
    }
    server = NodeagentProcess("server", scfg, tmp, "server").start()
    server.wait_ready()
    allow = [_listen(upstream.http_port), *(_listen(e.port) for e in echoes)]
    agents = []
    for node in ("edge-1", "edge-2"):
        acfg = agent_config(tmp, certs, upstream, scfg["tunnel"], allow=allow)
        acfg["node"] = node
        acfg["debug_socket"] = str(tmp / f"{node}.sock")
        agents.append(NodeagentProcess("agent", acfg, tmp, node).start())
    for agent in agents:
        agent.wait_ready()
    server.wait_for(lambda s: {a["node"] for a in s["agents"]} >= {"edge-1", "edge-2"},
                    what="both agents connected")
    yield Site(server, agents, http_port, ingress_http, ingress_https,
               tmp / "web-ca.crt", echoes)
    for proc in (server, *agents):
        proc.kill()
    for echo in echoes:
        echo.stop()
    for proc in (server, *agents):
        assert "Traceback" not in proc.logs(), proc.logs()


def curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["curl", "-sS", "--max-time", "10", *args], capture_output=True,
                          text=True, timeout=30)


# -- slice 1: the front speaks HTTP/2 ------------------------------------------------------


@pytest.mark.needs("curl")
def test_curl_h2c_prior_knowledge_and_http11_on_one_port(site: Site) -> None:
    url = f"http://127.0.0.1:{site.http_port}/pk?x=1"
    out = curl("--http2-prior-knowledge", "-H", "Host: app.test", "-w", "\n%{http_version}",
               url)
    assert out.returncode == 0, out.stderr
    body, version = out.stdout.rsplit("\n", 1)
    assert version == "2" and "path=/pk?x=1" in body and "host=app.test" in body
    out = curl("--http1.1", "-H", "Host: app.test", "-w", "\n%{http_version}", url)
    body, version = out.stdout.rsplit("\n", 1)
    assert version == "1.1" and "path=/pk?x=1" in body
    # Plain `--http2` on plaintext asks for an Upgrade: served as HTTP/1.1.
    out = curl("--http2", "-H", "Host: app.test", "-w", "\n%{http_version}", url)
    assert out.stdout.rsplit("\n", 1)[1] == "1.1" and "path=/pk" in out.stdout
    out = curl("--http2-prior-knowledge", "-H", "Host: nowhere.test", url)
    assert out.stdout.startswith("404 Not Found: no route for nowhere.test"), out


@pytest.mark.needs("curl")
def test_curl_alpn_h2_on_the_https_listener(site: Site) -> None:
    port = site.ingress_https
    base = ["--cacert", str(site.ca), "--resolve", f"app.test:{port}:127.0.0.1"]
    out = curl("--http2", *base, "-w", "\n%{http_version}", f"https://app.test:{port}/tls")
    assert out.returncode == 0, out.stderr
    body, version = out.stdout.rsplit("\n", 1)
    assert version == "2" and "path=/tls" in body
    out = curl("--http1.1", *base, "-w", "\n%{http_version}", f"https://app.test:{port}/t1")
    assert out.stdout.rsplit("\n", 1)[1] == "1.1" and "path=/t1" in out.stdout
    assert site.server.metric("nodeagent_http_front", counter="h2_connections",
                              listener="ingress-https") >= 1


# -- slice 2: gRPC to h2c backends -------------------------------------------------------


@pytest.fixture(scope="module")
def grpc_channel(site: Site) -> Iterator[Any]:
    ch = channel(f"127.0.0.1:{site.http_port}", "grpc.test")
    yield ch
    ch.close()


def test_grpc_every_kind_of_call(site: Site, grpc_channel: Any) -> None:
    ch = grpc_channel
    assert method(ch, "Unary")(b"hi", timeout=10) == b"g0:hi"
    assert list(method(ch, "ServerStream", "unary_stream")(b"5", timeout=10)) == [
        b"g0:%d" % i for i in range(5)]
    assert method(ch, "ClientStream", "stream_unary")(
        iter([b"a" * 10, b"b" * 20, b"c"]), timeout=10) == b"31"
    sent = [b"m%d" % i * (i + 1) for i in range(20)]
    assert list(method(ch, "Bidi", "stream_stream")(iter(sent), timeout=10)) == sent


def test_grpc_status_and_message_pass_as_trailers(site: Site, grpc_channel: Any) -> None:
    with pytest.raises(grpc.RpcError) as info:
        method(grpc_channel, "Fail")(b"why", timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert info.value.details() == "nope: why"


def test_grpc_16_mib_messages(site: Site, grpc_channel: Any) -> None:
    big = bytes(range(256)) * (16 * MiB // 256)
    assert method(grpc_channel, "Unary")(big, timeout=60) == b"g0:" + big
    got = list(method(grpc_channel, "Bidi", "stream_stream")(iter([big, big[:1000]]),
                                                               timeout=60))
    assert got == [big, big[:1000]]


def test_grpc_a_large_bidi_stream(site: Site, grpc_channel: Any) -> None:
    """One bidi stream moving 96 MiB each way in 1 MiB messages, up to 8 ahead of their
    echoes: the client's frames (grpcio sends them as large as the front allows, 256 KiB)
    and the backend's cross the front and the tunnel whole and in order, windows
    (4 MiB per stream) refilled all along."""
    messages = [bytes([i]) * 17 + bytes(range(256)) * (MiB // 256) for i in range(96)]
    ahead = threading.Semaphore(8)

    def requests() -> Any:
        for m in messages:
            ahead.acquire()
            yield m

    got = 0
    for i, reply in enumerate(method(grpc_channel, "Bidi", "stream_stream")(requests(),
                                                                          timeout=120)):
        assert reply == messages[i], i
        got += 1
        ahead.release()
    assert got == len(messages)


def test_grpc_deadline_and_cancellation_reach_the_backend(site: Site,
                                                          grpc_channel: Any) -> None:
    echo = site.echoes[0]
    echo.cancelled.clear()
    with pytest.raises(grpc.RpcError) as info:
        method(grpc_channel, "Hang")(b"", timeout=0.5)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert echo.cancelled.wait(10), "the backend never saw the deadline"
    echo.cancelled.clear()
    future = method(grpc_channel, "Hang").future(b"", timeout=30)
    threading.Event().wait(0.5)  # the call reached the backend
    # `nodeagent debug streams` shows the call as an h2 stream inside the tunnel stream
    # that carries the backend's shared h2c connection.
    out = subprocess.run([sys.executable, "-m", "nodeagent", "debug", "streams",
                          "--socket", str(site.server.socket)],
                         capture_output=True, text=True, timeout=30)
    assert "carries an h2c connection" in out.stdout, out
    assert "/test.Echo/Hang" in out.stdout, out.stdout
    future.cancel()
    assert echo.cancelled.wait(10), "the client's cancel never reached the backend"
    assert site.server.metric("nodeagent_http_front", counter="h2_client_resets",
                              listener="http:public") >= 1


def test_front_errors_are_grpc_statuses(site: Site) -> None:
    ch = channel(f"127.0.0.1:{site.http_port}", "gone.test")
    try:
        with pytest.raises(grpc.RpcError) as info:
            method(ch, "Unary")(b"x", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "edge-404" in info.value.details()
    finally:
        ch.close()
    ch = channel(f"127.0.0.1:{site.http_port}", "nowhere.test")
    try:
        with pytest.raises(grpc.RpcError) as info:
            method(ch, "Unary")(b"x", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "no route" in info.value.details()
    finally:
        ch.close()


def test_each_call_is_balanced_on_its_own(site: Site) -> None:
    """One client connection, 300 calls: three endpoints on two nodes each answer a third
    (round robin per call, so exactly 100 each)."""
    ch = channel(f"127.0.0.1:{site.ingress_http}", "balanced.test")
    try:
        who = method(ch, "Who")
        counts: dict[bytes, int] = {}
        for _ in range(300):
            name = who(b"", timeout=10)
            counts[name] = counts.get(name, 0) + 1
    finally:
        ch.close()
    assert set(counts) == {b"g0", b"g1", b"g2"}, counts
    assert all(90 <= n <= 110 for n in counts.values()), counts


def test_requests_are_counted_per_route_by_protocol_and_grpc_status(
        site: Site, grpc_channel: Any) -> None:
    def count(route: str, protocol: str, result: str) -> float:
        # (labels in the order the exposition writes them: sorted)
        return site.server.metric("nodeagent_http_route_requests_total",
                                  listener="http:public", protocol=protocol, result=result,
                                  route=route)

    def settled(route: str, protocol: str, result: str, want: float) -> float:
        """The count once it reaches `want` (or after a hang guard): a request is counted
        per route when its handler ends, just after the client has the whole answer (h1
        after the last byte is written, h2 and gRPC when the stream's handler returns), so
        a client may return first. The caller still asserts the exact value: one too
        many fails."""
        deadline = time.monotonic() + 30
        while (got := count(route, protocol, result)) < want and time.monotonic() < deadline:
            time.sleep(0.05)
        return got

    ok, denied = count("public[1]", "grpc", "OK"), count("public[1]", "grpc", "PERMISSION_DENIED")
    method(grpc_channel, "Unary")(b"x", timeout=10)
    with pytest.raises(grpc.RpcError):
        method(grpc_channel, "Fail")(b"x", timeout=10)
    assert settled("public[1]", "grpc", "OK", ok + 1) == ok + 1
    assert settled("public[1]", "grpc", "PERMISSION_DENIED", denied + 1) == denied + 1
    ch = channel(f"127.0.0.1:{site.http_port}", "gone.test")
    try:
        with pytest.raises(grpc.RpcError):
            method(ch, "Unary")(b"x", timeout=10)
    finally:
        ch.close()
    assert settled("public[2]", "grpc", "UNAVAILABLE", 1) >= 1
    h1 = count("public[0]", "h1", "2xx")
    curl("-H", "Host: app.test", f"http://127.0.0.1:{site.http_port}/")
    out = curl("--http2-prior-knowledge", "-H", "Host: app.test",
               f"http://127.0.0.1:{site.http_port}/")
    assert "path=/" in out.stdout, out
    assert settled("public[0]", "h1", "2xx", h1 + 1) == h1 + 1
    assert settled("public[0]", "h2", "2xx", 1) >= 1


# -- abuse: the HTTP/2 attacks of record against the real server --------------------------


def _attack(kind: str) -> bytes:
    """The bytes of one attack, after the connection preface and an empty SETTINGS."""
    enc = hpack.Encoder()
    head = [(b":method", b"GET"), (b":scheme", b"http"), (b":authority", b"app.test"),
            (b":path", b"/")]
    out = [PREFACE, hf.SettingsFrame(0).serialize()]
    if kind == "rapid_reset":
        for i in range(3000):
            frame = hf.HeadersFrame(2 * i + 1)
            frame.data = enc.encode(head)
            frame.flags.add("END_HEADERS")
            frame.flags.add("END_STREAM")
            rst = hf.RstStreamFrame(2 * i + 1)
            rst.error_code = 8  # CANCEL
            out += [frame.serialize(), rst.serialize()]
    elif kind == "control_flood":
        for i in range(20_000):
            ping = hf.PingFrame(0)
            ping.opaque_data = b"%08d" % i
            out.append(ping.serialize())
    elif kind in ("continuation_flood", "continuation_flood_256k"):
        # Frames of 16 KB, or as large as clients may send (256 KiB): refused once the
        # block held is over the header list size, not after h2's 64 CONTINUATIONs.
        size = 16_000 if kind == "continuation_flood" else 256 * 1024
        frame = hf.HeadersFrame(1)
        frame.data = enc.encode(head)
        out.append(frame.serialize())
        for _ in range(2000 if kind == "continuation_flood" else 130):
            cont = hf.ContinuationFrame(1)
            cont.data = b"\x00" * size
            out.append(cont.serialize())
    elif kind == "header_list_too_large":  # an HPACK bomb: one 4 KB field, then its index
        frame = hf.HeadersFrame(1)
        frame.data = enc.encode([*head, (b"x-bomb", b"a" * 4000)]) + bytes([0x80 | 62]) * 2000
        frame.flags.add("END_HEADERS")
        out.append(frame.serialize())
    return b"".join(out)


@pytest.mark.parametrize("kind,reason", [
    ("rapid_reset", "rapid_reset"), ("control_flood", "control_flood"),
    ("continuation_flood", "header_list_too_large"),
    ("continuation_flood_256k", "header_list_too_large"),
    ("header_list_too_large", "header_list_too_large")])
def test_h2_attacks_are_refused_with_bounded_cost(site: Site, kind: str, reason: str) -> None:
    """Each attack ends its connection with GOAWAY, counted by reason; what the server
    spent is counted: request streams it started (at most the reset allowance), upstream
    streams it opened, and its memory."""
    server = site.server

    def front(counter: str) -> float:
        return server.metric("nodeagent_http_front", counter=counter, listener="http:public")

    assert server.proc is not None
    before = {c: front(c) for c in ("h2_requests", "upstream_opens", f"refused_h2_{reason}")}
    rss = rss_kib(server.proc.pid)
    with socket.create_connection(("127.0.0.1", site.http_port), timeout=10) as sock:
        try:
            sock.sendall(_attack(kind))
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it finished sending: the point
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass
    assert front(f"refused_h2_{reason}") == before[f"refused_h2_{reason}"] + 1
    started = front("h2_requests") - before["h2_requests"]
    opened = front("upstream_opens") - before["upstream_opens"]
    assert started <= 1700 and opened <= 1700, (started, opened)  # of 3000 sent
    assert rss_kib(server.proc.pid) - rss < 32 * 1024
    print(f"{kind}: {started:.0f} request streams started, {opened:.0f} upstreams opened, "
          f"RSS +{rss_kib(server.proc.pid) - rss} KiB")
    # The server goes on serving.
    out = curl("--http2-prior-knowledge", "-H", "Host: app.test",
               f"http://127.0.0.1:{site.http_port}/after-{kind}")
    assert f"path=/after-{kind}" in out.stdout, out


def test_server_drain_lets_grpc_calls_in_flight_finish(tmp_path: Path, certs: Certs,
                                                       upstream: Upstream) -> None:
    """SIGTERM with gRPC calls in flight: the front sends GOAWAY, the calls finish with
    their answers, the server exits well before its drain deadline (the idle shared h2c
    connection does not hold it)."""
    echo = GrpcEcho("d").start()
    scfg = server_config(tmp_path, certs, upstream)
    port = free_port()
    scfg["http"] = [{"name": "public", "listen": _listen(port), "routes": [
        {"node": "edge-1", "target": _listen(echo.port), "backend_protocol": "h2c"}]}]
    server = NodeagentProcess("server", scfg, tmp_path, "server",
                              extra_args=["--shutdown-delay", "0.5", "--drain-seconds", "20"]
                              ).start()
    agent = NodeagentProcess("agent", agent_config(tmp_path, certs, upstream, scfg["tunnel"],
                                                   allow=[_listen(echo.port)]),
                             tmp_path, "agent").start()
    ch = channel(f"127.0.0.1:{port}", "grpc.test")
    try:
        server.wait_ready()
        agent.wait_ready()
        server.wait_for(lambda s: s["agents"], what="agent connected")
        assert method(ch, "Unary")(b"x", timeout=10) == b"d:x"
        calls = [method(ch, "Slow").future(b"2", timeout=30) for _ in range(3)]
        threading.Event().wait(0.5)  # the calls reached the backend
        started = time.monotonic()
        server.signal(signal.SIGTERM)
        assert [c.result() for c in calls] == [b"d:slow"] * 3
        assert server.proc is not None
        server.proc.wait(15)
        assert time.monotonic() - started < 15
    finally:
        ch.close()
        for proc in (server, agent):
            proc.kill()
        echo.stop()
    for proc in (server, agent):
        assert "Traceback" not in proc.logs(), proc.logs()
