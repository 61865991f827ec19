"""Ingress objects → the server's Ingress routes: a pure function of cached objects.

Which Ingresses are ours: `spec.ingressClassName` naming an IngressClass whose
`spec.controller` is `nodeagent.io/ingress-controller`, or the legacy annotation
`kubernetes.io/ingress.class: nodeagent`, or no class at all when our IngressClass is
marked `ingressclass.kubernetes.io/is-default-class: "true"`.

Each rule path (and the defaultBackend) becomes an `IngressRule` whose backends are the
Service's EndpointSlice endpoints: ready ones, or — only when none is ready — serving ones
that are terminating. An endpoint with a `nodeName` is reached through that node's agent
(its (ip, port) goes into `node_targets` so the node's config allows it) — only if the
address is the node's own: inside its spec.podCIDRs or one of its addresses; otherwise
(whoever can write an EndpointSlice could name 169.254.169.254 on any node) it is dropped
with a Problem. Even on its node, an endpoint is believed only if it is what the
EndpointSlice controller would have written (`endpoint_refusal`): its targetRef names a
Pod of the Service's own namespace, that Pod (in the cache) runs on the endpoint's node
and holds the address. Anyone who may write an EndpointSlice in a namespace could
otherwise publish another namespace's pod or the node's own sshd through an Ingress (the
class of CVE-2021-25740). A refused endpoint is counted by reason (`refused_backends`)
and named in a Problem.

Direct backends — an ExternalName Service, an endpoint without a `nodeName` — are dialed
by the server itself, from the server pod and around NetworkPolicy, so they are refused
(a Problem, the rest of the Ingress still served) unless both keys turn: the cluster
admin lists the Ingress's namespace in a ClusterTunnel's `directBackendNamespaces`
(`direct_namespaces` here), and the Ingress carries `nodeagent.io/allow-direct-backends:
"true"`. The same opt-in lets an endpoint on its node through without a matching Pod.
The annotation without the admin's listing opens nothing and gets a Problem saying so.
A Service port is matched by number or by name (Service port name → the EndpointSlice
port of the same name carries the real target port).

Authentication and rate limits come from annotations (`ingressgate`; docs/auth.md).

TLS: `spec.tls[].secretName` must be a Secret with a PEM certificate and a key that matches
it; the hosts it lists are redirected from http to https (308) unless the annotation
`nodeagent.io/ssl-redirect: "false"` turns that off. A missing or malformed Secret is a
Problem on the Ingress; its hosts are then served over plain HTTP only.

Anything wrong with an object becomes a `Problem` (for an Event, a status condition and
a log line); the object's other rules and every other Ingress keep working. Nothing here
raises on bad input.

`TranslationMemo` keeps each Ingress's translation between calls with what it read (its
spec and annotations, its Services' specs, their EndpointSlices, its Secrets, the Nodes
its endpoints name, the Pods their targetRefs name): a change translates again only the
Ingresses that read it; a change of the admin's opt-in translates them all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from nodeagent.config import Backend, HostPort, IngressRoutes, IngressRule, IngressTls
from nodeagent.config.health import HealthCheck
from nodeagent.config.httprules import PATH_TYPES, check_rule_host, check_rule_path
from nodeagent.controller.endpoints import (
    Network,
    endpoint_refusal,
    networks_of,
    node_view,
    on_node,
    pod_view,
)
from nodeagent.controller.ingressgate import (
    GateAnnotationError,
    basic_secret_name,
    rate_limit,
    route_auth,
)
from nodeagent.controller.serviceannotations import HEALTH_CHECK_ANNOTATION, health_check_of
from nodeagent.runtime.gcpause import gc_paused

CONTROLLER_NAME = "nodeagent.io/ingress-controller"
LEGACY_ANNOTATION = "kubernetes.io/ingress.class"
DEFAULT_CLASS_ANNOTATION = "ingressclass.kubernetes.io/is-default-class"
SSL_REDIRECT_ANNOTATION = "nodeagent.io/ssl-redirect"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
DIRECT_BACKENDS_ANNOTATION = "nodeagent.io/allow-direct-backends"
_OPT_IN = (f"to allow such backends, the cluster admin lists the namespace in a "
           f"ClusterTunnel's directBackendNamespaces and the Ingress carries the annotation "
           f'{DIRECT_BACKENDS_ANNOTATION}: "true"')

Obj = dict[str, Any]


@dataclass(frozen=True)
class Problem:
    """Something wrong with a user's object: for an Event, a condition and a log line."""

    kind: str
    namespace: str
    name: str
    reason: str
    message: str


