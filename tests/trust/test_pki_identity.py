"""The server identity certificates (pki.issue_server_identity, sign_server_csr,
server_name_from_certificate) and their separation from node certificates."""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from nodeagent.trust import pki

CA = pki.create_ca("identity test CA")


def der(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.DER)


def custom(uris: list[str], usages: list[x509.ObjectIdentifier]) -> bytes:
    """A certificate of our CA with these URI SANs and extended key usages."""
    key = pki.generate_key()
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "server-0")]))
            .issuer_name(CA.certificate.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + dt.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(u) for u in uris]), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(CA.signing_key, hashes.SHA256()))
    return der(cert)


def test_a_server_identity_names_its_pod_and_no_node() -> None:
    issued = pki.issue_server_identity(CA, "nodeagent-server-7d9f-x2")
    assert pki.server_name_from_certificate(der(issued.certificate)) == \
        "nodeagent-server-7d9f-x2"
    assert pki.node_name_from_certificate(der(issued.certificate)) is None
    eku = issued.certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert issued.certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME) == []


def test_sign_server_csr_certifies_the_key_for_the_authenticated_name_only() -> None:
    key = pki.generate_key()
    csr = pki.certificate_signing_request("edge-1", key)  # asks to be a node
    issued = pki.sign_server_csr(CA, csr, "server-0", valid_for=dt.timedelta(hours=24))
    assert issued.key is None and issued.certificate.public_key() == key.public_key()
    assert pki.server_name_from_certificate(der(issued.certificate)) == "server-0"
    assert pki.node_name_from_certificate(der(issued.certificate)) is None
    lifetime = issued.certificate.not_valid_after_utc - issued.certificate.not_valid_before_utc
    assert dt.timedelta(hours=24) <= lifetime <= dt.timedelta(hours=24, minutes=6)


def test_a_node_certificate_is_no_server_identity() -> None:
    node = pki.issue_client_certificate(CA, "edge-1")
    assert pki.server_name_from_certificate(der(node.certificate)) is None
    tunnel = pki.issue_server_certificate(CA, ["nodeagent-server"])
    assert pki.server_name_from_certificate(der(tunnel.certificate)) is None


@pytest.mark.parametrize(("uris", "usages"), [
    (["nodeagent://server/a", "nodeagent://server/b"], [ExtendedKeyUsageOID.CLIENT_AUTH]),
    (["nodeagent://server/a"], [ExtendedKeyUsageOID.SERVER_AUTH]),
    (["nodeagent://server/"], [ExtendedKeyUsageOID.CLIENT_AUTH]),
    (["nodeagent://server/Bad_Name"], [ExtendedKeyUsageOID.CLIENT_AUTH]),
    (["nodeagent://server/a/b"], [ExtendedKeyUsageOID.CLIENT_AUTH]),
])
def test_server_name_needs_exactly_one_valid_uri_and_client_auth(
        uris: list[str], usages: list[x509.ObjectIdentifier]) -> None:
    assert pki.server_name_from_certificate(custom(uris, usages)) is None


def test_the_same_shape_with_one_valid_uri_is_accepted() -> None:
    assert pki.server_name_from_certificate(custom(
        ["nodeagent://server/a", "https://example.com"],
        [ExtendedKeyUsageOID.CLIENT_AUTH])) == "a"
    assert pki.server_name_from_certificate(b"not DER") is None


@pytest.mark.parametrize("name", ["", "Server", "a/b", "-a", "a" * 254])
def test_invalid_server_names_are_not_issued(name: str) -> None:
    with pytest.raises(ValueError):
        pki.issue_server_identity(CA, name)


def test_a_tampered_csr_is_refused() -> None:
    csr = pki.key_signing_request(pki.generate_key())
    pem = csr.decode().splitlines()
    body = "".join(pem[1:-1])
    flipped = body[:40] + ("A" if body[40] != "A" else "B") + body[41:]
    bad = "\n".join([pem[0], *[flipped[i:i + 64] for i in range(0, len(flipped), 64)],
                     pem[-1]]).encode()
    with pytest.raises(ValueError):
        pki.sign_server_csr(CA, bad, "server-0")
