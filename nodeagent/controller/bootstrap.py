"""What a fresh cluster needs before anything connects, and its upkeep: the PKI the
manifests mount — the CA (Secret nodeagent-ca, and its certificate alone for agents and
servers in ConfigMap nodeagent-ca) and the servers' tunnel certificate (Secret
nodeagent-server-tls).

Every replica reads the CA from its Secrets cache (it signs clients' certificates and its
own serving certificate with it); only the leader creates or re-issues anything. There is
no shared token any more: agents and servers prove who they are with their projected
ServiceAccount tokens (signing.py).
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from collections.abc import Callable
from typing import Any

import trio
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from nodeagent.kube import (
    CONFIGMAPS,
    SECRETS,
    Cache,
    KubeClient,
    KubeError,
    NotFound,
)
from nodeagent.ops.logs import get_logger
from nodeagent.trust import pki

log = get_logger("nodeagent.controller")
CA_SECRET = "nodeagent-ca"  # the CA's certificate and key
CA_CONFIGMAP = "nodeagent-ca"  # its certificate alone, for agents and servers (ca.crt)
SERVER_TLS_SECRET = "nodeagent-server-tls"  # the servers' tunnel certificate
SERVER_SERVICE = "nodeagent-server"  # the servers' Service: its names go into their cert
# The tunnel port's own Service (publishNotReadyAddresses): agents reach a new replica
# before it is ready, which its readiness waits for. Its names go into the cert too.
TUNNEL_SERVICE = "nodeagent-tunnel"
# The servers' in-cluster CONNECT front (Prometheus proxy_url, kube-apiserver egress over
# TCP): its names go into the same certificate, which that listener serves.
CONNECT_SERVICE = "nodeagent-connect"
MANAGED_LABEL = "nodeagent.io/managed"
# In Secret nodeagent-ca besides tls.crt/tls.key: the CAs to trust while rotating.
TRUST_KEY = "ca.crt"


class Bootstrap:
    """The PKI. `server_hosts` gives the public names the servers' certificate must carry
    besides the Service names (ClusterTunnel serverUrl hosts, the LoadBalancer address)."""

    def __init__(self, kube: KubeClient, secrets_cache: Cache, namespace: str,
                 server_hosts: Callable[[], list[str]]) -> None:
        self.kube = kube
        self.secrets = secrets_cache
        self.namespace = namespace
        self.server_hosts = server_hosts
        self.ca: pki.CertificateAuthority | None = None
        # The CA bundle clients are trusted by and told to trust: the Secret's `ca.crt`
        # (a CA rotation puts the old and the new CA there) plus the signing CA.
        self.trust_pem: bytes | None = None
        self._ca_pem = ""
        self._ca_published = False
        # When the servers' certificate in its Secret reaches half-life (the leader
        # re-issues it then): set by ensure_pki, waited on by the leader.
        self.server_renew_at: dt.datetime | None = None
        self.renew_changed = trio.Event()  # set (and replaced) when server_renew_at moves

    def read_ca(self) -> bool:
        """The CA (certificate and key) and the trust bundle from the Secrets cache;
        called whenever its Secret changes. True if either changed."""
        secret = self.secrets.get(CA_SECRET, self.namespace)
        if secret is None:
            return False
        cert, key = secret_value(secret, "tls.crt"), secret_value(secret, "tls.key")
        bundle = secret_value(secret, TRUST_KEY)
        if not cert or not key or cert + key + bundle == self._ca_pem:
            return False
        try:
            ca = pki.CertificateAuthority.load(cert.encode(), key.encode())
        except ValueError as exc:
            log.error("the CA Secret does not hold a usable CA", error=str(exc)[:200],
                      secret=f"{self.namespace}/{CA_SECRET}")
            return False
        try:
            self.trust_pem = trust_bundle(ca, bundle)
        except ValueError as exc:
            log.error(f"the CA Secret's {TRUST_KEY} is not a PEM bundle; trusting the "
                      f"signing CA alone", error=str(exc)[:200],
                      secret=f"{self.namespace}/{CA_SECRET}")
            self.trust_pem = ca.certificate_pem
        self.ca, self._ca_pem = ca, cert + key + bundle
        log.info("CA loaded", secret=f"{self.namespace}/{CA_SECRET}",
                 trusted=len(pki.load_certificates(self.trust_pem)))
        return True

    def _renew_at(self, when: dt.datetime | None) -> None:
        if when != self.server_renew_at:
            self.server_renew_at = when
            self.renew_changed.set()
            self.renew_changed = trio.Event()

    def start_leading(self) -> None:
        self._ca_published = False  # checked once per leadership

    def server_names(self) -> tuple[list[str], list[str]]:
        """DNS names and IPs the servers' tunnel certificate must carry: the in-cluster
        Service names (the tunnel's and the CONNECT front's), the ClusterTunnels'
        serverUrl hosts, the LoadBalancer address."""
        ns = self.namespace
        dns = [name for service in (SERVER_SERVICE, TUNNEL_SERVICE, CONNECT_SERVICE)
               for name in (service, f"{service}.{ns}", f"{service}.{ns}.svc",
                            f"{service}.{ns}.svc.cluster.local")]
        ips: list[str] = []
        for host in filter(None, self.server_hosts()):
            try:
                ipaddress.ip_address(host)
                ips.append(host)
            except ValueError:
                dns.append(host)
        return sorted(set(dns)), sorted(set(ips))

    async def ensure_pki(self) -> bool:
        """Leader only. The CA is created once and never replaced by the controller (an
        operator rotates it: README "Rotating the CA"). The servers' tunnel certificate is
        created, and re-issued at half-life, when the names it must carry change, or when
        another CA signed it — only if it is ours (labelled), never someone else's. False
        if it could not finish (the leader retries)."""
        ns = self.namespace
        labels = {"app.kubernetes.io/name": "nodeagent", MANAGED_LABEL: "true"}
        try:
            ca_secret = self.secrets.get(CA_SECRET, ns)
            if ca_secret is None:
                ca = pki.create_ca("nodeagent CA")
                await self.kube.create(SECRETS, {
                    "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                    "metadata": {"name": CA_SECRET, "namespace": ns, "labels": labels},
                    "stringData": {"tls.crt": ca.certificate_pem.decode(),
                                   "tls.key": ca.key_pem.decode()}})
                log.info("CA created", secret=f"{ns}/{CA_SECRET}")
            else:
                ca = pki.CertificateAuthority.load(
                    secret_value(ca_secret, "tls.crt").encode(),
                    secret_value(ca_secret, "tls.key").encode())
            if not self._ca_published:
                try:
                    await self.kube.get(CONFIGMAPS, CA_CONFIGMAP, namespace=ns)
                except NotFound:
                    await self.kube.create(CONFIGMAPS, {
                        "apiVersion": "v1", "kind": "ConfigMap",
                        "metadata": {"name": CA_CONFIGMAP, "namespace": ns,
                                     "labels": labels},
                        "data": {"ca.crt": ca.certificate_pem.decode()}})
                    log.info("CA certificate published", configmap=f"{ns}/{CA_CONFIGMAP}")
                self._ca_published = True
            dns, ips = self.server_names()
            current = self.secrets.get(SERVER_TLS_SECRET, ns)
            if current is not None:
                ours = (current.get("metadata", {}).get("labels") or {}).get(MANAGED_LABEL)
                pem = secret_value(current, "tls.crt")
                have = certificate_names(pem)
                renew_at = half_life(pem)
                if ours != "true" or (have >= set(dns) | set(ips) and renew_at is not None
                                      and dt.datetime.now(dt.UTC) < renew_at
                                      and issued_by(pem, ca)):
                    self._renew_at(renew_at)
                    return True
            leaf = pki.issue_server_certificate(ca, dns, ips, common_name=SERVER_SERVICE)
            self._renew_at(half_life(leaf.certificate_pem.decode()))
            body: dict[str, Any] = {
                "apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
                "metadata": {"name": SERVER_TLS_SECRET, "namespace": ns, "labels": labels},
                "stringData": {"tls.crt": leaf.certificate_pem.decode(),
                               "tls.key": leaf.key_pem.decode()}}
            if current is None:
                await self.kube.create(SECRETS, body)
            else:
                body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                await self.kube.update(SECRETS, body)
            log.info("server certificate issued", secret=f"{ns}/{SERVER_TLS_SECRET}",
                     names=",".join(dns + ips))
            return True
        except (KubeError, ValueError) as exc:
            log.warning("PKI bootstrap incomplete; retrying", error=str(exc))
            return False


def half_life(pem: str) -> dt.datetime | None:
    """When a certificate is half way through its validity (None if it does not parse):
    the servers' certificate is re-issued from then on, so a server restarted (or
    reloading its mounted Secret) never runs into expiry."""
    from cryptography import x509
    try:
        cert = x509.load_pem_x509_certificate(pem.encode())
    except ValueError:
        return None
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return start + (end - start) / 2


def trust_bundle(ca: pki.CertificateAuthority, bundle: str) -> bytes:
    """The signing CA's certificate and those of `bundle` (PEM), each once, the signing CA
    first; ValueError if `bundle` is not empty and holds no certificate."""
    certs = [ca.certificate_pem]
    if bundle:
        for cert in pki.load_certificates(bundle.encode()):
            pem = cert.public_bytes(serialization.Encoding.PEM)
            if pem not in certs:
                certs.append(pem)
    return b"".join(certs)


def issued_by(pem: str, ca: pki.CertificateAuthority) -> bool:
    """Whether the certificate in `pem` was signed by `ca` (after the signer switches to a
    new CA, the servers' certificate is re-issued from it)."""
    from cryptography import x509
    try:
        x509.load_pem_x509_certificate(pem.encode()).verify_directly_issued_by(ca.certificate)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def certificate_names(pem: str) -> set[str]:
    """The DNS names and IPs in a PEM certificate's SAN (empty if it does not parse)."""
    from cryptography import x509
    try:
        cert = x509.load_pem_x509_certificate(pem.encode())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return set()
    return set(sans.get_values_for_type(x509.DNSName)) | {
        str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}


def secret_value(secret: dict[str, Any], key: str) -> str:
    """One key of a Secret, from `data` (base64) or `stringData`, stripped."""
    data = secret.get("data") or {}
    if key in data:
        return base64.b64decode(data[key]).decode().strip()
    return str((secret.get("stringData") or {}).get(key, "")).strip()
