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
from typing import Any

import h11
import trio
from cryptography.hazmat.primitives import serialization

from nodeagent.trust import pki
from tunnel.backoff import Backoff
from tunnel.endpoint import HandshakeError
from tunnel.errors import StreamFailed
from tunnel.transports import TransportError

# The controller's signing endpoint (controller/signing.py serves it).
CERTIFICATES_PATH = "/v1/certificates"
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
    received_at: dt.datetime | None = None  # when it arrived here

    @property
    def renew_at(self) -> dt.datetime:
        """Half-way between when it arrived (or its notBefore, if later) and its expiry.
        Not from notBefore alone: the signer backdates that by minutes for slow clocks,
        which for a short-lived certificate would put half-life in the past (and renew
        it in a loop)."""
        start = max(self.not_before, self.received_at or self.not_before)
        return start + (self.not_after - start) / 2

    @property
    def key_pem(self) -> bytes:
        return self.key.private_bytes(serialization.Encoding.PEM,
                                      serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption())

    def client_context(self, *, alpn: Sequence[str] | None = None,
                       ca: bytes | None = None) -> ssl.SSLContext:
        """A TLS client context presenting this certificate, trusting only `ca` (default:
        the bundle the controller sent with it)."""
        return pki.client_ssl_context(ca or self.ca_pem, self.certificate_pem,
                                      self.key_pem, alpn=alpn)

    def write(self, cert_path: str, key_path: str) -> None:
        """Certificate (0644) and key (0600), each replaced atomically."""
        pki.write_certificate(cert_path, *pki.load_certificates(self.certificate_pem))
        pki.write_private_key(key_path, self.key)


async def request_certificate(
    open_stream: Callable[[], Awaitable[trio.abc.Stream]], *, host: str, token: str,
    kind: str, key: pki.PrivateKey, ca_pem: bytes | str,
    present: IssuedIdentity | None = None,
) -> IssuedIdentity:
    """POST /v1/certificates over TLS on a stream from `open_stream`. `present`: the
    identity being renewed; while it is valid the TLS handshake presents it, and the
    controller signs for it without a TokenReview (a renewal then takes no slot of the
    budget an anonymous flood competes for). Raises
    CertificateRefused (the controller said no), ssl.SSLError / trio.BrokenResourceError
    / OSError (transport, including a controller whose certificate does not verify) or
    ValueError (an answer that is not a certificate for our key). No deadline of its own:
    wrap it in `trio.fail_after`."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
    ca = ca_pem.encode() if isinstance(ca_pem, str) else ca_pem
    body = json.dumps({"kind": kind, "csr": pki.key_signing_request(key, kind).decode()})
    valid = present is not None and present.not_after > dt.datetime.now(dt.UTC)
    context = (present.client_context(ca=ca) if valid and present is not None
               else pki.client_ssl_context(ca))
    status, answer = await _post(open_stream, host, context, token, body.encode())
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
                          received_at=dt.datetime.now(dt.UTC),
                          not_after=cert.not_valid_after_utc)


async def _post(open_stream: Callable[[], Awaitable[trio.abc.Stream]], host: str,
                context: ssl.SSLContext, token: str, body: bytes) -> tuple[int, bytes]:
    stream = trio.SSLStream(await open_stream(), context, server_hostname=host,
                            https_compatible=True)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method="POST", target=CERTIFICATES_PATH, headers=[
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


Requester = Callable[[pki.PrivateKey], Awaitable[IssuedIdentity]]
# What a controller, a server relaying the request, or the path between can make an
# attempt fail with: each is retried with backoff, never the end of the process.
RETRIED: tuple[type[Exception], ...] = (
    CertificateRefused, OSError, ssl.SSLError, ValueError, trio.BrokenResourceError,
    trio.ClosedResourceError, trio.TooSlowError, StreamFailed, HandshakeError,
    TransportError, h11.ProtocolError)


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside any nesting of exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, CertificateRefused) else f"{type(exc).__name__}: {exc}"


class IdentityKeeper:
    """This process's certificate from the controller: `obtain()` gets the first one
    (retrying with capped, jittered backoff until it succeeds), `renew_forever()` replaces
    it at half-life with a fresh key, retrying until it expires. `request(key)` is how to
    ask (through the tunnel for an agent, directly for a server); `on_renewed` hears of
    every new certificate (to swap TLS contexts)."""

    def __init__(self, kind: str, request: Requester, *, log: Any,
                 on_renewed: Callable[[IssuedIdentity], None] = lambda _: None,
                 attempt_timeout: float = 20.0, retry_initial: float = 0.5,
                 retry_maximum: float = 30.0) -> None:
        self.kind = kind
        self._request = request
        self._log = log
        self._on_renewed = on_renewed
        self._attempt_timeout = attempt_timeout
        self._backoff = Backoff(initial=retry_initial, maximum=retry_maximum)
        self.identity: IssuedIdentity | None = None
        self.renewals = 0
        self.failures = 0
        self.last_error: str | None = None

    async def obtain(self) -> IssuedIdentity:
        """Every failure a peer can cause is retried, however it arrives: a requester
        that holds a connection open in a nursery (the agent's bootstrap connection)
        hands its error over wrapped in an exception group."""
        while True:
            try:
                return self._took(await self._attempt())
            except Exception as exc:
                failures = _leaves(exc)
                if not all(isinstance(f, RETRIED) for f in failures):
                    raise
                refused = [f for f in failures if isinstance(f, CertificateRefused)]
                # 401/403 will not heal by retrying fast (wrong account, pod gone): slow.
                self._failed("; ".join(_describe(f) for f in failures),
                             slow=any(f.status in (401, 403) for f in refused))
            await trio.sleep(self._backoff.next_delay())

    async def renew_forever(self) -> None:
        while True:
            assert self.identity is not None
            wait = (self.identity.renew_at - dt.datetime.now(dt.UTC)).total_seconds()
            await trio.sleep(max(wait, 0.0))
            self._backoff.reset()
            await self.obtain()
            self.renewals += 1

    def status(self) -> dict[str, Any]:
        identity = self.identity
        return {"kind": self.kind, "renewals": self.renewals, "failures": self.failures,
                "last_error": self.last_error,
                "not_after": identity.not_after.isoformat() if identity else None,
                "renew_at": identity.renew_at.isoformat() if identity else None}

    async def _attempt(self) -> IssuedIdentity:
        with trio.fail_after(self._attempt_timeout):
            return await self._request(pki.generate_key())

    def _took(self, identity: IssuedIdentity) -> IssuedIdentity:
        self.identity = identity
        self.last_error = None
        self._backoff.reset()
        self._log.info("certificate issued", kind=self.kind,
                       not_after=identity.not_after.isoformat())
        self._on_renewed(identity)
        return identity

    def _failed(self, message: str, *, slow: bool) -> None:
        self.failures += 1
        self.last_error = message
        if slow:
            self._backoff.to_maximum()
        self._log.warning("certificate request failed; retrying", kind=self.kind,
                          error=message[:300], failures=self.failures)
