"""Who a request is: bearer tokens from the fake's own table, x509 client certificates, or
anonymous.

The token table stands in for every token authenticator a real cluster has: a static token
file and bound ServiceAccount tokens, the latter with the `extra` a real one carries and
the service account validator's checks (expiry; the bound pod still there with the same
uid, or deleted less than a minute ago). TokenReview (`reviews.py`) asks the same table.
No OIDC and no authentication webhooks.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nodeagent.testing.fakekube.errors import ApiError
from nodeagent.testing.fakekube.objects import Obj
from nodeagent.testing.fakekube.rbac import AUTHENTICATED, UNAUTHENTICATED, UserInfo

API_AUDIENCE = "https://kubernetes.default.svc"

# (namespace, name) → the pod as stored, or None
PodLookup = Callable[[str, str], Obj | None]


@dataclass
class TokenInfo:
    """Who a bearer token authenticates as (for API access and for TokenReview)."""

    username: str
    uid: str = ""
    groups: list[str] = field(default_factory=lambda: ["system:authenticated"])
    audiences: list[str] = field(default_factory=lambda: [API_AUDIENCE])
    extra: dict[str, list[str]] = field(default_factory=dict)
    expires_at: float | None = None  # wall clock (time.time())
    pod: tuple[str, str, str] | None = None  # (namespace, name, uid) the token is bound to
    # Minted for a pod the store held: checked against it always (as a real apiserver
    # does); otherwise only with FakeKube(validate_bound_pods=True).
    pod_checked: bool = False

    def user(self) -> Obj:
        doc: Obj = {"username": self.username, "groups": list(self.groups)}
        if self.uid:
            doc["uid"] = self.uid
        if self.extra:
            doc["extra"] = {k: list(v) for k, v in self.extra.items()}
        return doc


class Authenticator:
    """The token table and the rules a request's credentials are checked by."""

    def __init__(self, find_pod: PodLookup, *, require_auth: bool,
                 validate_bound_pods: bool) -> None:
        self._find_pod = find_pod
        self.tokens: dict[str, TokenInfo] = {}
        self.require_auth = require_auth
        self.validate_bound_pods = validate_bound_pods

    def add_token(self, token: str, *, username: str, uid: str = "",
                  groups: list[str] | None = None, audiences: list[str] | None = None,
                  extra: dict[str, list[str]] | None = None, expires_at: float | None = None,
                  pod: tuple[str, str, str] | None = None) -> TokenInfo:
        info = TokenInfo(username=username, uid=uid,
                         groups=groups if groups is not None else ["system:authenticated"],
                         audiences=audiences if audiences is not None else [API_AUDIENCE],
                         extra=extra or {}, expires_at=expires_at, pod=pod)
        self.tokens[token] = info
        return info

    def add_service_account_token(
            self, token: str, *, namespace: str, service_account: str,
            pod_name: str | None = None, pod_uid: str | None = None,
            node_name: str | None = None, node_uid: str | None = None,
            audiences: list[str] | None = None, expires_at: float | None = None,
            sa_uid: str | None = None) -> TokenInfo:
        """A bound projected ServiceAccount token, with the `extra` a real one carries.

        Bound to a pod the store holds (its uid unless `pod_uid` says otherwise), the token
        stops authenticating once that pod is gone or replaced by one with another uid, as a
        real one does. A real TokenRequest refuses to mint for a pod that does not exist;
        here such a token is checked only with `validate_bound_pods=True`."""
        extra: dict[str, list[str]] = {
            "authentication.kubernetes.io/credential-id": [f"JTI={token[-12:]}"]}
        if pod_name:
            extra["authentication.kubernetes.io/pod-name"] = [pod_name]
            extra["authentication.kubernetes.io/pod-uid"] = [pod_uid or ""]
        if node_name:
            extra["authentication.kubernetes.io/node-name"] = [node_name]
            extra["authentication.kubernetes.io/node-uid"] = [node_uid or ""]
        pod = self._find_pod(namespace, pod_name) if pod_name else None
        if pod is not None:
            pod_uid = pod_uid or pod["metadata"]["uid"]
            extra["authentication.kubernetes.io/pod-uid"] = [pod_uid]
        info = self.add_token(
            token, username=f"system:serviceaccount:{namespace}:{service_account}",
            uid=sa_uid or f"sa-{namespace}-{service_account}",
            groups=["system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                    "system:authenticated"],
            audiences=audiences, extra=extra, expires_at=expires_at,
            pod=(namespace, pod_name, pod_uid or "") if pod_name else None)
        info.pod_checked = pod is not None
        return info

    def revoke_token(self, token: str) -> None:
        self.tokens.pop(token, None)

    def authenticate(self, headers: dict[str, str], peer_cert: Any) -> UserInfo:
        """The user of a request: its bearer token, else its client certificate, else
        anonymous (401 when authentication is required)."""
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            info = self.tokens.get(auth[7:].strip())
            if info is None or API_AUDIENCE not in info.audiences or self.token_invalid(info):
                raise ApiError(401, "Unauthorized", "Unauthorized")
            return UserInfo(info.username, tuple(info.groups), info.uid, dict(info.extra))
        peer_user = cert_user(peer_cert)
        if peer_user is not None:
            return UserInfo(peer_user[0], (*peer_user[1], AUTHENTICATED))
        if self.require_auth:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return UserInfo("system:anonymous", (UNAUTHENTICATED,))

    def token_invalid(self, info: TokenInfo) -> str | None:
        """Why a known token no longer authenticates (the service account validator's
        words), or None."""
        if info.expires_at is not None and info.expires_at < time.time():
            return "service account token has expired"
        if info.pod is not None and (info.pod_checked or self.validate_bound_pods):
            obj = self._find_pod(info.pod[0], info.pod[1])
            if obj is None or (info.pod[2] and obj["metadata"]["uid"] != info.pod[2]):
                return "service account token has been invalidated"
            deleting = obj["metadata"].get("deletionTimestamp")
            if deleting and _age(deleting) > 60:
                return "service account token has been invalidated"
        return None


def cert_user(cert: Any) -> tuple[str, list[str]] | None:
    """(common name, organizations) of a verified client certificate."""
    if not cert:
        return None
    cn, orgs = None, []
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                cn = value
            elif key == "organizationName":
                orgs.append(value)
    return (cn, orgs) if cn else None


def _age(timestamp: str) -> float:
    """Seconds since an RFC 3339 timestamp the store wrote."""
    moment = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.UTC)
    return time.time() - moment.timestamp()