@dataclass(frozen=True)
class IngressTranslation:
    routes: IngressRoutes
    problems: tuple[Problem, ...]
    # node → (ip, port) its agent must let the server dial
    node_targets: dict[str, frozenset[tuple[str, int]]]
    served: tuple[tuple[str, str], ...]  # (namespace, name) of the Ingresses we serve
    # reason → backends refused now: endpoint addresses (`endpoint_refusal`'s codes,
    # off_node, nodeless), external_name Services, direct_not_allowed Ingresses
    refused_backends: dict[str, int] = field(default_factory=dict)
    # The Service (namespace, name) of each rule of `routes.rules`, in order, and of the
    # default backend: what scale to zero (`wakeroutes`) attaches its settings by.
    rule_services: tuple[tuple[str, str], ...] = ()
    default_service: tuple[str, str] | None = None


@dataclass
class _Index:
    services: dict[tuple[str, str], Obj]
    slices: dict[tuple[str, str], list[Obj]]
    secrets: dict[tuple[str, str], Obj]
    nodes: dict[str, Obj]  # by name
    pods: dict[tuple[str, str], Obj]  # by (namespace, name)
    memo: TranslationMemo  # a node's networks (podCIDRs, addresses), parsed once
    direct_namespaces: frozenset[str]  # the admin's opt-in ("*": every namespace)


@dataclass
class _Out:
    rules: list[IngressRule] = field(default_factory=list)
    rule_services: list[tuple[str, str]] = field(default_factory=list)
    default: IngressRule | None = None
    default_service: tuple[str, str] | None = None
    default_rank: str = ""
    tls: list[IngressTls] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    node_targets: dict[str, set[tuple[str, int]]] = field(default_factory=dict)
    served: list[tuple[str, str]] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)


def _meta(obj: Obj) -> Obj:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _key(obj: Obj) -> tuple[str, str]:
    meta = _meta(obj)
    return str(meta.get("namespace", "")), str(meta.get("name", ""))


def our_classes(ingress_classes: Iterable[Obj]) -> tuple[set[str], bool]:
    """Names of the IngressClasses that are ours, and whether one of them is the default."""
    names, default = set(), False
    for cls in ingress_classes:
        if (cls.get("spec") or {}).get("controller") != CONTROLLER_NAME:
            continue
        names.add(str(_meta(cls).get("name", "")))
        annotations = _meta(cls).get("annotations") or {}
        default = default or annotations.get(DEFAULT_CLASS_ANNOTATION) == "true"
    return names, default


def is_ours(ingress: Obj, classes: set[str], default: bool) -> bool:
    spec = ingress.get("spec") or {}
    class_name = spec.get("ingressClassName")
    if class_name is not None:
        return class_name in classes
    legacy = (_meta(ingress).get("annotations") or {}).get(LEGACY_ANNOTATION)
    if legacy is not None:
        return legacy in classes or legacy == "nodeagent"
    return default


def translate_ingresses(*, ingresses: Iterable[Obj], ingress_classes: Iterable[Obj],
                        services: Iterable[Obj], endpoint_slices: Iterable[Obj],
                        secrets: Iterable[Obj], nodes: Iterable[Obj],
                        pods: Iterable[Obj] = (),
                        direct_namespaces: frozenset[str] = frozenset(),
                        memo: TranslationMemo | None = None) -> IngressTranslation:
    """The routes of every Ingress that is ours. `pods`: what an endpoint's targetRef is
    checked against; `direct_namespaces`: the namespaces the cluster admin lets opt in
    to backends not tied to their own Pods (the ClusterTunnels'
    `directBackendNamespaces`). With a `memo` kept from earlier calls, an Ingress none
    of whose inputs changed (same objects, or equal ones) is not translated again: the
    result is the same as without one."""
    with gc_paused():
        return _translate(ingresses, ingress_classes, services, endpoint_slices, secrets,
                          nodes, list(pods), direct_namespaces,
                          memo if memo is not None else TranslationMemo())


