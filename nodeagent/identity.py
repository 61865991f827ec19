"""The client side of the controller's certificate signing endpoint
(nodeagent/controller/signing.py): how an agent or a server replica gets its identity.

    identity = await request_certificate(open_stream, host="nodeagent-controller.nodeagent.svc",
                                         token=projected_token, kind="node", key=key,
                                         ca_pem=ca_pem)
    context = identity.client_context()        # for the config watch (and the tunnel)

`open_stream` gives a byte stream to the controller — a TCP connection for a server, a
tunnel stream for an agent — and TLS runs over it from here, verifying the controller's
certificate against `ca_pem` for `host`: end to end, so a server relaying an agent's
bytes sees neither the token nor the certificate. The key never leaves this process: the
request carries a CSR that proves it; the controller decides what name the certificate
carries. Renew at `renew_at` (half-life), with a fresh token.
"""

from __future__ import annotations

import datetime as dt
import json
import ssl
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import h11
import trio
from cryptography.hazmat.primitives import serialization

from nodeagent import pki

MAX_RESPONSE = 64 * 1024
KINDS = ("node", "server")


class CertificateRefused(Exception):
    """The controller answered with an error: `status` and its `reason` code
    (signing.py lists them); 503 and transport failures are worth retrying."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"controller refused the certificate ({status} {reason}): {message}")
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class IssuedIdentity:
    key: pki.PrivateKey
    certificate_pem: bytes  # the leaf
    ca_pem: bytes  # the CA bundle to verify the controller and servers with
    not_before: dt.datetime
    not_after: dt.datetime

    @property
    def renew_at(self) -> dt.datetime:
        return self.not_before + (self.not_after - self.not_before) / 2

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())

    def client_context(self, *, alpn: Sequence[str] | None = None) -> ssl.SSLContext:
        """A TLS client context presenting this certificate, trusting only the CA."""
        return pki.client_ssl_context(self.ca_pem, self.certificate_pem, self.key_pem,
                                      alpn=alpn)

    def write(self, cert_path: str, key_path: str) -> None:
        """Certificate (0644) and key (0600), each replaced atomically."""
        pki.write_certificate(cert_path, *pki.load_certificates(self.certificate_pem))
        pki.write_private_key(key_path, self.key)


async def request_certificate(
    open_stream: Callable[[], Awaitable[trio.abc.Stream]], *, host: str, token: str,
    kind: str, key: pki.PrivateKey, ca_pem: bytes | str,
) -> IssuedIdentity:
    """POST /v1/certificates over TLS on a stream from `open_stream`. Raises
    CertificateRefused (the controller said no), ssl.SSLError / trio.BrokenResourceError
    / OSError (transport, including a controller whose certificate does not verify) or
    ValueError (an answer that is not a certificate for our key). No deadline of its own:
    wrap it in `trio.fail_after`."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    ca = ca_pem.encode() if isinstance(ca_pem, str) else ca_pem
    body = json.dumps({"kind": kind, "csr": pki.key_signing_request(key, kind).decode()})
    status, answer = await _post(open_stream, host, pki.client_ssl_context(ca), token,
                                 body.encode())
    try:
        doc = json.loads(answer)
    except ValueError:
        doc = None
    if status != 200:
        doc = doc if isinstance(doc, dict) else {}
        raise CertificateRefused(status, str(doc.get("reason", "unknown")),
                                 str(doc.get("error", answer[:200].decode(errors="replace"))))
    if not isinstance(doc, dict) or not isinstance(doc.get("certificate"), str) \
            or not isinstance(doc.get("ca"), str):
        raise ValueError("the controller's answer holds no certificate")
    cert = pki.load_certificate(doc["certificate"].encode())
    ours = key.public_key().public_bytes(serialization.Encoding.DER,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)
    if cert.public_key().public_bytes(serialization.Encoding.DER,
                                      serialization.PublicFormat.SubjectPublicKeyInfo) != ours:
        raise ValueError("the controller certified a key that is not ours")
    return IssuedIdentity(key=key, certificate_pem=doc["certificate"].encode(),
                          ca_pem=doc["ca"].encode(), not_before=cert.not_valid_before_utc,
                          not_after=cert.not_valid_after_utc)


async def _post(open_stream: Callable[[], Awaitable[trio.abc.Stream]], host: str,
                context: ssl.SSLContext, token: str, body: bytes) -> tuple[int, bytes]:
    stream = trio.SSLStream(await open_stream(), context, server_hostname=host,
                            https_compatible=True)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method="POST", target="/v1/certificates", headers=[
            ("host", host), ("authorization", f"Bearer {token}"),
            ("content-type", "application/json"), ("content-length", str(len(body))),
            ("connection", "close")])
        await stream.send_all(conn.send(request) + (conn.send(h11.Data(data=body)) or b"")
                              + (conn.send(h11.EndOfMessage()) or b""))
        status, answer = 0, b""
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(bytes(await stream.receive_some(65536)))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                answer += bytes(event.data)
                if len(answer) > MAX_RESPONSE:
                    raise ValueError("the controller's answer is too large")
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return status, answer
