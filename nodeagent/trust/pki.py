"""nodeagent's small PKI: a CA, server and node (client) certificates, PEM files, and the
TLS contexts the tunnel uses.

Keys are EC P-256. A node certificate names its node twice: CN = node name (what people
and generic tools look at) and a URI SAN `nodeagent://node/<name>` (what the server
trusts, see `node_name_from_certificate`). The controller uses the same functions to sign
agents' short-lived certificates from a CSR.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from nodeagent.config import valid_node_name
from nodeagent.trust import tlscontext
from nodeagent.trust.tlscontext import TlsInputError

__all__ = [
    "NODE_URI_PREFIX",
    "SERVER_URI_PREFIX",
    "CertificateAuthority",
    "IssuedCertificate",
    "TlsInputError",
    "certificate_signing_request",
    "client_ssl_context",
    "create_ca",
    "generate_key",
    "issue_client_certificate",
    "issue_server_certificate",
    "issue_server_identity",
    "key_signing_request",
    "load_certificate",
    "load_certificates",
    "load_private_key",
    "node_name_from_certificate",
    "server_name_from_certificate",
    "server_ssl_context",
    "sign_node_csr",
    "sign_server_csr",
    "write_certificate",
    "write_private_key",
]

NODE_URI_PREFIX = "nodeagent://node/"
# A server replica's identity (its pod name) for the controller's config stream.
SERVER_URI_PREFIX = "nodeagent://server/"

CA_VALIDITY = dt.timedelta(days=3650)
SERVER_VALIDITY = dt.timedelta(days=365)
# Node certificates are short-lived: the agent renews them well before expiry.
CLIENT_VALIDITY = dt.timedelta(days=1)
# Tolerate clocks that are a little behind ours.
BACKDATE = dt.timedelta(minutes=5)

PrivateKey = ec.EllipticCurvePrivateKey
CertLike = x509.Certificate | bytes | str | os.PathLike[str]
KeyLike = PrivateKey | bytes | str | os.PathLike[str]


@dataclass(frozen=True)
class IssuedCertificate:
    """A certificate with its private key (None when signed from a CSR). Our CA signs
    leaves directly, so there is no intermediate chain to carry."""

    certificate: x509.Certificate
    key: PrivateKey | None = None

    @property
    def certificate_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        if self.key is None:
            raise ValueError("this certificate was signed from a CSR; its key is elsewhere")
        return _key_pem(self.key)

    def write(self, cert_path: str | os.PathLike[str], key_path: str | os.PathLike[str]) -> None:
        """Write the certificate (0644) and key (0600), each replaced atomically."""
        write_certificate(cert_path, self.certificate)
        if self.key is not None:
            write_private_key(key_path, self.key)


@dataclass(frozen=True)
class CertificateAuthority(IssuedCertificate):
    """A CA: its self-signed certificate and the key that signs."""

    @property
    def signing_key(self) -> PrivateKey:
        if self.key is None:
            raise ValueError("this CA has no private key loaded; it can only verify")
        return self.key

    @classmethod
    def load(cls, cert: CertLike, key: KeyLike | None = None) -> CertificateAuthority:
        return cls(load_certificate(cert), load_private_key(key) if key is not None else None)


# ------------------------------------------------------------------------------ issuing


def generate_key() -> PrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _validity(not_before: dt.datetime | None,
              valid_for: dt.timedelta) -> tuple[dt.datetime, dt.datetime]:
    """(not before, not after): from now (backdated a little for slow clocks) unless
    `not_before` is given."""
    if not_before is None:
        start = _now() - BACKDATE
        return start, start + BACKDATE + valid_for
    if not_before.tzinfo is None:
        not_before = not_before.replace(tzinfo=dt.UTC)
    return not_before, not_before + valid_for


def create_ca(common_name: str = "nodeagent CA", *, valid_for: dt.timedelta = CA_VALIDITY,
              not_before: dt.datetime | None = None,
              key: PrivateKey | None = None) -> CertificateAuthority:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    key = key or generate_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "nodeagent")])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    builder = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=True, crl_sign=True,
            content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ski, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                       critical=False)
    )
    start, end = _validity(not_before, valid_for)
    builder = builder.not_valid_before(start).not_valid_after(end)
    return CertificateAuthority(builder.sign(key, hashes.SHA256()), key)


def _leaf(ca: CertificateAuthority, subject: x509.Name, public_key: ec.EllipticCurvePublicKey,
          sans: Sequence[x509.GeneralName], usages: Sequence[x509.ObjectIdentifier], *,
          valid_for: dt.timedelta, not_before: dt.datetime | None) -> x509.Certificate:
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise ValueError("only EC keys are issued certificates")
    ca_ski = ca.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(ca.certificate.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, key_cert_sign=False, crl_sign=False,
            content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(
            ca_ski.value), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)),
                                        critical=False)
    start, end = _validity(not_before, valid_for)
    end = min(end, ca.certificate.not_valid_after_utc)  # a leaf never outlives its CA
    builder = builder.not_valid_before(start).not_valid_after(end)
    return builder.sign(ca.signing_key, hashes.SHA256())


def issue_server_certificate(
    ca: CertificateAuthority, dns_names: Iterable[str] = (),
    ip_addresses: Iterable[str | ipaddress.IPv4Address | ipaddress.IPv6Address] = (), *,
    common_name: str | None = None, valid_for: dt.timedelta = SERVER_VALIDITY,
    not_before: dt.datetime | None = None, key: PrivateKey | None = None,
) -> IssuedCertificate:
    """A TLS server certificate for these DNS names and IP addresses (serverAuth; also
    clientAuth so a server replica can dial another one)."""
    dns = list(dns_names)
    ips = [ipaddress.ip_address(ip) for ip in ip_addresses]
    if not dns and not ips:
        raise ValueError("a server certificate needs at least one DNS name or IP address")
    key = key or generate_key()
    cn = common_name or (dns[0] if dns else str(ips[0]))
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ip) for ip in ips]
    cert = _leaf(ca, x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]),
                 key.public_key(), sans,
                 [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                 valid_for=valid_for, not_before=not_before)
    return IssuedCertificate(cert, key)


def _check_node_name(node_name: str) -> None:
    if not valid_node_name(node_name):
        raise ValueError(f"invalid node name {node_name[:64]!r}: a node name is a "
                         f"lower-case DNS name")


def _node_subject(node_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "nodeagent:nodes")])


def issue_client_certificate(
    ca: CertificateAuthority, node_name: str, *, valid_for: dt.timedelta = CLIENT_VALIDITY,
    not_before: dt.datetime | None = None, key: PrivateKey | None = None,
    public_key: ec.EllipticCurvePublicKey | None = None,
) -> IssuedCertificate:
    """A node's client certificate: CN = node name, URI SAN nodeagent://node/<name>,
    clientAuth. Pass `public_key` to certify a key held elsewhere (no key returned)."""
    _check_node_name(node_name)
    if public_key is None:
        key = key or generate_key()
        public_key = key.public_key()
    else:
        key = None
    cert = _leaf(ca, _node_subject(node_name), public_key,
                 [x509.UniformResourceIdentifier(NODE_URI_PREFIX + node_name)],
                 [ExtendedKeyUsageOID.CLIENT_AUTH], valid_for=valid_for, not_before=not_before)
    return IssuedCertificate(cert, key)


def certificate_signing_request(node_name: str, key: PrivateKey) -> bytes:
    """The agent's side of signing: a PEM CSR for its node name."""
    _check_node_name(node_name)
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(_node_subject(node_name))
           .add_extension(x509.SubjectAlternativeName(
               [x509.UniformResourceIdentifier(NODE_URI_PREFIX + node_name)]), critical=False)
           .sign(key, hashes.SHA256()))
    return csr.public_bytes(serialization.Encoding.PEM)