def direct_allowed(namespace: str, direct_namespaces: frozenset[str]) -> bool:
    """Whether the cluster admin lets Ingresses of `namespace` opt in to direct backends."""
    return "*" in direct_namespaces or namespace in direct_namespaces


def references(ingress: Obj) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names of the Services (backends) and Secrets (spec.tls) an Ingress names, in
    its own namespace: all that it reads besides their EndpointSlices and Nodes."""
    spec = ingress.get("spec") or {}
    backends = [spec.get("defaultBackend")]
    for rule in spec.get("rules") or []:
        if isinstance(rule, dict):
            backends.extend(p.get("backend") for p in
                            (rule.get("http") or {}).get("paths") or [] if isinstance(p, dict))
    services = {str(b["service"].get("name", "")) for b in backends
                if isinstance(b, dict) and isinstance(b.get("service"), dict)}
    secrets = {str(t["secretName"]) for t in spec.get("tls") or []
               if isinstance(t, dict) and t.get("secretName")}
    basic = basic_secret_name(_meta(ingress).get("annotations") or {})
    if basic is not None:  # basic auth's htpasswd (ingressgate)
        secrets.add(basic)
    return tuple(sorted(services)), tuple(sorted(secrets))


def ingress_view(ingress: Obj) -> tuple[Any, ...]:
    """What the translation reads of an Ingress besides its name: not its status (the
    leader writes it, on every Ingress, without changing a route) nor resourceVersion."""
    meta = _meta(ingress)
    return (ingress.get("spec"), meta.get("annotations"), meta.get("creationTimestamp"))


@dataclass
class _Memo:
    """One Ingress's translation and everything it read to make it."""

    obj: Obj  # the Ingress object it was last made or confirmed for
    ingress: tuple[Any, ...]  # ingress_view
    refs: tuple[tuple[str, ...], tuple[str, ...]]  # references(ingress)
    inputs: tuple[Any, ...]  # its Services, their EndpointSlices, its Secrets, as read
    node_names: tuple[str, ...]  # the Nodes its endpoints name (derived from `inputs`)
    nodes: tuple[Any, ...]  # node_view of those Nodes, as read
    pod_names: tuple[tuple[str, str], ...]  # the Pods its endpoints' targetRefs name
    pods: tuple[Any, ...]  # pod_view of those Pods, as read
    out: _Out


