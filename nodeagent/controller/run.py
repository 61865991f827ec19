"""`nodeagent controller`: the process around the pure parts.

Every replica lists and watches the objects it needs (one shared cache per type), recomputes
the config of every node and of the servers after a debounced burst of changes, and serves
the config watch stream from those warm caches — so when the leader dies, agents and
servers already watching a standby keep their config and get updates. Only the leader
(a coordination.k8s.io Lease) writes: it bootstraps the shared
agent token Secret, and records Events for problems in users' objects (invalid Ingresses,
ClusterTunnels).
"""

from __future__ import annotations

import ipaddress
import secrets
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import trio

from nodeagent import pki
from nodeagent.config import NodeConfig
from nodeagent.controller.compute import ConfigVersions, compute, parse_tunnels
from nodeagent.controller.crds import ensure_crds
from nodeagent.controller.ingress import Problem, translate_ingresses
from nodeagent.controller.stream import ConfigStreamServer
from nodeagent.crd import CLUSTER_TUNNELS, FINALIZER
from nodeagent.kube import (
    CONFIGMAPS,
    ENDPOINTSLICES,
    INGRESSCLASSES,
    INGRESSES,
    NODES,
    SECRETS,
    SERVICES,
    AlreadyExists,
    Debouncer,
    EventRecorder,
    KubeClient,
    KubeError,
    LeaderElector,
    NotFound,
    SharedInformers,
    load_credentials,
)
from nodeagent.ops.health import HealthServer
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.controller")
TOKEN_SECRET = "nodeagent-agent-token"
SERVER_SERVICE = "nodeagent-server"  # its LoadBalancer address goes into Ingress status
# Each replica publishes which nodes hold a config watch on it, in a ConfigMap of its own
# (agents watch whichever replica the Service picks): the leader sums them up for
# ClusterTunnel status. Reports older than WATCHERS_STALE are from dead replicas.
CA_SECRET = "nodeagent-ca"  # the CA's certificate and key
CA_CONFIGMAP = "nodeagent-ca"  # its certificate alone, for agents (ca.crt)
SERVER_TLS_SECRET = "nodeagent-server-tls"  # the servers' tunnel certificate
MANAGED_LABEL = "nodeagent.io/managed"
WATCHERS_LABEL = "nodeagent.io/watchers"
WATCHERS_PERIOD = 5.0
WATCHERS_STALE = 30.0


@dataclass
class ControllerSettings:
    namespace: str
    identity: str
    listen_host: str = "0.0.0.0"
    listen_port: int = 8090
    lease_name: str = "nodeagent-controller"
    kubeconfig: Path | None = None
    lease_duration: float = 15.0
    debounce: float = 0.05
    metrics_listen: tuple[str, int] | None = None


