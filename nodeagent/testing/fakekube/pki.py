"""A throwaway CA with a server certificate for 127.0.0.1/localhost and client certificates
(CN = user, O = groups, the way the API server reads x509 client identities)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass
class CertPair:
    cert_pem: bytes
    key_pem: bytes

    def write(self, directory: Path, stem: str) -> tuple[Path, Path]:
        cert, key = directory / f"{stem}.crt", directory / f"{stem}.key"
        cert.write_bytes(self.cert_pem)
        key.write_bytes(self.key_pem)
        key.chmod(0o600)
        return cert, key


class CertificateAuthority:
    def __init__(self, common_name: str = "fakekube-ca") -> None:
        self._key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        self._name = name
        self._cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert_pem = self._cert.public_bytes(serialization.Encoding.PEM)

    def issue(self, common_name: str, *, organizations: tuple[str, ...] = (),
              dns: tuple[str, ...] = (), ips: tuple[str, ...] = (), server: bool = False
              ) -> CertPair:
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name(attrs)).issuer_name(self._name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False)
        )
        alt: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        alt += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
        if alt:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        return CertPair(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def server_cert(self) -> CertPair:
        return self.issue("fakekube", dns=("localhost",), ips=("127.0.0.1", "::1"), server=True)
