"""The config stream's TLS: this replica's serving certificate, issued by itself from the
CA, and the server context that verifies optional client certificates against that CA.

The certificate lives in memory only, never in a Secret: every replica has the CA key (it
reads the CA Secret to sign clients' certificates anyway), so each issues its own at start
and again at half-life — no API write, no Secret update permission, no coordination with
the leader, and its private key never leaves the process. It names the controller's
Service (`nodeagent-controller`, `.<ns>`, `.<ns>.svc`, `.<ns>.svc.cluster.local`) and any
extra names or IPs from the settings (`--tls-name`, e.g. 127.0.0.1 in tests).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from collections.abc import Callable, Sequence

import trio

from nodeagent.ops.logs import get_logger
from nodeagent.trust import pki

log = get_logger("nodeagent.controller")
SERVING_VALIDITY = dt.timedelta(days=30)


def service_names(service: str, namespace: str, extra: Sequence[str] = ()
                  ) -> tuple[list[str], list[str]]:
    """(DNS names, IPs) the serving certificate carries."""
    dns = [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
           f"{service}.{namespace}.svc.cluster.local"]
    ips: list[str] = []
    for name in extra:
        try:
            ips.append(str(ipaddress.ip_address(name)))
        except ValueError:
            dns.append(name)
    return list(dict.fromkeys(dns)), list(dict.fromkeys(ips))


class ServingTLS:
    """`await context()`: the current server context; waits until `ca()` gives a CA
    (`ca_changed` is set when it may have), re-issues at half-life or when the CA
    changes."""

    def __init__(self, ca: Callable[[], pki.CertificateAuthority | None],
                 dns: Sequence[str], ips: Sequence[str], *,
                 validity: dt.timedelta = SERVING_VALIDITY,
                 trust: Callable[[], bytes | None] = lambda: None) -> None:
        self._ca = ca
        # The CAs whose client certificates are accepted (None: the signing CA alone):
        # during a CA rotation, the old and the new.
        self._trust = trust
        self._trusted: bytes | None = None
        self.dns = list(dns)
        self.ips = list(ips)
        self.validity = validity
        self.ca_changed = trio.Event()
        self._context: ssl.SSLContext | None = None
        self._issued_from: pki.CertificateAuthority | None = None
        self._renew_at = dt.datetime.min.replace(tzinfo=dt.UTC)
        self.certificate: pki.IssuedCertificate | None = None

    def notify(self) -> None:
        """The CA may have changed (its Secret did)."""
        self.ca_changed.set()
        self.ca_changed = trio.Event()

    async def context(self) -> ssl.SSLContext:
        while (ca := self._ca()) is None:
            await self.ca_changed.wait()
        now = dt.datetime.now(dt.UTC)
        trusted = self._trust()
        if self._context is None or ca is not self._issued_from or now >= self._renew_at \
                or trusted != self._trusted:
            leaf = pki.issue_server_certificate(ca, self.dns, self.ips,
                                                common_name=self.dns[0],
                                                valid_for=self.validity)
            self._context = pki.server_ssl_context(leaf.certificate, leaf.key_pem,
                                                   client_ca=trusted or ca.certificate_pem,
                                                   require_client_cert=False)
            self._issued_from, self.certificate, self._trusted = ca, leaf, trusted
            self._renew_at = now + self.validity / 2
            log.info("config stream serving certificate issued",
                     names=",".join(self.dns + self.ips),
                     not_after=leaf.certificate.not_valid_after_utc.isoformat())
        return self._context