class TranslationMemo:
    """Per-Ingress translations kept between calls of `translate_ingresses`, so a change
    to one Ingress (or to a Service, EndpointSlice, Secret or Node it reads) translates
    that Ingress again, not all of them: at 10,000 Ingresses a full translation costs
    ~0.3 s of CPU, a memo check of the unchanged ones a few ms. An entry is reused only
    if every input is the same object or an equal one, so the memo never changes an
    outcome, only its cost. `translated` counts Ingresses translated (not reused)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], _Memo] = {}
        self._networks: dict[str, tuple[Any, list[Network]]] = {}
        self.translated = 0
        # The Services, EndpointSlices, Secrets and Nodes of the last call: while they are
        # the very same objects, an Ingress that is the same object as then is reused
        # without looking up what it reads (a recompute for one Ingress edit at 10,000
        # Ingresses: ~10 ms instead of ~100 ms)
        self._last: tuple[list[Obj], ...] = ([], [], [], [], [])
        self._direct: frozenset[str] = frozenset()
        self.stable = False
        # The last call's Ingresses, IngressClasses and result: a recompute none of
        # whose translation inputs changed (a ClusterTunnel edit: a fan-out to every
        # node) reuses the whole result instead of checking 10,000 entries (~60 ms)
        self._whole: tuple[list[Obj], list[Obj], IngressTranslation | None] = ([], [], None)

    def observe(self, services: list[Obj], slices: list[Obj], secrets: list[Obj],
                nodes: list[Obj], pods: list[Obj], direct_namespaces: frozenset[str]
                ) -> None:
        """Note this call's inputs besides the Ingresses; `stable` says whether they are
        those of the last call (the same objects; Nodes and Pods: or the same view).
        A change of the admin's direct-backend opt-in (rare) drops every entry."""
        last = self._last
        changed = direct_namespaces != self._direct
        if changed:
            self._direct = direct_namespaces
            self._entries.clear()
        self.stable = not changed and (
            _same_objects(services, last[0]) and _same_objects(slices, last[1])
            and _same_objects(secrets, last[2]) and len(nodes) == len(last[3])
            and all(a is b or node_view(a) == node_view(b)
                    for a, b in zip(nodes, last[3], strict=True))
            and len(pods) == len(last[4])
            and all(a is b or pod_view(a) == pod_view(b)
                    for a, b in zip(pods, last[4], strict=True)))
        self._last = (services, slices, secrets, nodes, pods)

    def networks(self, name: str, node: Obj | None) -> list[Network]:
        if node is None:
            return []
        view = node_view(node)
        known = self._networks.get(name)
        if known is None or known[0] != view:
            known = (view, networks_of(node))
            self._networks[name] = known
        return known[1]

    def translate(self, key: tuple[str, str], ingress: Obj, lazy: _LazyIndex) -> _Out:
        namespace = key[0]
        entry = self._entries.get(key)
        if self.stable and entry is not None and entry.obj is ingress:
            return entry.out
        index = lazy.get()
        view = ingress_view(ingress)
        same = entry is not None and entry.ingress == view
        refs = entry.refs if entry is not None and same else references(ingress)
        services, secrets = refs
        inputs = (tuple(_spec(index.services.get((namespace, s))) for s in services),
                  tuple(tuple(index.slices.get((namespace, s), ())) for s in services),
                  tuple(index.secrets.get((namespace, s)) for s in secrets))
        if entry is not None and same and entry.inputs == inputs and entry.nodes == tuple(
                node_view(index.nodes.get(n)) for n in entry.node_names) and \
                entry.pods == tuple(pod_view(index.pods.get(p)) for p in entry.pod_names):
            entry.obj = ingress
            return entry.out
        self.translated += 1
        out = _Out()
        endpoints = [e for group in inputs[1] for es in group
                     for e in es.get("endpoints") or [] if isinstance(e, dict)]
        node_names = tuple(sorted({str(e["nodeName"]) for e in endpoints
                                   if e.get("nodeName")}))
        pod_names = tuple(sorted({(namespace, str(e["targetRef"].get("name", "")))
                                  for e in endpoints if isinstance(e.get("targetRef"), dict)}))
        _translate_one(ingress, index, out)
        self._entries[key] = _Memo(ingress, view, refs, inputs, node_names,
                                   tuple(node_view(index.nodes.get(n)) for n in node_names),
                                   pod_names,
                                   tuple(pod_view(index.pods.get(p)) for p in pod_names),
                                   out)
        return out

    def forget_except(self, keys: set[tuple[str, str]]) -> None:
        """Drop the entries (and Node networks) of objects that are gone."""
        for key in [k for k in self._entries if k not in keys]:
            del self._entries[key]


