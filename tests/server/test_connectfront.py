"""The CONNECT front's TCP listener in process, with real sockets and real TLS: who may use
it. (The full path through an agent is tests/e2e/test_connect.py.)"""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import trio
import trustme
from prometheus_client import CollectorRegistry

from nodeagent.config import ConnectFrontConfig, RoutesConfig
from nodeagent.ops.logs import get_logger
from nodeagent.server.connectfront import ConnectFront
from nodeagent.trust import pki
from tunnel import protocol as p
from tunnel.stream import TunnelStream


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """The cluster's nodeagent CA with a server and a node certificate, and another CA
    (kube-apiserver's) with a client certificate."""
    ca = pki.create_ca("nodeagent-test")
    ca.write(tmp_path / "ca.crt", tmp_path / "ca.key")
    pki.issue_server_certificate(ca, ["localhost"], ["127.0.0.1"]).write(
        tmp_path / "server.crt", tmp_path / "server.key")
    pki.issue_client_certificate(ca, "edge-1").write(tmp_path / "node.crt", tmp_path / "node.key")
    other = trustme.CA()
    other.cert_pem.write_to_path(str(tmp_path / "apiserver-ca.crt"))
    leaf = other.issue_cert("kube-apiserver", common_name="kube-apiserver-kubelet-client",
                            organization_name="system:masters")
    leaf.cert_chain_pems[0].write_to_path(str(tmp_path / "apiserver.crt"))
    leaf.private_key_pem.write_to_path(str(tmp_path / "apiserver.key"))
    # A kubelet's client certificate from the same CA (as a cluster CA signs them).
    kubelet = other.issue_cert("edge-2", common_name="system:node:edge-2",
                               organization_name="system:nodes")
    kubelet.cert_chain_pems[0].write_to_path(str(tmp_path / "kubelet.crt"))
    kubelet.private_key_pem.write_to_path(str(tmp_path / "kubelet.key"))
    return {p.stem + p.suffix: p for p in tmp_path.iterdir()}


async def _exchange(front: ConnectFront, port: int, files: dict[str, Path],
                    cert: str | None) -> bytes:
    ctx = ssl.create_default_context(cafile=str(files["ca.crt"]))
    if cert is not None:
        ctx.load_cert_chain(str(files[f"{cert}.crt"]), str(files[f"{cert}.key"]))
    raw = await trio.open_tcp_stream("127.0.0.1", port)
    stream = trio.SSLStream(raw, ctx, server_hostname="localhost")
    got = b""
    try:
        await stream.send_all(b"CONNECT edge-1:10250 HTTP/1.1\r\nHost: edge-1\r\n\r\n")
        while data := await stream.receive_some(4096):
            got += data
    except (trio.BrokenResourceError, ssl.SSLError):
        pass
    finally:
        await trio.aclose_forcefully(stream)
    return got


@pytest.mark.parametrize(("client_ca", "cert", "expect"), [
    # kube-apiserver's certificate from the configured CA: decided (no node: 502).
    ("apiserver-ca.crt", "apiserver", b"HTTP/1.1 502 "),
    # No certificate, or one the configured CA did not sign: no byte of HTTP back.
    ("apiserver-ca.crt", None, b""),
    ("apiserver-ca.crt", "node", b""),
    # The cluster's nodeagent CA given as the client CA: a node's own tunnel certificate
    # still may not use the front (a compromised node must not reach other kubelets).
    ("ca.crt", "node", b"HTTP/1.1 403 "),
    # Another identity of the client CA (a kubelet's): not on the allow list.
    ("apiserver-ca.crt", "kubelet", b"HTTP/1.1 403 "),
])
async def test_only_clients_with_a_certificate_from_the_client_ca(
        files: dict[str, Path], client_ca: str, cert: str | None, expect: bytes) -> None:
    config = ConnectFrontConfig.model_validate({
        "listen": "127.0.0.1:0", "tls": {"cert_file": str(files["server.crt"]),
                                         "key_file": str(files["server.key"]),
                                         "client_ca_file": str(files[client_ca])}})
    opened: list[str] = []

    async def open_stream(node: str, target: p.Target,
                          metadata: dict[str, str]) -> TunnelStream:
        opened.append(node)
        raise AssertionError("no route should reach a node here")

    registry = CollectorRegistry()
    front = ConnectFront(config, routes=RoutesConfig, open_stream=open_stream,
                         dial_timeout=1.0, registry=registry,
                         log=get_logger("test"))
    async with trio.open_nursery() as nursery:
        bound = await nursery.start(front.run)
        port = int(bound[0].rsplit(":", 1)[1])
        with trio.fail_after(10):
            got = await _exchange(front, port, files, cert)
        nursery.cancel_scope.cancel()
    assert got.startswith(expect) if expect else got == b"", got
    assert opened == []
    if cert == "node" and client_ca == "ca.crt":
        assert b"a nodeagent node or server certificate may not use the CONNECT front" in got
        assert front.outcomes == {"nodeagent_identity": 1}
    if cert == "kubelet":
        assert b"cn=system:node:edge-2 o=system:nodes" in got
        assert front.outcomes == {"client_not_allowed": 1}
        assert registry.get_sample_value("nodeagent_connect_requests_total",
                                          {"outcome": "client_not_allowed"}) == 1
    if not expect:
        assert registry.get_sample_value("nodeagent_connect_handshake_failures_total") == 1


async def test_a_unix_client_full_close_is_broken_and_a_half_close_is_end_of_file() -> None:
    """UdsClientStream: a client that shut down only its sending side still reads, so its
    end of file is a half-close to pass on; one that closed its socket reads nothing more,
    so its end of file breaks the stream (splice then resets the tunnel stream)."""
    import socket

    from nodeagent.server.connectfront import UdsClientStream

    for half in (True, False):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stream = UdsClientStream(trio.SocketStream(trio.socket.from_stdlib_socket(ours)))
        theirs.sendall(b"last words")
        if half:
            theirs.shutdown(socket.SHUT_WR)
        else:
            theirs.close()
        assert await stream.receive_some(100) == b"last words"
        if half:
            assert await stream.receive_some(100) == b""
            await stream.send_all(b"still read")
            assert theirs.recv(100) == b"still read"
            theirs.close()
        else:
            with pytest.raises(trio.BrokenResourceError, match="full close"):
                await stream.receive_some(100)
        await stream.aclose()