@dataclass
class Controller:
    settings: ControllerSettings
    kube: KubeClient
    informers: SharedInformers
    versions: ConfigVersions = field(default_factory=ConfigVersions)
    token: str = ""
    problems: list[Problem] = field(default_factory=list)
    recomputes: int = 0
    is_leader: bool = False
    served: tuple[tuple[str, str], ...] = ()
    tunnel_report: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stream = ConfigStreamServer(self.versions, lambda: self.token)
        self.caches = {r.plural: self.informers.cache(r) for r in (
            NODES, SERVICES, ENDPOINTSLICES, INGRESSES, INGRESSCLASSES, SECRETS,
            CLUSTER_TUNNELS)}
        self.caches["watchers"] = self.informers.cache(
            CONFIGMAPS, namespace=self.settings.namespace,
            label_selector={WATCHERS_LABEL: "true"})
        self.events = EventRecorder(self.kube, component="nodeagent-controller",
                                    instance=self.settings.identity)
        self._reported: set[tuple[str, str, str, str]] = set()
        self._ca_published = False

    async def recompute(self) -> None:
        c = self.caches
        self.read_token()
        translation = translate_ingresses(
            ingresses=c["ingresses"].list(), ingress_classes=c["ingressclasses"].list(),
            services=c["services"].list(), endpoint_slices=c["endpointslices"].list(),
            secrets=c["secrets"].list())
        tunnels, tunnel_problems = parse_tunnels(c["clustertunnels"].list())
        out = compute(nodes=c["nodes"].list(), tunnels=tunnels, translation=translation)
        changed = [name for name, config in out.nodes.items()
                   if self.versions.update(f"node/{name}", config)]
        for key in self.versions.keys():
            # A deleted Node's agent (still connected, or coming back) allows nothing.
            if key.startswith("node/") and key[5:] not in out.nodes and \
                    self.versions.update(key, NodeConfig()):
                changed.append(key[5:])
        servers_changed = self.versions.update("servers", out.routes)
        self.problems = tunnel_problems + out.problems
        self.recomputes += 1
        if changed or servers_changed:
            self.stream.notify()
            log.info("config recomputed", nodes_changed=len(changed),
                     servers_changed=servers_changed, ingress_rules=len(
                         out.routes.ingress.rules), problems=len(self.problems))
        for problem in self.problems:
            seen = (problem.kind, problem.namespace, problem.name, problem.message)
            if seen not in self._reported:
                self._reported.add(seen)
                log.warning("object has a problem", kind=problem.kind,
                            object=f"{problem.namespace}/{problem.name}".lstrip("/"),
                            reason=problem.reason, problem=problem.message)
        self.served = translation.served
        self.tunnel_report = _tunnel_report(c["clustertunnels"].list(), tunnels,
                                            c["nodes"].list(), self.problems, self.versions,
                                            self.connected_nodes())
        if self.is_leader:
            await self.ensure_pki()
            await self._record_events()
            await self._write_ingress_status()
            await self._write_tunnel_status()

    def public_addresses(self) -> list[dict[str, str]]:
        """The servers' public address: the LoadBalancer status of the server Service."""
        service = self.caches["services"].get(SERVER_SERVICE, self.settings.namespace)
        if service is None:
            return []
        found = ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
        return [{k: v for k, v in entry.items() if k in ("ip", "hostname")} for entry in found
                if isinstance(entry, dict)]

    async def _write_ingress_status(self) -> None:
        """Every Ingress we serve shows the servers' public address (what kubectl get ingress
        prints under ADDRESS); written only when it differs."""
        wanted = self.public_addresses()
        for namespace, name in self.served:
            ingress = self.caches["ingresses"].get(name, namespace)
            if ingress is None:
                continue
            current = ((ingress.get("status") or {}).get("loadBalancer") or {}).get("ingress")
            if (current or []) == wanted:
                continue
            update = dict(ingress, status={"loadBalancer": {"ingress": wanted}})
            try:
                await self.kube.update_status(INGRESSES, update)
            except KubeError as exc:  # a conflict: the next recompute tries again
                log.info("Ingress status not written yet", ingress=f"{namespace}/{name}",
                         error=str(exc))

    def connected_nodes(self) -> set[str]:
        """Nodes with a config watch open on any live replica (from their reports)."""
        from datetime import datetime
        now = datetime.now(UTC)
        nodes: set[str] = set()
        for report in self.caches["watchers"].list():
            data = report.get("data") or {}
            try:
                updated = datetime.fromisoformat(data.get("updated", "").replace("Z", "+00:00"))
            except ValueError:
                continue
            if (now - updated).total_seconds() <= WATCHERS_STALE:
                nodes.update(n for n in data.get("nodes", "").split("\n") if n)
        return nodes

    async def publish_watchers(self) -> None:
        """Every WATCHERS_PERIOD: this replica's watching nodes into its ConfigMap."""
        from nodeagent.kube.events import rfc3339
        ns = self.settings.namespace
        name = f"nodeagent-watchers-{self.settings.identity}"[:253]
        while True:
            nodes = sorted(k[5:] for k in self.stream.subscribers if k.startswith("node/"))
            body: dict[str, Any] = {
                "apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": name, "namespace": ns,
                             "labels": {WATCHERS_LABEL: "true",
                                        "app.kubernetes.io/name": "nodeagent"}},
                "data": {"nodes": "\n".join(nodes), "updated": rfc3339()}}
            try:
                current = self.caches["watchers"].get(name, ns)
                if current is None:
                    await self.kube.create(CONFIGMAPS, body)
                else:
                    body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
                    await self.kube.update(CONFIGMAPS, body)
            except KubeError as exc:
                log.info("watcher report not written", error=str(exc))
            await trio.sleep(WATCHERS_PERIOD)

    async def _write_tunnel_status(self) -> None:
        """ClusterTunnel status (nodes covered, config version, Ready), and its finalizer:
        added to live tunnels; removed from a deleted one once the configs without its
        rules have been published (it is no longer in any computed config)."""
        for obj in self.caches["clustertunnels"].list():
            meta = obj["metadata"]
            name = meta["name"]
            finalizers = list(meta.get("finalizers") or [])
            try:
                if meta.get("deletionTimestamp"):
                    if FINALIZER in finalizers:
                        finalizers.remove(FINALIZER)
                        await self.kube.update(CLUSTER_TUNNELS, dict(
                            obj, metadata=dict(meta, finalizers=finalizers)))
                        log.info("ClusterTunnel released: its rules are out of every node "
                                 "config", tunnel=name)
                    continue
                if FINALIZER not in finalizers:
                    obj = await self.kube.update(CLUSTER_TUNNELS, dict(
                        obj, metadata=dict(meta, finalizers=[*finalizers, FINALIZER])))
                status = self.tunnel_report.get(name)
                if status is not None:
                    status = _keep_transition_times(obj.get("status") or {}, status)
                if status is not None and obj.get("status") != status:
                    await self.kube.update_status(CLUSTER_TUNNELS, dict(obj, status=status))
            except KubeError as exc:  # conflicts: the next recompute tries again
                log.info("ClusterTunnel not updated yet", tunnel=name, error=str(exc))

    async def _record_events(self) -> None:
        for problem in self.problems:
            resource = {"Ingress": INGRESSES, "ClusterTunnel": CLUSTER_TUNNELS,
                        "Node": NODES}.get(problem.kind)
            if resource is None:
                continue
            obj = self.caches[resource.plural].get(problem.name, problem.namespace or None)
            if obj is None:
                continue
            try:
                await self.events.warning(obj, problem.reason, problem.message)
            except KubeError as exc:
                log.warning("cannot record an Event", error=str(exc))

    def read_token(self) -> None:
        """The shared agent token (until node identity), from the Secrets cache: a rotated
        Secret takes effect at the next recompute its change triggers."""
        secret = self.caches["secrets"].get(TOKEN_SECRET, self.settings.namespace)
        token = _secret_value(secret, "token") if secret is not None else ""
        if token and token != self.token:
            self.token = token
            log.info("agent token loaded", secret=f"{self.settings.namespace}/{TOKEN_SECRET}")

    async def create_token_if_missing(self) -> None:
        """Leader only: a fresh cluster gets a random token once."""
        ns = self.settings.namespace
        if self.caches["secrets"].get(TOKEN_SECRET, ns) is not None:
            return
        try:
            await self.kube.create(SECRETS, {
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": TOKEN_SECRET, "namespace": ns,
                             "labels": {"app.kubernetes.io/name": "nodeagent"}},
                "stringData": {"token": secrets.token_urlsafe(32)}})
            log.info("agent token Secret created", secret=f"{ns}/{TOKEN_SECRET}")
        except AlreadyExists:
            pass

    def server_names(self) -> tuple[list[str], list[str]]:
        """DNS names and IPs the servers' tunnel certificate must carry: the in-cluster
        Service names, the ClusterTunnels' serverUrl hosts, the LoadBalancer address."""
        ns = self.settings.namespace
        dns = [SERVER_SERVICE, f"{SERVER_SERVICE}.{ns}", f"{SERVER_SERVICE}.{ns}.svc",
               f"{SERVER_SERVICE}.{ns}.svc.cluster.local"]
        ips: list[str] = []
        hosts = [urlsplit(t.spec.server_url).hostname or "" for t in parse_tunnels(
            self.caches["clustertunnels"].list())[0] if t.spec.server_url]
        hosts += [a.get("ip") or a.get("hostname") or "" for a in self.public_addresses()]
        for host in filter(None, hosts):
            try:
                ipaddress.ip_address(host)
                ips.append(host)
            except ValueError:
                dns.append(host)
        return sorted(set(dns)), sorted(set(ips))

    async def ensure_pki(self) -> None:
        """Leader only. The CA (Secret nodeagent-ca, and its certificate for agents in
        ConfigMap nodeagent-ca) is created once and never replaced. The servers' tunnel
        certificate (Secret nodeagent-server-tls) is created, and re-issued when the names
        it must carry change — only if it is ours (labelled), never someone else's."""
        ns = self.settings.namespace
        secrets_cache = self.caches["secrets"]
        labels = {"app.kubernetes.io/name": "nodeagent", MANAGED_LABEL: "true"}
        try:
            ca_secret = secrets_cache.get(CA_SECRET, ns)
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
                    _secret_value(ca_secret, "tls.crt").encode(),
                    _secret_value(ca_secret, "tls.key").encode())
            if not self._ca_published:  # checked once per leadership, not per recompute
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
            current = secrets_cache.get(SERVER_TLS_SECRET, ns)
            if current is not None:
                ours = (current.get("metadata", {}).get("labels") or {}).get(MANAGED_LABEL)
                have = _certificate_names(_secret_value(current, "tls.crt"))
                if ours != "true" or have >= set(dns) | set(ips):
                    return
            leaf = pki.issue_server_certificate(ca, dns, ips, common_name=SERVER_SERVICE)
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
        except (KubeError, ValueError) as exc:
            log.warning("PKI bootstrap incomplete; retrying at the next change", error=str(exc))

    async def lead(self) -> None:
        """While holding the Lease."""
        self.is_leader = True
        self._ca_published = False
        log.info("leading", identity=self.settings.identity)
        try:
            await self.create_token_if_missing()
            await self.ensure_pki()
            await self._record_events()
            await self._write_ingress_status()
            await trio.sleep_forever()
        finally:
            self.is_leader = False