def sign_node_csr(ca: CertificateAuthority, csr_pem: bytes, node_name: str, *,
                  valid_for: dt.timedelta = CLIENT_VALIDITY) -> IssuedCertificate:
    """The controller's side: certify the CSR's key for `node_name` — the name the
    controller authenticated, never what the CSR asks for; the CSR only proves the key."""
    csr = x509.load_pem_x509_csr(csr_pem)
    if not csr.is_signature_valid:
        raise ValueError("CSR signature is invalid")
    public_key = csr.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise ValueError("CSR key must be an EC key")
    return issue_client_certificate(ca, node_name, valid_for=valid_for, public_key=public_key)


def node_name_from_certificate(der: bytes) -> str | None:
    """The node a (verified) client certificate names: exactly one `nodeagent://node/<name>`
    URI SAN holding a valid node name, on a certificate with clientAuth usage. None for
    anything else — the CN never names a node: any certificate of the CA (a server's, say,
    which may carry clientAuth too) would otherwise pass as the node in its CN."""
    return _name_from_certificate(der, NODE_URI_PREFIX, valid_node_name)


def _name_from_certificate(der: bytes, prefix: str, valid: Callable[[str], bool]
                           ) -> str | None:
    """The one name after `prefix` in a clientAuth certificate's URI SANs, if `valid`."""
    try:
        cert = x509.load_der_x509_certificate(der)
        eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except (x509.ExtensionNotFound, ValueError):
        return None
    if ExtendedKeyUsageOID.CLIENT_AUTH not in eku:
        return None
    names = [uri[len(prefix):] for uri in uris if uri.startswith(prefix)]
    if len(names) != 1 or not valid(names[0]):
        return None
    return names[0]