def _same_objects(a: list[Obj], b: list[Obj]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


class _LazyIndex:
    """The lookup tables, built on first need: a recompute that reuses every Ingress
    needs none."""

    def __init__(self, services: list[Obj], slices: list[Obj], secrets: list[Obj],
                 nodes: dict[str, Obj], pods: list[Obj], memo: TranslationMemo,
                 direct_namespaces: frozenset[str]) -> None:
        self._args = (services, slices, secrets, nodes, pods, memo, direct_namespaces)
        self._index: _Index | None = None

    def get(self) -> _Index:
        if self._index is None:
            services, slices, secrets, nodes, pods, memo, direct = self._args
            index = _Index(services={_key(s): s for s in services}, slices={}, secrets={
                _key(s): s for s in secrets}, nodes=nodes, pods={_key(p): p for p in pods},
                memo=memo, direct_namespaces=direct)
            for es in slices:
                svc = (_meta(es).get("labels") or {}).get(SERVICE_NAME_LABEL)
                if svc:
                    index.slices.setdefault((_key(es)[0], svc), []).append(es)
            self._index = index
        return self._index


def _first(pair: tuple[tuple[str, str], Obj]) -> tuple[str, str]:
    return pair[0]


def _spec(service: Obj | None) -> Any:
    # A Service's spec and health-check annotation are all the translation reads of it
    # (its LoadBalancer status is the leader's concern): None for a missing one.
    if service is None:
        return None
    annotations = _meta(service).get("annotations") or {}
    return ("service", service.get("spec"), annotations.get(HEALTH_CHECK_ANNOTATION))


def _translate(ingresses: Iterable[Obj], ingress_classes: Iterable[Obj],
               services: Iterable[Obj], endpoint_slices: Iterable[Obj],
               secrets: Iterable[Obj], nodes: Iterable[Obj], pods: list[Obj],
               direct_namespaces: frozenset[str], memo: TranslationMemo
               ) -> IngressTranslation:
    ingresses, ingress_classes = list(ingresses), list(ingress_classes)
    nodes = list(nodes)
    services, endpoint_slices, secrets = list(services), list(endpoint_slices), list(secrets)
    memo.observe(services, endpoint_slices, secrets, nodes, pods, direct_namespaces)
    last_ingresses, last_classes, last = memo._whole
    if memo.stable and last is not None and _same_objects(ingresses, last_ingresses) \
            and _same_objects(ingress_classes, last_classes):
        return last
    classes, default = our_classes(ingress_classes)
    nodes_by_name = {str(_meta(n).get("name", "")): n for n in nodes}
    index = _LazyIndex(services, endpoint_slices, secrets, nodes_by_name, pods, memo,
                       direct_namespaces)
    out = _Out()
    seen: set[tuple[str, str]] = set()
    for key, ingress in sorted(((_key(i), i) for i in ingresses), key=_first):
        if not is_ours(ingress, classes, default):
            continue
        seen.add(key)
        out.served.append(key)
        one = memo.translate(key, ingress, index)
        out.rules.extend(one.rules)
        out.rule_services.extend(one.rule_services)
        out.tls.extend(one.tls)
        out.problems.extend(one.problems)
        out.refused.update(one.refused)
        if one.default is not None and (out.default is None or (
                one.default_rank, one.default.name) < (out.default_rank, out.default.name)):
            # The spec leaves two defaultBackends undefined; the oldest Ingress wins, as
            # for conflicting rules.
            out.default, out.default_rank = one.default, one.default_rank
            out.default_service = one.default_service
        for node, targets in one.node_targets.items():
            out.node_targets.setdefault(node, set()).update(targets)
    memo.forget_except(seen)
    memo._networks = {n: v for n, v in memo._networks.items() if n in nodes_by_name}
    result = IngressTranslation(
        routes=IngressRoutes(rules=tuple(out.rules), default_backend=out.default,
                             tls=tuple(out.tls)),
        problems=tuple(out.problems),
        node_targets={n: frozenset(t) for n, t in out.node_targets.items()},
        served=tuple(out.served), refused_backends=dict(out.refused),
        rule_services=tuple(out.rule_services), default_service=out.default_service)
    memo._whole = (ingresses, ingress_classes, result)
    return result


def _translate_one(ingress: Obj, index: _Index, out: _Out) -> None:
    namespace, name = _key(ingress)
    label = f"{namespace}/{name}"
    rank = str(_meta(ingress).get("creationTimestamp", ""))
    spec = ingress.get("spec") or {}

    def problem(reason: str, message: str) -> None:
        out.problems.append(Problem("Ingress", namespace, name, reason, message))

    tls_hosts = _tls(ingress, index, out, problem)
    annotations = _meta(ingress).get("annotations") or {}
    redirect = annotations.get(SSL_REDIRECT_ANNOTATION, "true").lower() != "false"
    asked = str(annotations.get(DIRECT_BACKENDS_ANNOTATION, "")).lower() == "true"
    direct = asked and direct_allowed(namespace, index.direct_namespaces)
    if asked and not direct:
        out.refused["direct_not_allowed"] += 1
        problem("DirectBackendsNotAllowed", f"annotation {DIRECT_BACKENDS_ANNOTATION} is "
                f"ignored: the cluster admin has not listed namespace {namespace} in a "
                "ClusterTunnel's directBackendNamespaces")

    try:  # authentication and rate limits (ingressgate); a bad one serves nothing
        gate: dict[str, Any] = {
            "auth": route_auth(annotations, namespace,
                               lambda ns, n: index.secrets.get((ns, n))),
            "rate_limit": rate_limit(annotations)}
    except GateAnnotationError as exc:
        out.refused["bad_gate"] += 1
        problem("InvalidAuthOrLimits", f"{exc}; the Ingress is not served until fixed")
        return

    default_backend = spec.get("defaultBackend")
    if default_backend is not None:
        backends = _backends(namespace, default_backend, index, out, problem,
                             where="defaultBackend", direct=direct)
        if backends is not None:
            out.default = IngressRule(
                name=label, path="/", backends=backends, rank=rank,
                backend_protocol=backend_protocol(namespace, default_backend, index),
                health_check=_health_check(namespace, default_backend, index, problem), **gate)
            out.default_rank = rank
            out.default_service = (namespace, _service_name(default_backend))

    for i, rule in enumerate(spec.get("rules") or []):
        host = rule.get("host") or None
        for j, path in enumerate((rule.get("http") or {}).get("paths") or []):
            where = f"rules[{i}].http.paths[{j}]"
            path_text = path.get("path") or "/"
            path_type = path.get("pathType", "ImplementationSpecific")
            if path_type not in PATH_TYPES:
                problem("InvalidPath", f"{where}: pathType {path_type!r} is not Exact, "
                                       "Prefix or ImplementationSpecific")
                continue
            try:  # what the route table accepts: host syntax, path form
                if host is not None:
                    check_rule_host(host)
                check_rule_path(path_text)
            except ValueError as exc:
                problem("InvalidRule", f"{where}: {exc}")
                continue
            backends = _backends(namespace, path.get("backend") or {}, index, out, problem,
                                 where=f"{where}.backend", direct=direct)
            if backends is None:
                continue
            out.rules.append(IngressRule(
                name=label, host=host, path=path_text, path_type=path_type,
                backends=backends, rank=rank,
                tls_redirect=redirect and host is not None and host in tls_hosts,
                backend_protocol=backend_protocol(namespace, path.get("backend") or {},
                                                  index),
                health_check=_health_check(namespace, path.get("backend") or {}, index,
                                           problem), **gate))
            out.rule_services.append((namespace, _service_name(path.get("backend") or {})))


def _service_name(backend: Obj) -> str:
    service = backend.get("service")
    return str(service.get("name", "")) if isinstance(service, dict) else ""


def _tls(ingress: Obj, index: _Index, out: _Out, problem: Any) -> set[str]:
    namespace, _ = _key(ingress)
    hosts_with_cert: set[str] = set()
    for i, entry in enumerate((ingress.get("spec") or {}).get("tls") or []):
        hosts = tuple(h.lower() for h in entry.get("hosts") or [])
        secret_name = entry.get("secretName")
        if not secret_name:
            problem("TLSSecretMissing", f"tls[{i}]: no secretName")
            continue
        secret = index.secrets.get((namespace, secret_name))
        if secret is None:
            problem("TLSSecretMissing", f"tls[{i}]: Secret {namespace}/{secret_name} "
                                        "not found; its hosts are served over http only")
            continue
        try:
            cert_pem, key_pem = tls_pair(secret)
        except ValueError as exc:
            problem("TLSSecretInvalid", f"tls[{i}]: Secret {namespace}/{secret_name}: {exc}")
            continue
        out.tls.append(IngressTls(name=f"{namespace}/{secret_name}", hosts=hosts,
                                  cert_pem=cert_pem, key_pem=key_pem))
        hosts_with_cert.update(hosts)
    return hosts_with_cert


def tls_pair(secret: Obj) -> tuple[str, str]:
    """The (certificate chain, key) PEM of a kubernetes.io/tls Secret, checked to parse
    and to belong together. ValueError says what is wrong."""
    import base64
    import binascii
    data = secret.get("data") or {}
    try:
        cert_pem = base64.b64decode(data.get("tls.crt", ""), validate=True)
        key_pem = base64.b64decode(data.get("tls.key", ""), validate=True)
    except (binascii.Error, TypeError):
        raise ValueError("tls.crt or tls.key is not base64") from None
    if not cert_pem or not key_pem:
        raise ValueError("needs tls.crt and tls.key")
    try:
        certs = x509.load_pem_x509_certificates(cert_pem)
    except ValueError:
        raise ValueError("tls.crt is not a PEM certificate") from None
    try:
        key: PrivateKeyTypes = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError):
        raise ValueError("tls.key is not an unencrypted PEM private key") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.DER
    if key.public_key().public_bytes(encoding, public) != certs[0].public_key().public_bytes(
            encoding, public):
        raise ValueError("tls.key does not match the certificate in tls.crt")
    return cert_pem.decode(), key_pem.decode()