def _tunnel_report(objects: list[dict[str, Any]], tunnels: list[Any],
                   nodes: list[dict[str, Any]], problems: list[Problem],
                   versions: ConfigVersions, connected: set[str]
                   ) -> dict[str, dict[str, Any]]:
    """The status each ClusterTunnel should show (camelCase, as in the CRD)."""
    valid = {t.name: t for t in tunnels}
    servers = versions.get("servers")
    report = {}
    for obj in objects:
        meta = obj.get("metadata") or {}
        name = meta.get("name", "")
        mine = [p for p in problems if p.kind == "ClusterTunnel" and p.name == name]
        tunnel = valid.get(name)
        names = [] if tunnel is None else [
            str((n.get("metadata") or {}).get("name")) for n in nodes
            if tunnel.spec.covers((n.get("metadata") or {}).get("labels") or {})]
        covered = len(names)
        ready = "True" if tunnel is not None and not mine else "False"
        condition = {"type": "Ready", "status": ready,
                     "reason": mine[0].reason if mine else "Applied",
                     "message": mine[0].message if mine else
                     f"config for {covered} node(s) published"}
        report[name] = {"observedGeneration": meta.get("generation", 0),
                        "nodesCovered": covered,
                        "nodesConnected": sum(1 for name in names if name in connected),
                        "configVersion": servers[0] if servers else 0,
                        "conditions": [condition]}
    return report


