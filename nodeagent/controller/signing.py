"""The certificate signing endpoint, on the config stream's TLS listener: how an agent or a
server replica gets the certificate that the config stream (and the tunnel) trusts.

    POST /v1/certificates
    Authorization: Bearer <projected ServiceAccount token, audience "nodeagent">
    {"kind": "node" | "server", "csr": "<PEM CSR>"}

    200 {"certificate": "<PEM leaf>", "ca": "<PEM CA bundle>", "not_after": "<RFC3339>"}
    400 bad_request | bad_csr                                 the body
    401 no_token | token_invalid | wrong_audience             the token
    403 wrong_service_account | not_pod_bound | pod_not_found | pod_uid_mismatch |
        pod_not_scheduled | bad_name | node_denied | node_unknown  who the token is
    429 rate_limited (Retry-After)                            too many requests now
    503 no_ca | api_unavailable                               try again later

A renewal: a request made over a connection that presents a still-valid client
certificate of the CA (the TLS handshake verified it) for a `kind` the certificate holds
is signed for that certificate's identity (`peer_identity`: node or server name) with no
TokenReview and no rate-limit slot — the certificate already proves what a token would.
The node must still exist and not be denied, the server's pod must still exist (the
controller's caches). Anyone else is anonymous, however valid their token.

An anonymous request that gets as far as its token costs a TokenReview (and maybe a pod
GET) at the API server, so those are bounded by a token bucket of their own
(`review_rate` a second, bursts of `review_burst`): a flood of bootstrap requests —
through the servers, from anyone who can dial them — costs kube-apiserver at most that;
the excess is answered 429 with Retry-After before any API call, and it can never take a
renewal's turn, which needs none. A token the API server said is not valid is
remembered (its SHA-256, for `FAILED_TOKEN_TTL`, at most `FAILED_TOKENS` of them): sent
again, it is refused at once and takes no slot. Agents retry with backoff.

A refusal is one JSON line `{"error": ..., "reason": <code>}`, counted by kind and reason,
and logged at most once a minute per reason (never with the token or the CSR).

The token proves the pod (TokenReview, audience `nodeagent`); the certificate names what
the API server says about that pod, never what the CSR asks for — the CSR only proves the
key, which never leaves the client:
- kind node, ServiceAccount `nodeagent-agent`: the node the token is bound to (the bound
  node claim; on clusters without it, the bound pod's spec.nodeName, its uid checked);
  certificate URI SAN `nodeagent://node/<node>`.
- kind server, ServiceAccount `nodeagent-server`: the bound pod (uid checked); URI SAN
  `nodeagent://server/<pod>`.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from nodeagent.config import DNS_NAME
from nodeagent.controller.configserver import Identity, refusal
from nodeagent.controller.metrics import ControllerMetrics
from nodeagent.kube import PODS, KubeClient, KubeError, NotFound
from nodeagent.ops.jsonhttp import Reply, Request
from nodeagent.ops.logs import get_logger
from nodeagent.trust import pki
from tunnel.log import RateLimitedLog

log = get_logger("nodeagent.controller.signing")
AUDIENCE = "nodeagent"
_CLAIM = "authentication.kubernetes.io/"
KINDS = ("node", "server")


class SigningRefused(Exception):
    def __init__(self, status: int, reason: str, message: str, *,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.retry_after = retry_after


@dataclass(frozen=True)
class SigningPolicy:
    namespace: str  # the ServiceAccounts' (and their pods') namespace: the controller's
    node_service_account: str = "nodeagent-agent"
    server_service_account: str = "nodeagent-server"
    validity: dt.timedelta = pki.CLIENT_VALIDITY

    def username(self, kind: str) -> str:
        account = self.node_service_account if kind == "node" else self.server_service_account
        return f"system:serviceaccount:{self.namespace}:{account}"


def _claim(user: dict[str, Any], name: str) -> str:
    values = (user.get("extra") or {}).get(_CLAIM + name) or []
    return str(values[0]) if isinstance(values, list) and len(values) == 1 else ""


async def authenticate(kube: KubeClient, token: str, kind: str, policy: SigningPolicy) -> str:
    """The name a certificate of `kind` may carry for the bearer of `token`; raises
    SigningRefused. KubeError (the API unreachable, RBAC) propagates."""
    status = await kube.review_token(token, audiences=[AUDIENCE])
    if status.get("authenticated") is not True:
        raise SigningRefused(401, "token_invalid", "the token is not valid (expired, "
                             "revoked, or not for audience nodeagent)")
    if AUDIENCE not in (status.get("audiences") or []):
        raise SigningRefused(401, "wrong_audience", "the token is not for audience nodeagent")
    user = status.get("user") or {}
    if user.get("username") != policy.username(kind):
        raise SigningRefused(403, "wrong_service_account",
                             f"a {kind} certificate needs a token of {policy.username(kind)}")
    node = _claim(user, "node-name") if kind == "node" else ""
    if not node:
        pod_name, pod_uid = _claim(user, "pod-name"), _claim(user, "pod-uid")
        if not pod_name or not pod_uid:
            raise SigningRefused(403, "not_pod_bound", "the token is not bound to a pod "
                                 "(use a projected ServiceAccount token)")
        try:
            pod = await kube.get(PODS, pod_name, namespace=policy.namespace)
        except NotFound:
            raise SigningRefused(403, "pod_not_found",
                                 f"pod {pod_name} no longer exists") from None
        if (pod.get("metadata") or {}).get("uid") != pod_uid:
            raise SigningRefused(403, "pod_uid_mismatch",
                                 f"pod {pod_name} was replaced since the token was issued")
        if kind == "server":
            node = pod_name
        else:
            node = str((pod.get("spec") or {}).get("nodeName") or "")
            if not node:
                raise SigningRefused(403, "pod_not_scheduled",
                                     f"pod {pod_name} is not on a node")
    if not DNS_NAME.match(node):
        raise SigningRefused(403, "bad_name", f"{node[:64]!r} is not a DNS name")
    return node


def rfc3339(when: dt.datetime) -> str:
    return when.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved up; `take()` is None if a token was
    there, else the seconds until one will be."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a token bucket needs rate > 0 and burst >= 1")
        self.rate, self.burst, self._clock = rate, float(burst), clock
        self._tokens, self._at = float(burst), clock()

    def take(self) -> float | None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return None
        return (1.0 - self._tokens) / self.rate


REVIEW_RATE = 20.0  # TokenReviews a second, per controller replica
REVIEW_BURST = 50  # a node pool booting at once
FAILED_TOKEN_TTL = 30.0  # seconds a token the API refused is refused without asking
FAILED_TOKENS = 10_000  # at most this many remembered (32 bytes each)


class FailedTokens:
    """Hashes of tokens TokenReview refused lately: a flood that repeats a token costs
    one review, not one a request. Bounded in count and age; the oldest go first."""

    def __init__(self, ttl: float = FAILED_TOKEN_TTL, size: int = FAILED_TOKENS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.size, self._clock = ttl, size, clock
        self._until: OrderedDict[bytes, float] = OrderedDict()

    @staticmethod
    def _key(token: str) -> bytes:
        return hashlib.sha256(token.encode()).digest()

    def add(self, token: str) -> None:
        key = self._key(token)
        self._until.pop(key, None)
        self._until[key] = self._clock() + self.ttl
        while len(self._until) > self.size:
            self._until.popitem(last=False)

    def __contains__(self, token: str) -> bool:
        until = self._until.get(self._key(token))
        return until is not None and until > self._clock()


class CertificateSigner:
    """The POST /v1/certificates handler. `ca()` is the CA as this replica knows it (None
    until the leader has created it)."""

    def __init__(self, kube: KubeClient, ca: Callable[[], pki.CertificateAuthority | None],
                 policy: SigningPolicy, metrics: ControllerMetrics, *,
                 denied_nodes: Callable[[], frozenset[str]] = frozenset,
                 review_rate: float = REVIEW_RATE, review_burst: int = REVIEW_BURST,
                 trust_bundle: Callable[[], bytes | None] = lambda: None,
                 still_exists: Callable[[Identity], bool] = lambda _: True) -> None:
        self.kube = kube
        # Anonymous requests' TokenReviews; renewals by certificate take none.
        self.reviews = TokenBucket(review_rate, review_burst, time.monotonic)
        self.failed_tokens = FailedTokens()
        # Whether a certificate's node (a Node) or server (its pod) still exists, from
        # the controller's caches: a renewal by certificate is signed only then.
        self.still_exists = still_exists
        # The CA bundle sent with each certificate (what its holder verifies the
        # controller and the servers with); None: the signing CA's certificate alone.
        self.trust_bundle = trust_bundle
        self.ca = ca
        # Nodes a ClusterTunnel revokes (deniedNodes): the servers refuse them, and they
        # get no certificate either.
        self.denied_nodes = denied_nodes
        self.policy = policy
        self.metrics = metrics
        self._refusals = RateLimitedLog(log)

    async def __call__(self, request: Request, identity: Identity | None = None) -> Reply:
        """`identity`: what the connection's verified client certificate says, if any."""
        kind = "invalid"
        renewal = False
        try:
            if request.method != "POST":
                raise SigningRefused(405, "method_not_allowed", "POST a CSR here")
            kind, csr = _parse(request.body)
            ca = self.ca()
            renewal = identity is not None and identity.kind == kind
            if renewal and identity is not None:
                if ca is None:
                    raise SigningRefused(503, "no_ca", "the CA is not loaded yet; try again")
                issued = self._renew(ca, identity, csr)
            else:
                scheme, _, token = request.headers.get("authorization", "").partition(" ")
                token = token.strip()
                if scheme.lower() != "bearer" or not token:
                    raise SigningRefused(401, "no_token", "Authorization: Bearer <projected "
                                         "ServiceAccount token> is required")
                if ca is None:
                    raise SigningRefused(503, "no_ca", "the CA does not exist yet; try again")
                if token in self.failed_tokens:
                    raise SigningRefused(401, "token_invalid", "the token is not valid "
                                         "(expired, revoked, or not for audience nodeagent)")
                wait = self.reviews.take()
                if wait is not None:
                    raise SigningRefused(429, "rate_limited", "too many certificate "
                                         "requests now; retry later", retry_after=wait)
                try:
                    issued = await self._issue(ca, token, kind, csr)
                except SigningRefused as refused:
                    if refused.reason in ("token_invalid", "wrong_audience"):
                        self.failed_tokens.add(token)
                    raise
        except SigningRefused as refused:
            self.metrics.certificate(kind, refused.reason)
            self._refusals.warning(f"{kind}:{refused.reason}", "certificate refused",
                                   kind=kind, status=refused.status, reason=refused.reason,
                                   error=str(refused))
            reply = refusal(refused.status, refused.reason, str(refused))
            if refused.retry_after is not None:
                reply = replace(reply, headers=(*reply.headers, (
                    "retry-after", str(max(1, math.ceil(refused.retry_after))))))
            return reply
        cert = issued.certificate
        self.metrics.certificate(kind, "issued")
        log.info("certificate issued", kind=kind, name=_name(issued),
                 proof="certificate" if renewal else "token",
                 serial=f"{cert.serial_number:x}", not_after=rfc3339(cert.not_valid_after_utc))
        body = {"certificate": issued.certificate_pem.decode(),
                "ca": (self.trust_bundle() or ca.certificate_pem).decode(),
                "not_after": rfc3339(cert.not_valid_after_utc)}
        return Reply(200, json.dumps(body).encode() + b"\n")

    def _renew(self, ca: pki.CertificateAuthority, identity: Identity, csr: bytes
               ) -> pki.IssuedCertificate:
        """Sign for the identity a verified client certificate proves: no TokenReview."""
        if identity.kind == "node" and identity.name in self.denied_nodes():
            raise SigningRefused(403, "node_denied", f"node {identity.name} is revoked (a "
                                 f"ClusterTunnel lists it in deniedNodes)")
        if not self.still_exists(identity):
            what = "node" if identity.kind == "node" else "server pod"
            raise SigningRefused(403, "node_unknown" if identity.kind == "node" else
                                 "pod_not_found", f"{what} {identity.name} no longer "
                                 "exists; request a certificate with a token")
        return self._sign(ca, identity.kind, csr, identity.name)

    def _sign(self, ca: pki.CertificateAuthority, kind: str, csr: bytes, name: str
              ) -> pki.IssuedCertificate:
        sign = pki.sign_node_csr if kind == "node" else pki.sign_server_csr
        try:
            return sign(ca, csr, name, valid_for=self.policy.validity)
        except ValueError as exc:
            raise SigningRefused(400, "bad_csr", f"the CSR cannot be signed: {exc}") from None

    async def _issue(self, ca: pki.CertificateAuthority, token: str, kind: str, csr: bytes
                     ) -> pki.IssuedCertificate:
        try:
            name = await authenticate(self.kube, token, kind, self.policy)
        except KubeError as exc:
            log.error("cannot check a certificate request with the API", kind=kind,
                      error=str(exc)[:300])
            raise SigningRefused(503, "api_unavailable",
                                 "the Kubernetes API cannot check the token now") from None
        if kind == "node" and name in self.denied_nodes():
            raise SigningRefused(403, "node_denied", f"node {name} is revoked (a "
                                 f"ClusterTunnel lists it in deniedNodes)")
        return self._sign(ca, kind, csr, name)


def _parse(body: bytes) -> tuple[str, bytes]:
    """(kind, CSR PEM) from the request body, the CSR's signature checked; SigningRefused
    otherwise. Checked before the token, so garbage costs no TokenReview."""
    try:
        doc = json.loads(body)
    except ValueError:
        raise SigningRefused(400, "bad_request", "the body must be JSON: "
                             '{"kind": "node"|"server", "csr": "<PEM>"}') from None
    if not isinstance(doc, dict) or doc.get("kind") not in KINDS or \
            not isinstance(doc.get("csr"), str):
        raise SigningRefused(400, "bad_request",
                             'the body must be {"kind": "node"|"server", "csr": "<PEM>"}')
    csr = doc["csr"].encode()
    try:
        if not x509.load_pem_x509_csr(csr).is_signature_valid:
            raise ValueError("its signature is invalid")
    except ValueError as exc:
        raise SigningRefused(400, "bad_csr", f"the CSR is not valid: {exc}") from None
    return str(doc["kind"]), csr


def _name(issued: pki.IssuedCertificate) -> str:
    der = issued.certificate.public_bytes(serialization.Encoding.DER)
    return pki.server_name_from_certificate(der) or pki.node_name_from_certificate(der) or "?"