def _check_server_name(server_name: str) -> None:
    # A pod name: a DNS subdomain (lower case), so it fits a URI path segment as is.
    if not server_name or len(server_name) > 253 or not all(
            c.islower() or c.isdigit() or c in "-." for c in server_name) or \
            not server_name[0].isalnum() or not server_name[-1].isalnum():
        raise ValueError(f"invalid server name {server_name[:64]!r}: a server name is a "
                         f"pod name (lower-case DNS name)")


def issue_server_identity(
    ca: CertificateAuthority, server_name: str, *, valid_for: dt.timedelta = CLIENT_VALIDITY,
    not_before: dt.datetime | None = None, key: PrivateKey | None = None,
    public_key: ec.EllipticCurvePublicKey | None = None,
) -> IssuedCertificate:
    """A server replica's client identity: URI SAN nodeagent://server/<name>, clientAuth
    only. Its subject is O=nodeagent:servers without a CN, so nothing that reads a CN can
    take it for a node. Pass `public_key` to certify a key held elsewhere."""
    _check_server_name(server_name)
    if public_key is None:
        key = key or generate_key()
        public_key = key.public_key()
    else:
        key = None
    subject = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "nodeagent:servers")])
    cert = _leaf(ca, subject, public_key,
                 [x509.UniformResourceIdentifier(SERVER_URI_PREFIX + server_name)],
                 [ExtendedKeyUsageOID.CLIENT_AUTH], valid_for=valid_for, not_before=not_before)
    return IssuedCertificate(cert, key)


def _csr_public_key(csr_pem: bytes) -> ec.EllipticCurvePublicKey:
    """The key a CSR proves possession of (its signature checked); ValueError otherwise."""
    csr = x509.load_pem_x509_csr(csr_pem)
    if not csr.is_signature_valid:
        raise ValueError("CSR signature is invalid")
    public_key = csr.public_key()
    if not isinstance(public_key, ec.EllipticCurvePublicKey):
        raise ValueError("CSR key must be an EC key")
    return public_key


def sign_server_csr(ca: CertificateAuthority, csr_pem: bytes, server_name: str, *,
                    valid_for: dt.timedelta = CLIENT_VALIDITY) -> IssuedCertificate:
    """The controller's side for a server replica: certify the CSR's key for
    `server_name`, the name the controller authenticated (the CSR's names are ignored)."""
    return issue_server_identity(ca, server_name, valid_for=valid_for,
                                 public_key=_csr_public_key(csr_pem))


def key_signing_request(key: PrivateKey, common_name: str = "nodeagent") -> bytes:
    """A PEM CSR that only proves possession of `key`: the controller decides the names."""
    csr = (x509.CertificateSigningRequestBuilder()
           .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
           .sign(key, hashes.SHA256()))
    return csr.public_bytes(serialization.Encoding.PEM)