def _keep_transition_times(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """lastTransitionTime changes only when a condition's status does."""
    from nodeagent.kube.events import rfc3339
    before = {c.get("type"): c for c in old.get("conditions") or []}
    conditions = []
    for cond in new["conditions"]:
        prior = before.get(cond["type"])
        same = prior is not None and prior.get("status") == cond["status"]
        when = prior.get("lastTransitionTime") if same and prior else rfc3339()
        conditions.append(dict(cond, lastTransitionTime=when))
    return dict(new, conditions=conditions)


def _certificate_names(pem: str) -> set[str]:
    """The DNS names and IPs in a PEM certificate's SAN (empty if it does not parse)."""
    from cryptography import x509
    try:
        cert = x509.load_pem_x509_certificate(pem.encode())
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return set()
    return set(sans.get_values_for_type(x509.DNSName)) | {
        str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}


def _secret_value(secret: dict[str, Any], key: str) -> str:
    import base64
    data = secret.get("data") or {}
    if key in data:
        return base64.b64decode(data[key]).decode().strip()
    return str((secret.get("stringData") or {}).get(key, "")).strip()


async def serve_controller(settings: ControllerSettings, *,
                           task_status: trio.TaskStatus[Controller] = trio.TASK_STATUS_IGNORED
                           ) -> None:
    async with KubeClient(load_credentials(settings.kubeconfig)) as kube:
        informers = SharedInformers(kube)
        controller = Controller(settings, kube, informers)
        debouncer = Debouncer(controller.recompute, delay=settings.debounce)
        for cache in controller.caches.values():
            cache.add_handler(debouncer.trigger)
        elector = LeaderElector(kube, name=settings.lease_name, namespace=settings.namespace,
                                identity=settings.identity,
                                lease_duration=settings.lease_duration,
                                renew_deadline=settings.lease_duration * 2 / 3,
                                retry_period=max(0.2, settings.lease_duration / 7.5))
        # Before the informers: they cannot sync on a resource type that does not exist
        # yet. Every replica may do it (create-if-absent, never downgrade, conflicts
        # re-read), so a fresh cluster does not wait for an election.
        try:
            await ensure_crds(kube)
        except KubeError as exc:
            log.error("cannot install or check the CRDs; ClusterTunnels will not be "
                      "watched until they exist", error=str(exc))
        async with trio.open_nursery() as nursery:
            await nursery.start(informers.run)
            await nursery.start(debouncer.run)
            await controller.recompute()
            nursery.start_soon(controller.publish_watchers)
            await nursery.start(controller.stream.run, settings.listen_host,
                                settings.listen_port)
            if settings.metrics_listen is not None:
                # Ready once the caches have synced (informers.run returned from start).
                health = HealthServer(None, lambda: None)
                await nursery.start(health.run, *settings.metrics_listen)
            log.info("controller ready", identity=settings.identity,
                     config_stream=f"{settings.listen_host}:{settings.listen_port}")
            task_status.started(controller)
            await elector.run(controller.lead)