def _backends(namespace: str, backend: Obj, index: _Index, out: _Out, problem: Any, *,
              where: str, direct: bool) -> tuple[Backend, ...] | None:
    """The backends of one Ingress backend reference; None (and a Problem) if unusable."""
    service_ref = backend.get("service")
    if not isinstance(service_ref, dict):
        problem("UnsupportedBackend", f"{where}: only service backends are supported")
        return None
    svc_name = service_ref.get("name", "")
    service = index.services.get((namespace, svc_name))
    if service is None:
        problem("ServiceNotFound", f"{where}: Service {namespace}/{svc_name} not found")
        return None
    port_ref = service_ref.get("port") or {}
    svc_spec = service.get("spec") or {}
    svc_port = None
    for port in svc_spec.get("ports") or []:
        if ("number" in port_ref and port.get("port") == port_ref["number"]) or (
                "name" in port_ref and port.get("name") == port_ref["name"]):
            svc_port = port
            break
    if svc_spec.get("type") == "ExternalName":
        if not direct:
            out.refused["external_name"] += 1
            problem("DirectBackendRefused", f"{where}: Service {namespace}/{svc_name} is "
                    f"ExternalName, which the server would dial itself; {_OPT_IN}")
            return None
        number = port_ref.get("number") or (svc_port or {}).get("port")
        if not number:
            problem("ServicePortNotFound", f"{where}: ExternalName Service {svc_name} needs "
                                           "a port number")
            return None
        return (Backend(node=None, target=HostPort(host=svc_spec["externalName"],
                                                   port=int(number))),)
    if svc_port is None:
        problem("ServicePortNotFound", f"{where}: Service {namespace}/{svc_name} has no port "
                                       f"{port_ref.get('number', port_ref.get('name'))!r}")
        return None
    ready: list[Backend] = []
    terminating: list[Backend] = []
    nodeless: set[str] = set()
    off_node: set[str] = set()
    unproven: dict[str, set[str]] = {}  # reason → "address on node"
    for es in index.slices.get((namespace, svc_name), []):
        port = _slice_port(es, svc_port)
        if port is None:
            continue
        for endpoint in es.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            is_ready = conditions.get("ready") is not False  # nil means ready
            serving = conditions.get("serving", is_ready)
            if not is_ready and not (serving and conditions.get("terminating")):
                continue
            node = endpoint.get("nodeName")
            for address in endpoint.get("addresses") or []:
                if node is None and not direct:
                    nodeless.add(str(address))
                    out.refused["nodeless"] += 1
                    continue
                if node is not None and not on_node(str(address), index.memo.networks(
                        str(node), index.nodes.get(str(node)))):
                    off_node.add(f"{address} on {node}")
                    out.refused["off_node"] += 1
                    continue
                if node is not None and not direct and (reason := endpoint_refusal(
                        namespace, endpoint, str(address), port, index.pods)) is not None:
                    unproven.setdefault(reason, set()).add(f"{address} on {node}")
                    out.refused[reason] += 1
                    continue
                item = Backend(node=node, target=HostPort(host=address, port=port))
                (ready if is_ready else terminating).append(item)
    if nodeless:
        problem("DirectBackendRefused", f"{where}: Service {namespace}/{svc_name}: endpoints "
                f"without a nodeName ({len(nodeless)}: {', '.join(sorted(nodeless)[:3])}) "
                f"would be dialed by the server itself; {_OPT_IN}")
    if off_node:
        problem("EndpointNotOnNode", f"{where}: Service {namespace}/{svc_name}: endpoint "
                f"addresses outside their node's podCIDRs and addresses are ignored "
                f"({len(off_node)}: {', '.join(sorted(off_node)[:3])})")
    for reason, where_ in sorted(unproven.items()):
        problem("EndpointRefused", f"{where}: Service {namespace}/{svc_name}: endpoints "
                f"not tied to a Pod of namespace {namespace} on their node are ignored "
                f"({reason}, {len(where_)}: {', '.join(sorted(where_)[:3])}); "
                f"{_OPT_IN}")
    chosen = ready or terminating
    for item in chosen:
        if item.node is not None:
            out.node_targets.setdefault(item.node, set()).add(
                (item.target.host, item.target.port))
    return tuple(sorted(set(chosen), key=lambda b: (b.node or "", b.target.host,
                                                    b.target.port)))