def server_name_from_certificate(der: bytes) -> str | None:
    """The server replica a (verified) client certificate names: exactly one
    `nodeagent://server/<name>` URI SAN holding a valid name, on a certificate with
    clientAuth usage. None for anything else (no CN fallback)."""
    return _name_from_certificate(der, SERVER_URI_PREFIX, _valid_server_name)


def _valid_server_name(name: str) -> bool:
    try:
        _check_server_name(name)
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------------------- PEM


def _read(source: bytes | str | os.PathLike[str]) -> bytes:
    if isinstance(source, bytes):
        return source
    if isinstance(source, str) and source.lstrip().startswith("-----BEGIN"):
        return source.encode()
    return Path(source).read_bytes()


def load_certificates(source: CertLike) -> list[x509.Certificate]:
    """All certificates in a PEM file or PEM bytes (a chain or a CA bundle)."""
    if isinstance(source, x509.Certificate):
        return [source]
    certs = x509.load_pem_x509_certificates(_read(source))
    if not certs:
        raise ValueError("no certificate found")
    return certs


def load_certificate(source: CertLike) -> x509.Certificate:
    """The first certificate in a PEM file or PEM bytes."""
    return load_certificates(source)[0]


def load_private_key(source: KeyLike, password: bytes | None = None) -> PrivateKey:
    if isinstance(source, ec.EllipticCurvePrivateKey):
        return source
    key = serialization.load_pem_private_key(_read(source), password=password)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise ValueError("expected an EC private key")
    return key


def _key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _atomic_write(path: str | os.PathLike[str], data: bytes, mode: int) -> None:
    """Write to a temporary file in the same directory with `mode`, then rename: readers
    (a rotating agent, the TLS loader) never see a half-written file or a key that was
    briefly world-readable."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_certificate(path: str | os.PathLike[str],
                      *certs: x509.Certificate) -> None:
    """Write one or more certificates (leaf first, then chain) as PEM, mode 0644."""
    _atomic_write(path, b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certs),
                  0o644)


def write_private_key(path: str | os.PathLike[str], key: PrivateKey) -> None:
    """Write a private key as unencrypted PKCS#8 PEM, mode 0600."""
    _atomic_write(path, _key_pem(key), 0o600)


# ----------------------------------------------------------------------------- contexts


def server_ssl_context(cert: CertLike, key: KeyLike, client_ca: CertLike | None = None,
                       require_client_cert: bool = False, *,
                       alpn: Sequence[str] | None = None) -> ssl.SSLContext:
    """TLS 1.2+ server context. With `client_ca`, clients may present a certificate
    signed by it (verified; mutual TLS); `require_client_cert` makes that mandatory.
    `cert`/`key`/`client_ca` are paths, PEM bytes, or objects; one that cannot be used
    raises TlsInputError saying which and why (tlscontext, with `ssl` alone)."""
    return tlscontext.server_ssl_context(_pem(cert), _pem(key), _pem(client_ca),
                                         require_client_cert, alpn=alpn)


def _pem(source: Any) -> Any:
    """Certificate and key objects as PEM; paths and PEM as they are."""
    if isinstance(source, x509.Certificate):
        return source.public_bytes(serialization.Encoding.PEM)
    if isinstance(source, ec.EllipticCurvePrivateKey):
        return _key_pem(source)
    return source


def client_ssl_context(ca: CertLike | None = None, cert: CertLike | None = None,
                       key: KeyLike | None = None, *,
                       alpn: Sequence[str] | None = None) -> ssl.SSLContext:
    """TLS 1.2+ client context verifying the server against `ca` (the system trust store
    if None), with hostname checks; `cert` + `key` are our client certificate. An input
    that cannot be used raises TlsInputError saying which and why. Certificate and key
    objects become PEM; tlscontext does the rest with `ssl` alone (as an agent started
    from files does, without importing this module)."""
    return tlscontext.client_ssl_context(_pem(ca), _pem(cert), _pem(key), alpn=alpn)
