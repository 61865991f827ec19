"""The controller process: wiring of caches, recompute, config stream and the leader's task.

Every replica lists and watches the objects it needs (one shared cache per type),
recomputes the config of every node and of the servers when an input of that config
changed (debounced; `inputs` says which changes count), and serves the config watch
stream from those warm caches — so when the leader dies, agents and servers already
watching a standby keep their config and get updates.

A recompute only computes and publishes config: it never waits on the API. Only the
leader (a coordination.k8s.io Lease) writes, in a task of its own (`LeaderWrites`) that
works from the latest recompute's outcome and the caches: bootstrap (`bootstrap`: the
PKI) and what users see (`status`: Ingress and ClusterTunnel status, Events). A
slow or failing API write therefore never delays config delivery.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

import trio

from nodeagent.config import NodeConfig
from nodeagent.controller.activityshare import ACTIVITY_LABEL, SharedActivity
from nodeagent.controller.bootstrap import CA_SECRET, SERVER_SERVICE, TUNNEL_SERVICE, Bootstrap
from nodeagent.controller.clustertunnel import CLUSTER_TUNNELS
from nodeagent.controller.compute import (
    ComputeMemo,
    ConfigVersions,
    Tunnel,
    compute,
    parse_tunnels,
    same_objects,
)
from nodeagent.controller.configserver import ConfigStreamServer, ConnectionLimits, Identity
from nodeagent.controller.crds import ensure_crds
from nodeagent.controller.ingress import TranslationMemo, translate_ingresses
from nodeagent.controller.ingressgate import HTPASSWD_SECRET_TYPE, with_cluster_defaults
from nodeagent.controller.inputs import (
    LeaderWrite,
    feeds_config,
    leader_writes,
    secret_feeds_config,
    secret_references,
)
from nodeagent.controller.lbstatus import LoadBalancerStatusWriter
from nodeagent.controller.loadbalancers import (
    LoadBalancerTranslation,
    reserved_ports,
    translate_load_balancers,
)
from nodeagent.controller.metrics import ControllerMetrics
from nodeagent.controller.servingtls import ServingTLS, service_names
from nodeagent.controller.signing import REVIEW_RATE, CertificateSigner, SigningPolicy
from nodeagent.controller.sleeper import Sleeper, SleeperSettings
from nodeagent.controller.status import (
    WATCHERS_LABEL,
    Outcome,
    StatusWriter,
    WatcherReports,
    public_addresses,
)
from nodeagent.controller.wakeroutes import apply_wake, wake_load_balancers
from nodeagent.kube import (
    CONFIGMAPS,
    ENDPOINTSLICES,
    INGRESSCLASSES,
    INGRESSES,
    NODES,
    PODS,
    SECRETS,
    SERVICES,
    CacheEvent,
    Debouncer,
    KubeClient,
    KubeError,
    LeaderElector,
    SharedInformers,
    load_credentials,
)
from nodeagent.ops.health import HealthServer
from nodeagent.ops.listener import bind_errors
from nodeagent.ops.logs import get_logger
from nodeagent.runtime.gcfreeze import freeze_survivors_forever
from nodeagent.runtime.gcpause import gc_paused
from tunnel.log import RateLimitedLog
from tunnel.tcp import format_address

log = get_logger("nodeagent.controller")

# The only Secrets the controller caches: Ingress TLS certificates and its own (the CA and
# the servers' certificate, which bootstrap creates as kubernetes.io/tls too). The API
# server filters, so Helm release records, tokens and other Opaque Secrets never reach
# this process. RBAC cannot enforce a field selector on type: the ClusterRole still grants
# list/watch of every Secret (manifests/rbac.yaml says so).
TLS_SECRET_TYPE = "kubernetes.io/tls"
SECRET_FIELD_SELECTOR = {"type": TLS_SECRET_TYPE}


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
    # The leader's status writes (Events, Ingress and ClusterTunnel status) wait this long
    # after a change: they yield the CPU to config delivery. At 5,000 nodes their reports
    # take ~60 ms, which at 0.05 s fell in the middle of a fan-out's 5,000 sends. The PKI
    # write does not wait (a fresh cluster's agents wait for its CA).
    status_delay: float = 1.0
    metrics_listen: tuple[str, int] | None = None
    leader_retry: float = 5.0  # a failed leader write is tried again after this
    # The config stream's TLS and the certificates it signs (signing.py).
    service_name: str = "nodeagent-controller"  # its names go into the serving certificate
    tls_names: tuple[str, ...] = ()  # more DNS names or IPs for it (--tls-name)
    node_service_account: str = "nodeagent-agent"
    server_service_account: str = "nodeagent-server"
    certificate_validity: float = 24 * 3600.0  # seconds
    token_review_rate: float = REVIEW_RATE  # TokenReviews a second for certificate requests
    # gcfreeze.freeze_survivors_forever() once the caches synced (the `nodeagent
    # controller` process; not in tests, where the process is pytest's and many
    # controllers come and go)
    freeze_gc: bool = False
    server_workers: int = 1  # the servers' --workers: agents hold pods x workers tunnels
    heartbeat: float = 60.0  # seconds between a quiet config watch's heartbeat lines
    connection_limits: ConnectionLimits = field(default_factory=ConnectionLimits)
    sleeper: SleeperSettings = field(default_factory=SleeperSettings)  # scale to zero


class LeaderWrites:
    """The leader's API writes, in one task of their own. `mark` says which are due; the
    task runs them (in LeaderWrite order) after `delay` gathers a burst of marks, and runs
    a failed one again after `retry`. The `urgent` ones due run first, after
    `urgent_delay`."""

    def __init__(self, writes: dict[LeaderWrite, Callable[[], Awaitable[bool]]], *,
                 delay: float, retry: float, urgent: frozenset[LeaderWrite] = frozenset(),
                 urgent_delay: float | None = None) -> None:
        self._writes = writes
        self.delay = delay
        self.urgent = urgent
        self.urgent_delay = delay if urgent_delay is None else urgent_delay
        self.retry = retry
        self._due: set[LeaderWrite] = set()
        self._wake = trio.Event()

    def mark(self, *writes: LeaderWrite) -> None:
        self._due.update(writes)
        self._wake.set()

    async def run(self) -> NoReturn:
        failed: set[LeaderWrite] = set()
        while True:
            if not self._due:
                with trio.move_on_after(self.retry if failed else math.inf):
                    await self._wake.wait()
            self._due |= failed
            failed = set()
            urgent = bool(self._due & self.urgent)
            await trio.sleep(self.urgent_delay if urgent else self.delay)
            self._wake = trio.Event()
            if urgent:  # the others stay due: the next round runs them after `delay`
                due = self._due & self.urgent
                self._due -= due
            else:
                due, self._due = self._due, set()
            for write in LeaderWrite:
                if write in due and not await self._writes[write]():
                    failed.add(write)


@dataclass
class Controller:
    settings: ControllerSettings
    kube: KubeClient
    informers: SharedInformers
    versions: ConfigVersions = field(default_factory=ConfigVersions)
    recomputes: int = 0  # recomputes run
    recompute_triggers: int = 0  # cache changes that asked for one (debounced into runs)
    # What earlier recomputes built, reused for what did not change since (see compute.py)
    translation_memo: TranslationMemo = field(default_factory=TranslationMemo)
    compute_memo: ComputeMemo = field(default_factory=ComputeMemo)
    listen_port: int = 0  # the config stream's, once listening (settings may say 0)

    def __post_init__(self) -> None:
        ns = self.settings.namespace
        # Pods: what an EndpointSlice's targetRef is checked against (ingress.py).
        self.caches = {r.plural: self.informers.cache(r) for r in (
            NODES, SERVICES, ENDPOINTSLICES, INGRESSES, INGRESSCLASSES, CLUSTER_TUNNELS,
            PODS)}
        self.caches["secrets"] = self.informers.cache(
            SECRETS, field_selector=SECRET_FIELD_SELECTOR)
        # Basic-auth htpasswd Secrets (ingressgate): only of their own type, so the
        # controller never caches other Secrets for them.
        self.caches["htpasswd"] = self.informers.cache(
            SECRETS, field_selector={"type": HTPASSWD_SECRET_TYPE})
        self.caches["watchers"] = self.informers.cache(
            CONFIGMAPS, namespace=ns, label_selector={WATCHERS_LABEL: "true"})
        # Scale to zero: every replica's record of the Services its servers report busy.
        self.caches["activity"] = self.informers.cache(
            CONFIGMAPS, namespace=ns, label_selector={ACTIVITY_LABEL: "true"})
        self.bootstrap = Bootstrap(self.kube, self.caches["secrets"], ns, self._server_hosts)
        self.metrics = ControllerMetrics()
        self.metrics.watch_informers(lambda: self.informers.informers)
        dns, ips = service_names(self.settings.service_name, ns, self.settings.tls_names)
        self.tls = ServingTLS(lambda: self.bootstrap.ca, dns, ips,
                              trust=lambda: self.bootstrap.trust_pem)
        self.signer = CertificateSigner(self.kube, lambda: self.bootstrap.ca, SigningPolicy(
            namespace=ns, node_service_account=self.settings.node_service_account,
            server_service_account=self.settings.server_service_account,
            validity=dt.timedelta(seconds=self.settings.certificate_validity)), self.metrics,
            denied_nodes=self._denied_nodes, review_rate=self.settings.token_review_rate,
            review_burst=max(1, math.ceil(self.settings.token_review_rate * 2.5)),
            trust_bundle=lambda: self.bootstrap.trust_pem, still_exists=self._still_exists)
        # Scale to zero: servers' activity reports and wake requests; the leader's sleeps.
        # The busy Services are shared between replicas through the API: rewritten every
        # report interval (at least every tick) while any is, valid for three of those.
        sleeping = self.settings.sleeper
        refresh = max(sleeping.activity_interval, sleeping.tick)
        shared = SharedActivity(
            self.kube, self.caches["activity"], ns, self.settings.identity,
            refresh=refresh, valid_for=3 * refresh + sleeping.tick, tick=sleeping.tick,
            on_problem=lambda: self.metrics.config("scale_to_zero_bad_activity_record"))
        self.sleeper = Sleeper(self.kube, self.caches["services"],
                               self.caches["endpointslices"], self.caches["pods"],
                               settings=sleeping, metrics=self.metrics, shared=shared)
        self.stream = ConfigStreamServer(self.versions, tls=self.tls.context,
                                         reports=self.sleeper.answer,
                                         signer=self.signer, metrics=self.metrics,
                                         heartbeat=self.settings.heartbeat,
                                         limits=self.settings.connection_limits)
        self.watchers = WatcherReports(self.kube, self.caches["watchers"], ns,
                                       self.settings.identity, self.stream.subscribers)
        self.status = StatusWriter(self.kube, self.caches, ns, self.settings.identity,
                                   self.watchers)
        # LoadBalancer Services: the latest translation and tunnels, for their status.
        self.load_balancers: tuple[LoadBalancerTranslation, tuple[Tunnel, ...]] | None = None
        self.lb_status = LoadBalancerStatusWriter(self.kube, self.caches["services"], ns,
                                                  lambda: self.load_balancers)
        self.debouncer = Debouncer(self.recompute, delay=self.settings.debounce)
        self.leader = LeaderWrites({
            LeaderWrite.PKI: self.bootstrap.ensure_pki,
            LeaderWrite.EVENTS: self.status.write_events,
            LeaderWrite.INGRESS_STATUS: self.status.write_ingress_status,
            LeaderWrite.TUNNEL_STATUS: self.status.write_tunnel_status,
            LeaderWrite.SERVICE_STATUS: self.lb_status.write,
        }, delay=self.settings.status_delay, retry=self.settings.leader_retry,
            urgent=frozenset({LeaderWrite.PKI}), urgent_delay=self.settings.debounce)
        self.is_leader = False
        self._secret_refs: frozenset[tuple[str, str]] = frozenset()
        self._secret_refs_of: list[dict[str, Any]] = []  # the Ingresses they were found in
        self._reported: set[tuple[str, str, str, str]] = set()
        self._refusals = RateLimitedLog(log)
        for plural, cache in self.caches.items():
            cache.add_handler(self._on_change(plural))

    def _on_change(self, plural: str) -> Callable[[CacheEvent], None]:
        ns = self.settings.namespace

        def handle(event: CacheEvent) -> None:
            if plural in (SECRETS.plural, "htpasswd"):
                meta = event.object.get("metadata") or {}
                if (meta.get("namespace"), meta.get("name")) == (ns, CA_SECRET) and \
                        self.bootstrap.read_ca():
                    self.tls.notify()
                wanted = secret_feeds_config(event, self._secret_refs)
            else:
                wanted = feeds_config(plural, event)
            if wanted:
                self.recompute_triggers += 1
                self.debouncer.trigger(urgent=plural == ENDPOINTSLICES.plural and
                                       self._sleepable_slice(event.object))
            writes = leader_writes(plural, event, ns)
            if writes and self.is_leader:
                self.leader.mark(*writes)

        return handle

    def _sleepable_slice(self, obj: dict[str, Any]) -> bool:
        """An EndpointSlice of a Service that sleeps when idle: its change is recomputed
        without the debounce, since requests may be held until it reaches the servers
        (they change only when such a workload wakes, sleeps or moves)."""
        meta = obj.get("metadata") or {}
        service = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        return (str(meta.get("namespace") or ""), str(service)) in self.sleeper.enabled

    async def recompute(self) -> None:
        """Compute every config from the caches and publish what changed; hand the
        outcome to the leader's writes. No I/O."""
        started = time.perf_counter()
        # See gcpause.py: a recompute allocates much and frees most, and what it keeps
        # (5,000 NodeConfigs in a fan-out) lives until a change replaces it.
        with gc_paused(freeze=self.settings.freeze_gc):
            self._recompute()
        self.metrics.recompute_seconds.observe(time.perf_counter() - started)
        if self.is_leader:
            self.leader.mark(*LeaderWrite)

    def _recompute(self) -> None:
        c = self.caches
        ingresses = c["ingresses"].list()
        # Walked again only when an Ingress changed (not at a ClusterTunnel's fan-out).
        if not same_objects(ingresses, self._secret_refs_of):
            self._secret_refs = secret_references(ingresses)
            self._secret_refs_of = ingresses
        services, endpoint_slices = c["services"].list(), c["endpointslices"].list()
        nodes = c["nodes"].list()
        tunnel_objects = c["clustertunnels"].list()
        tunnels, tunnel_problems = parse_tunnels(tunnel_objects)
        translation = translate_ingresses(
            ingresses=ingresses, ingress_classes=c["ingressclasses"].list(),
            services=services, endpoint_slices=endpoint_slices,
            secrets=c["secrets"].list() + c["htpasswd"].list(),
            nodes=nodes, pods=c["pods"].list(),
            direct_namespaces=frozenset(n for t in tunnels
                                        for n in t.spec.direct_backend_namespaces),
            memo=self.translation_memo)
        feature_on = all(t.spec.scale_to_zero for t in tunnels)
        wake = apply_wake(translation.routes, dict(enumerate(translation.rule_services)),
                          translation.default_service, services, c["pods"].list(),
                          enabled=feature_on)
        # Auth and rate limits a ClusterTunnel sets for Ingresses without their own.
        ingress = with_cluster_defaults(
            wake.routes, next((t.spec.ingress_jwt for t in tunnels if t.spec.ingress_jwt),
                              None),
            next((t.spec.ingress_rate_limit for t in tunnels if t.spec.ingress_rate_limit),
                 None))
        translation = dataclasses.replace(translation, routes=ingress)
        self.sleeper.set_enabled(wake.enabled, feature_on)
        balancers = translate_load_balancers(
            services=services, endpoint_slices=endpoint_slices, nodes=nodes,
            pods=c["pods"].list(),
            classless=any(t.spec.load_balancers.classless for t in tunnels),
            reserved=reserved_ports(self._own_services(), self.settings.namespace,
                                    (SERVER_SERVICE, TUNNEL_SERVICE)))
        balancers = dataclasses.replace(
            balancers, services=wake_load_balancers(balancers.services, wake))
        self.load_balancers = (balancers, tuple(tunnels))
        self.metrics.load_balancers(state.error or "served" for states in
                                    balancers.ports.values() for state in states)
        self.metrics.refused(translation.refused_backends)
        for reason, count in sorted(translation.refused_backends.items()):
            self._refusals.warning(f"backend:{reason}", "Ingress backends refused",
                                   reason=reason, count=count)
        out = compute(nodes=nodes, tunnels=tunnels, translation=translation,
                      services=services, endpoint_slices=endpoint_slices,
                      namespace=self.settings.namespace, memo=self.compute_memo,
                      server_workers=self.settings.server_workers,
                      load_balancers=balancers)
        changed = [name for name, config in out.nodes.items()
                   if self.versions.update(f"node/{name}", config)]
        for key in self.versions.keys():
            # A deleted Node's agent (still connected, or coming back) allows nothing.
            if key.startswith("node/") and key[5:] not in out.nodes and \
                    self.versions.update(key, NodeConfig()):
                changed.append(key[5:])
        routes = out.routes
        if routes.activity_interval != self.settings.sleeper.activity_interval:
            routes = routes.model_copy(update={
                "activity_interval": self.settings.sleeper.activity_interval})
        servers_changed = self.versions.update("servers", routes)
        problems = tunnel_problems + out.problems + list(wake.problems)
        self.recomputes += 1
        if changed or servers_changed:
            self.stream.notify([*(f"node/{n}" for n in changed),
                                *(["servers"] if servers_changed else [])])
            log.info("config recomputed", nodes_changed=len(changed),
                     servers_changed=servers_changed, ingress_rules=len(
                         out.routes.ingress.rules), problems=len(problems))
        for problem in problems:
            seen = (problem.kind, problem.namespace, problem.name, problem.message)
            if seen not in self._reported:
                self._reported.add(seen)
                log.warning("object has a problem", kind=problem.kind,
                            object=f"{problem.namespace}/{problem.name}".lstrip("/"),
                            reason=problem.reason, problem=problem.message)
        servers = self.versions.get("servers")
        self.status.outcome = Outcome(
            problems=tuple(problems), served=translation.served, tunnels=tuple(tunnels),
            tunnel_objects=tuple(tunnel_objects), nodes=tuple(nodes),
            config_version=servers[0] if servers else 0)

    def _own_services(self) -> list[dict[str, Any]]:
        """The servers' own Services, looked up (not found by walking every Service)."""
        cache, ns = self.caches["services"], self.settings.namespace
        return [svc for name in (SERVER_SERVICE, TUNNEL_SERVICE)
                if (svc := cache.get(name, ns)) is not None]

    def _still_exists(self, identity: Identity) -> bool:
        """A certificate's node (its Node) or server (its pod, in our namespace) is still
        in the caches: renewing by certificate needs that instead of a TokenReview."""
        if identity.kind == "node":
            return self.caches["nodes"].get(identity.name) is not None
        return self.caches["pods"].get(identity.name, self.settings.namespace) is not None

    def _denied_nodes(self) -> frozenset[str]:
        tunnels, _ = parse_tunnels(self.caches["clustertunnels"].list())
        return frozenset(n for t in tunnels for n in t.spec.denied_nodes)

    def _server_hosts(self) -> list[str]:
        """Public names of the servers besides their Service's: the ClusterTunnels'
        serverUrl hosts and the LoadBalancer address."""
        tunnels, _ = parse_tunnels(self.caches["clustertunnels"].list())
        hosts = [urlsplit(t.spec.server_url).hostname or "" for t in tunnels
                 if t.spec.server_url]
        return hosts + [a.get("ip") or a.get("hostname") or ""
                        for service in (SERVER_SERVICE, TUNNEL_SERVICE)
                        for a in public_addresses(self.caches["services"],
                                                  self.settings.namespace, service)]

    async def lead(self) -> None:
        """While holding the Lease: bootstrap, then every leader write, then those that
        changes call for."""
        self.is_leader = True
        self.bootstrap.start_leading()
        log.info("leading", identity=self.settings.identity)
        try:
            self.leader.mark(*LeaderWrite)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._renew_server_certificate)
                nursery.start_soon(self.watchers.collect_forever)
                await self.leader.run()
        finally:
            self.is_leader = False

    async def _renew_server_certificate(self) -> None:
        """Wake the PKI write when the servers' certificate reaches half-life (nothing
        else changes then: no cache event would)."""
        while True:
            changed = self.bootstrap.renew_changed
            renew_at = self.bootstrap.server_renew_at
            wait = math.inf if renew_at is None else (
                renew_at - dt.datetime.now(dt.UTC)).total_seconds()
            if wait <= 0:
                log.info("servers' certificate at half-life: re-issuing")
                self.leader.mark(LeaderWrite.PKI)
                wait = 60.0  # ensure_pki moves renew_at on success; else try again
            with trio.move_on_after(wait):
                await changed.wait()