H2C_APP_PROTOCOLS = frozenset({"kubernetes.io/h2c", "grpc"})
"""Service port `appProtocol` values whose backends get HTTP/2 with prior knowledge
(KEP-3726's `kubernetes.io/h2c`, and `grpc`, which is HTTP/2 by definition)."""


def _health_check(namespace: str, backend: Obj, index: _Index,
                  problem: Any) -> HealthCheck | None:
    """The backend Service's `nodeagent.io/health-check` (serviceannotations); a bad
    value is a Problem and no check."""
    service_ref = backend.get("service")
    if not isinstance(service_ref, dict):
        return None
    name = str(service_ref.get("name", ""))
    service = index.services.get((namespace, name))
    check, why = health_check_of(_meta(service or {}).get("annotations"))
    if why is not None:
        problem("InvalidHealthCheck", f"Service {namespace}/{name}: {why}")
    return check


def backend_protocol(namespace: str, backend: Obj, index: _Index) -> Literal["h1", "h2c"]:
    """What an Ingress backend's Service port speaks, from its `appProtocol`: "h2c" for
    `kubernetes.io/h2c` and `grpc`, "h1" otherwise (unset, `http`, anything else)."""
    service_ref = backend.get("service")
    if not isinstance(service_ref, dict):
        return "h1"
    service = index.services.get((namespace, service_ref.get("name", "")))
    port_ref = service_ref.get("port") or {}
    for port in ((service or {}).get("spec") or {}).get("ports") or []:
        if ("number" in port_ref and port.get("port") == port_ref["number"]) or (
                "name" in port_ref and port.get("name") == port_ref["name"]):
            return "h2c" if port.get("appProtocol") in H2C_APP_PROTOCOLS else "h1"
    return "h1"


def _slice_port(es: Obj, svc_port: Obj) -> int | None:
    """The target port an EndpointSlice gives for this Service port: matched by name
    (EndpointSlice ports carry the Service port's name), or the only port if unnamed."""
    ports = es.get("ports") or []
    name = svc_port.get("name") or ""
    for port in ports:
        if (port.get("name") or "") == name and port.get("port"):
            return int(port["port"])
    target = svc_port.get("targetPort")
    if isinstance(target, int) and not ports:
        return target
    return None
