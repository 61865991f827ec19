"""TLS termination for the HTTP front: certificates chosen per connection by SNI.

`CertStore` maps host names (exact `app.example.com` or wildcard `*.example.com`, one
label as in the Ingress spec) to server `ssl.SSLContext`s. `TlsConfig.server_context()`
is the one context the listener wraps accepted connections in; its `sni_callback` looks
the client's server name up in the store and switches the connection to that context.
The owner replaces the store's contents with `CertStore.replace(...)` when Ingress
Secrets change; handshakes already done keep their certificate.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field

from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.http.tls")


def context_from_pem(cert_chain_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """A server context for one certificate chain and key (e.g. a kubernetes.io/tls Secret).

    Raises ssl.SSLError (or ValueError) when the PEM data is malformed or does not match.
    """
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    # The ssl module only loads key material from files: use a private temporary directory.
    with tempfile.TemporaryDirectory(prefix="nodeagent-tls-") as tmp:
        cert_path = os.path.join(tmp, "tls.crt")
        key_path = os.path.join(tmp, "tls.key")
        for path, data in ((cert_path, cert_chain_pem), (key_path, key_pem)):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert_path, key_path)
    return ctx


class CertStore:
    """Host name → server SSLContext, with an optional default for unknown or absent SNI."""

    def __init__(
        self,
        certs: Mapping[str, ssl.SSLContext] | None = None,
        default: ssl.SSLContext | None = None,
    ) -> None:
        self._exact: dict[str, ssl.SSLContext] = {}
        self._wild: dict[str, ssl.SSLContext] = {}
        self._default: ssl.SSLContext | None = None
        self.replace(certs or {}, default)

    def replace(
        self, certs: Mapping[str, ssl.SSLContext], default: ssl.SSLContext | None = None
    ) -> None:
        """Swap in a new set of certificates at once (single-threaded: no lock needed)."""
        exact: dict[str, ssl.SSLContext] = {}
        wild: dict[str, ssl.SSLContext] = {}
        for name, ctx in certs.items():
            name = name.lower().rstrip(".")
            if name.startswith("*."):
                wild[name[2:]] = ctx
            else:
                exact[name] = ctx
        self._exact, self._wild, self._default = exact, wild, default

    def lookup(self, server_name: str | None) -> ssl.SSLContext | None:
        if server_name:
            name = server_name.lower().rstrip(".")
            ctx = self._exact.get(name)
            if ctx is not None:
                return ctx
            dot = name.find(".")
            if dot > 0:
                ctx = self._wild.get(name[dot + 1 :])
                if ctx is not None:
                    return ctx
        return self._default

    def __len__(self) -> int:
        return len(self._exact) + len(self._wild)


@dataclass
class TlsConfig:
    """How the front terminates TLS: certificates by SNI and a handshake deadline."""

    certs: CertStore = field(default_factory=CertStore)
    handshake_timeout: float = 10.0

    def server_context(self) -> ssl.SSLContext:
        """The listener's context: no certificate of its own, it defers to the store."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.set_alpn_protocols(["h2", "http/1.1"])
        store = self.certs

        def select(
            sslobj: ssl.SSLObject, server_name: str | None, _base: ssl.SSLContext
        ) -> int | None:
            chosen = store.lookup(server_name)
            if chosen is None:
                log.info("tls: no certificate for server name", server_name=server_name)
                return ssl.ALERT_DESCRIPTION_UNRECOGNIZED_NAME
            sslobj.context = chosen
            return None

        ctx.sni_callback = select
        return ctx
