"""The dial errors docs/troubleshooting.md quotes for certificates that do not fit: a
name or address the certificate does not carry, and a clock that is off. Real TLS on
loopback; the messages are asserted word for word so the page cannot drift."""

from __future__ import annotations

import datetime as dt
import ssl
from pathlib import Path

import pytest
import trio

from nodeagent.trust import pki
from nodeagent.trust.tlscontext import client_ssl_context
from tunnel.dial import dial
from tunnel.transports import DialError

NOW = dt.datetime.now(dt.UTC)


async def refused_by(tmp_path: Path, certificate: pki.IssuedCertificate, ca: Path,
                     server_hostname: str | None = None) -> DialError:
    certificate.write(tmp_path / "s.crt", tmp_path / "s.key")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "s.crt", tmp_path / "s.key")

    async def handler(stream: trio.SocketStream) -> None:
        tls = trio.SSLStream(stream, context, server_side=True)
        with trio.move_on_after(5):
            try:
                await tls.do_handshake()
            except trio.BrokenResourceError:
                pass

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, handler, 0)
        port = listeners[0].socket.getsockname()[1]
        with pytest.raises(DialError) as info:
            await dial(f"wss://127.0.0.1:{port}/tunnel",
                       ssl_context=client_ssl_context(ca, None, None),
                       server_hostname=server_hostname)
        nursery.cancel_scope.cancel()
    assert info.value.reason == "tls"
    return info.value


@pytest.fixture
def ca(tmp_path: Path) -> pki.CertificateAuthority:
    authority = pki.create_ca("messages CA")
    authority.write(tmp_path / "ca.crt", tmp_path / "ca.key")
    return authority


async def test_address_not_in_the_certificate(tmp_path: Path,
                                              ca: pki.CertificateAuthority) -> None:
    cert = pki.issue_server_certificate(ca, ["nodeagent-tunnel.nodeagent.svc"])
    err = await refused_by(tmp_path, cert, tmp_path / "ca.crt")
    assert str(err).endswith(": TLS handshake failed: tls: certificate verify failed: IP "
                             "address mismatch, certificate is not valid for '127.0.0.1'.")


async def test_name_not_in_the_certificate(tmp_path: Path,
                                           ca: pki.CertificateAuthority) -> None:
    cert = pki.issue_server_certificate(ca, ["nodeagent-tunnel.nodeagent.svc"])
    err = await refused_by(tmp_path, cert, tmp_path / "ca.crt", "tunnel.example.com")
    assert str(err).endswith("certificate verify failed: Hostname mismatch, certificate "
                             "is not valid for 'tunnel.example.com'.")


@pytest.mark.parametrize(("not_before", "says"), [
    (NOW + dt.timedelta(hours=2), "certificate verify failed: certificate is not yet valid"),
    (NOW - dt.timedelta(days=3), "certificate verify failed: certificate has expired"),
])
async def test_a_clock_that_is_off(tmp_path: Path, ca: pki.CertificateAuthority,
                                   not_before: dt.datetime, says: str) -> None:
    cert = pki.issue_server_certificate(ca, [], ["127.0.0.1"], not_before=not_before,
                                        valid_for=dt.timedelta(days=1))
    err = await refused_by(tmp_path, cert, tmp_path / "ca.crt")
    assert str(err).endswith(f": TLS handshake failed: tls: {says}")
