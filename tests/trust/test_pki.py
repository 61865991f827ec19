"""nodeagent.trust.pki: certificates that verify where they should and fail where they should.

Handshakes run in memory (two SSLObjects over MemoryBIOs), so every case is a real TLS
verification by OpenSSL without a socket.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import stat
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import (
    BestAvailableEncryption,
    Encoding,
    PrivateFormat,
)
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from nodeagent.testing import memtls
from nodeagent.trust import pki


@pytest.fixture(scope="module")
def ca() -> pki.CertificateAuthority:
    return pki.create_ca("test CA")


@pytest.fixture(scope="module")
def server(ca: pki.CertificateAuthority) -> pki.IssuedCertificate:
    return pki.issue_server_certificate(ca, ["tunnel.example.com", "localhost"],
                                        ["127.0.0.1", "::1"])


def handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext,
              server_hostname: str = "tunnel.example.com") -> tuple[ssl.SSLObject, ssl.SSLObject]:
    """A handshake in memory (raises the first end's ssl error, a client certificate's
    rejection included); the client's and the server's end."""
    tls = memtls.handshake(server_ctx, client_ctx, server_hostname)
    return tls.client, tls.server


def test_ca_certificate(ca: pki.CertificateAuthority) -> None:
    cert = ca.certificate
    assert cert.issuer == cert.subject
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert bc.ca and bc.path_length == 0
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    assert cert.not_valid_after_utc - cert.not_valid_before_utc > dt.timedelta(days=3000)


def test_server_certificate_fields(ca: pki.CertificateAuthority,
                                   server: pki.IssuedCertificate) -> None:
    cert = server.certificate
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["tunnel.example.com", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in eku
    assert cert.issuer == ca.certificate.subject
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    with pytest.raises(ValueError, match="at least one"):
        pki.issue_server_certificate(ca)


def test_client_certificate_names_the_node(ca: pki.CertificateAuthority) -> None:
    issued = pki.issue_client_certificate(ca, "edge-7")
    cert = issued.certificate
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "edge-7"
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        "nodeagent://node/edge-7"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert pki.node_name_from_certificate(cert.public_bytes(Encoding.DER)) == "edge-7"
    # Short-lived by default.
    assert cert.not_valid_after_utc - cert.not_valid_before_utc <= dt.timedelta(days=2)
    for bad in ("", "a/b", "has space", "x" * 300):
        with pytest.raises(ValueError, match="invalid node name"):
            pki.issue_client_certificate(ca, bad)


def test_node_name_from_other_certificates(ca: pki.CertificateAuthority,
                                           server: pki.IssuedCertificate) -> None:
    # A server certificate (serverAuth+clientAuth, no node URI) names no node: a CN never
    # does, or the server's own certificate would pass as node "tunnel.example.com".
    assert pki.node_name_from_certificate(
        server.certificate.public_bytes(Encoding.DER)) is None
    assert pki.node_name_from_certificate(b"not a certificate") is None
    # A serverAuth-only certificate names no node.
    key = pki.generate_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "web")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1)
            .not_valid_before(now).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)
            .sign(key, hashes.SHA256()))
    assert pki.node_name_from_certificate(cert.public_bytes(Encoding.DER)) is None


def test_pem_round_trip_and_key_permissions(tmp_path: Path, ca: pki.CertificateAuthority,
                                            server: pki.IssuedCertificate) -> None:
    server.write(tmp_path / "tls.crt", tmp_path / "tls.key")
    pki.write_certificate(tmp_path / "ca.crt", ca.certificate)
    assert stat.S_IMODE(os.stat(tmp_path / "tls.key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "tls.crt").st_mode) == 0o644
    assert pki.load_certificate(tmp_path / "tls.crt") == server.certificate
    key = pki.load_private_key(tmp_path / "tls.key")
    assert server.key is not None
    assert key.private_numbers() == server.key.private_numbers()
    # Overwriting (rotation) keeps the mode and leaves no temporary files behind.
    (tmp_path / "tls.key").chmod(0o644)
    server.write(tmp_path / "tls.crt", tmp_path / "tls.key")
    assert stat.S_IMODE(os.stat(tmp_path / "tls.key").st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "tls.crt", "tls.key"]
    # A CA loaded back signs as before.
    loaded = pki.CertificateAuthority.load(ca.certificate_pem, ca.key_pem)
    leaf = pki.issue_client_certificate(loaded, "edge-2")
    assert leaf.certificate.issuer == ca.certificate.subject


def test_round_trip_handshake_with_mutual_tls(tmp_path: Path, ca: pki.CertificateAuthority,
                                              server: pki.IssuedCertificate) -> None:
    client = pki.issue_client_certificate(ca, "edge-1")
    # Files for one side, in-memory PEM for the other: both are accepted.
    server.write(tmp_path / "s.crt", tmp_path / "s.key")
    pki.write_certificate(tmp_path / "ca.crt", ca.certificate)
    server_ctx = pki.server_ssl_context(tmp_path / "s.crt", tmp_path / "s.key",
                                        client_ca=tmp_path / "ca.crt", require_client_cert=True)
    client_ctx = pki.client_ssl_context(ca.certificate_pem, client.certificate_pem,
                                        client.key_pem)
    c, s = handshake(server_ctx, client_ctx)
    assert c.version() == "TLSv1.3"
    peer = s.getpeercert(binary_form=True)
    assert peer is not None and pki.node_name_from_certificate(peer) == "edge-1"
    assert c.getpeercert(binary_form=True) == server.certificate.public_bytes(Encoding.DER)
    # By IP address too.
    handshake(server_ctx, client_ctx, server_hostname="127.0.0.1")


def test_verification_fails_with_a_wrong_ca(ca: pki.CertificateAuthority,
                                            server: pki.IssuedCertificate) -> None:
    other = pki.create_ca("other")
    server_ctx = pki.server_ssl_context(server.certificate_pem, server.key_pem)
    with pytest.raises(ssl.SSLCertVerificationError):
        handshake(server_ctx, pki.client_ssl_context(other.certificate_pem))
    # The server side: a client certificate from another CA is refused.
    mtls = pki.server_ssl_context(server.certificate_pem, server.key_pem,
                                  client_ca=ca.certificate_pem, require_client_cert=True)
    stranger = pki.issue_client_certificate(other, "edge-1")
    with pytest.raises(ssl.SSLError):
        handshake(mtls, pki.client_ssl_context(ca.certificate_pem, stranger.certificate_pem,
                                               stranger.key_pem))
    # And no certificate at all, when one is required.
    with pytest.raises(ssl.SSLError):
        handshake(mtls, pki.client_ssl_context(ca.certificate_pem))


def test_wrong_hostname_fails(server: pki.IssuedCertificate,
                              ca: pki.CertificateAuthority) -> None:
    server_ctx = pki.server_ssl_context(server.certificate_pem, server.key_pem)
    with pytest.raises(ssl.SSLCertVerificationError, match="mismatch"):
        handshake(server_ctx, pki.client_ssl_context(ca.certificate_pem),
                  server_hostname="evil.example.com")


def test_expiry_is_honoured(ca: pki.CertificateAuthority) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    expired = pki.issue_server_certificate(ca, ["tunnel.example.com"], not_before=past,
                                           valid_for=dt.timedelta(days=1))
    server_ctx = pki.server_ssl_context(expired.certificate_pem, expired.key_pem)
    with pytest.raises(ssl.SSLCertVerificationError, match="expired"):
        handshake(server_ctx, pki.client_ssl_context(ca.certificate_pem))
    future = pki.issue_server_certificate(
        ca, ["tunnel.example.com"], not_before=dt.datetime.now(dt.UTC) + dt.timedelta(days=1))
    with pytest.raises(ssl.SSLCertVerificationError, match="not yet valid"):
        handshake(pki.server_ssl_context(future.certificate_pem, future.key_pem),
                  pki.client_ssl_context(ca.certificate_pem))
    # An expired client certificate is refused by the server.
    old_client = pki.issue_client_certificate(ca, "edge-1", not_before=past,
                                              valid_for=dt.timedelta(hours=1))
    server = pki.issue_server_certificate(ca, ["tunnel.example.com"])
    mtls = pki.server_ssl_context(server.certificate_pem, server.key_pem,
                                  client_ca=ca.certificate_pem, require_client_cert=True)
    with pytest.raises(ssl.SSLError):
        handshake(mtls, pki.client_ssl_context(ca.certificate_pem, old_client.certificate_pem,
                                               old_client.key_pem))


def test_leaf_never_outlives_its_ca() -> None:
    short_ca = pki.create_ca("short", valid_for=dt.timedelta(days=2))
    leaf = pki.issue_server_certificate(short_ca, ["x.example"],
                                        valid_for=dt.timedelta(days=365))
    assert leaf.certificate.not_valid_after_utc <= short_ca.certificate.not_valid_after_utc


def test_csr_flow_binds_the_authenticated_name(ca: pki.CertificateAuthority) -> None:
    key = pki.generate_key()
    csr = pki.certificate_signing_request("edge-3", key)
    # The controller signs for the node it authenticated, whatever the CSR claims.
    issued = pki.sign_node_csr(ca, csr, "edge-4", valid_for=dt.timedelta(hours=12))
    assert issued.key is None
    assert issued.certificate.public_key() == key.public_key()
    assert pki.node_name_from_certificate(
        issued.certificate.public_bytes(Encoding.DER)) == "edge-4"
    with pytest.raises(ValueError):
        pki.sign_node_csr(ca, b"-----BEGIN CERTIFICATE REQUEST-----\nxx\n"
                              b"-----END CERTIFICATE REQUEST-----\n", "edge-4")


def test_contexts_are_hardened(server: pki.IssuedCertificate,
                               ca: pki.CertificateAuthority) -> None:
    s = pki.server_ssl_context(server.certificate_pem, server.key_pem, alpn=["nodeagent/1"])
    c = pki.client_ssl_context(ca.certificate_pem)
    for ctx in (s, c):
        assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
        assert ctx.options & ssl.OP_NO_COMPRESSION
    assert c.check_hostname and c.verify_mode == ssl.CERT_REQUIRED
    assert s.verify_mode == ssl.CERT_NONE  # no client_ca: clients are not asked
    with pytest.raises(ValueError, match="client_ca"):
        pki.server_ssl_context(server.certificate_pem, server.key_pem,
                               require_client_cert=True)
    with pytest.raises(ValueError, match="certificate"):
        pki.client_ssl_context(ca.certificate_pem, key=server.key_pem)
    # Optional client certificates: asked for, verified if given, not required.
    opt = pki.server_ssl_context(server.certificate_pem, server.key_pem,
                                 client_ca=ca.certificate_pem)
    assert opt.verify_mode == ssl.CERT_OPTIONAL
    handshake(opt, c)


def _client_cert(ca: pki.CertificateAuthority, uris: list[str],
                 usages: list[x509.ObjectIdentifier]) -> bytes:
    key = pki.generate_key()
    now = dt.datetime.now(dt.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edge-1")]))
               .issuer_name(ca.certificate.subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now).not_valid_after(now + dt.timedelta(hours=1))
               .add_extension(x509.ExtendedKeyUsage(usages), False))
    if uris:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.UniformResourceIdentifier(u) for u in uris]), False)
    return builder.sign(ca.signing_key, hashes.SHA256()).public_bytes(Encoding.DER)


def test_only_one_valid_node_uri_with_client_auth_names_a_node(
        ca: pki.CertificateAuthority) -> None:
    client = [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert pki.node_name_from_certificate(
        _client_cert(ca, ["nodeagent://node/edge-1"], client)) == "edge-1"
    for uris, usages in (
            ([], client),  # a CN alone
            (["nodeagent://node/edge-1"], [ExtendedKeyUsageOID.SERVER_AUTH]),
            (["nodeagent://node/edge-1", "nodeagent://node/edge-2"], client),
            (["nodeagent://node/Edge_1"], client),
            (["nodeagent://node/" + "a" * 300], client),
            (["nodeagent://node/a\nb"], client)):
        assert pki.node_name_from_certificate(_client_cert(ca, uris, usages)) is None, uris


def test_unusable_tls_inputs_say_which_and_why(tmp_path: Path, ca: pki.CertificateAuthority,
                                              server: pki.IssuedCertificate) -> None:
    stranger = pki.generate_key()
    cases: list[tuple[dict[str, Any], str, str | None, str]] = [
        ({"cert": tmp_path / "none.crt", "key": server.key_pem}, "cert",
         str(tmp_path / "none.crt"), "no such file"),
        ({"cert": server.key_pem, "key": server.key_pem}, "cert", None,
         "not a PEM certificate (it holds a private key)"),
        ({"cert": server.certificate_pem, "key": b"junk"}, "key", None,
         "not a PEM private key"),
        ({"cert": server.certificate_pem, "key": stranger}, "pair", None,
         "certificate and key do not match"),
        ({"cert": server.certificate_pem, "key": server.key_pem, "client_ca": b"junk"}, "ca",
         None, "not a PEM certificate"),
    ]
    for kwargs, which, path, problem in cases:
        with pytest.raises(pki.TlsInputError) as info:
            pki.server_ssl_context(**kwargs)
        assert (info.value.which, info.value.path, info.value.problem) == (which, path, problem)
    encrypted = server.certificate.public_bytes(Encoding.PEM) + stranger.private_bytes(
        Encoding.PEM, PrivateFormat.PKCS8, BestAvailableEncryption(b"secret"))
    with pytest.raises(pki.TlsInputError, match="encrypted private key") as info:
        pki.client_ssl_context(ca.certificate_pem, encrypted, None)
    assert info.value.which == "key"


def test_a_certificate_file_may_hold_its_key(tmp_path: Path, ca: pki.CertificateAuthority,
                                             server: pki.IssuedCertificate) -> None:
    """One file with the certificate and its key, on either side: the chain is loaded
    and presented (a context that skipped it would fail the handshake or present
    nothing)."""
    client = pki.issue_client_certificate(ca, "edge-1")
    server_both, client_both = tmp_path / "server.pem", tmp_path / "client.pem"
    server_both.write_bytes(server.certificate_pem + server.key_pem)
    client_both.write_bytes(client.certificate_pem + client.key_pem)
    server_ctx = pki.server_ssl_context(server_both, None, client_ca=ca.certificate_pem,
                                        require_client_cert=True)
    client_ctx = pki.client_ssl_context(ca.certificate_pem, client_both)
    c, s = handshake(server_ctx, client_ctx)
    assert c.getpeercert(binary_form=True) == server.certificate.public_bytes(Encoding.DER)
    assert s.getpeercert(binary_form=True) == client.certificate.public_bytes(Encoding.DER)


def test_contexts_never_ignore_a_missing_close_notify(ca: pki.CertificateAuthority,
                                                      server: pki.IssuedCertificate) -> None:
    """Some Python builds (Debian's 3.11.2) set OP_IGNORE_UNEXPECTED_EOF by default: a cut
    TLS connection would then read as a clean end. Ours always clear it."""
    for ctx in (pki.server_ssl_context(server.certificate_pem, server.key_pem),
                pki.client_ssl_context(ca.certificate_pem)):
        assert not ctx.options & ssl.OP_IGNORE_UNEXPECTED_EOF