async def serve_controller(settings: ControllerSettings, *,
                           task_status: trio.TaskStatus[Controller] = trio.TASK_STATUS_IGNORED
                           ) -> None:
    async with KubeClient(load_credentials(settings.kubeconfig)) as kube:
        informers = SharedInformers(kube)
        controller = Controller(settings, kube, informers)
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
            await nursery.start(controller.debouncer.run)
            controller.bootstrap.read_ca()
            await controller.recompute()
            # The synced caches, the first configs and then the watches' connections live
            # as long as the process: keep the cyclic GC from walking them again and
            # again (gcfreeze.py: at 5,000 nodes and 10,000 Ingresses a fan-out recompute
            # took ~1.0 s of CPU with the GC walking the caches, ~0.4 s without, and full
            # collections walking the 5,000 watches cost ~0.6 s each).
            if settings.freeze_gc:
                nursery.start_soon(freeze_survivors_forever)
            nursery.start_soon(controller.watchers.publish)
            nursery.start_soon(controller.sleeper.run, lambda: controller.is_leader)
            with bind_errors("--listen", format_address((settings.listen_host,
                                                         settings.listen_port))):
                listeners = await nursery.start(controller.stream.run, settings.listen_host,
                                                settings.listen_port)
            controller.listen_port = listeners[0].socket.getsockname()[1]
            if settings.metrics_listen is not None:
                # Ready once the caches have synced (informers.run returned from start).
                health = HealthServer(controller.metrics.registry, lambda: None)
                with bind_errors("--metrics-listen", format_address(settings.metrics_listen)):
                    await nursery.start(health.run, *settings.metrics_listen)
            log.info("controller ready", identity=settings.identity,
                     config_stream=f"{settings.listen_host}:{controller.listen_port}")
            task_status.started(controller)
            await elector.run(controller.lead)
