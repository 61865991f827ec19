"""Scale to zero, the pure part: which Services opt in and with what settings (their
annotations), which workload runs them, whether it is failing to start, and the `wake`
of Ingress rules and LoadBalancer ports that tells the servers to hold requests and
connections for them. Objects in, values out; the writes (sleeping and waking a
workload) are `sleeper.py`'s.

A Service opts in with `nodeagent.io/idle-after: 15m` (a duration: `90s`, `15m`, `1h30m`,
or plain seconds). Optional: `nodeagent.io/wake-timeout` (default 2m: a held request gets
504 after it), `nodeagent.io/max-pending` (default 1000 held requests per server, then
503 with Retry-After) and `nodeagent.io/workload: deployment/NAME` or
`statefulset/NAME` (default: the owner of the Service's pods) and
`nodeagent.io/starting-page: "true"` (browsers get a page that reloads itself instead of
a held request). A bad value is a Problem on the Service, and the Service does not sleep.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nodeagent.config import IngressRoutes, IngressRule, LoadBalancerService, WakeRoute
from nodeagent.controller.ingress import Problem

Obj = dict[str, Any]

IDLE_AFTER = "nodeagent.io/idle-after"
WAKE_TIMEOUT = "nodeagent.io/wake-timeout"
MAX_PENDING = "nodeagent.io/max-pending"
WORKLOAD = "nodeagent.io/workload"
STARTING_PAGE = "nodeagent.io/starting-page"
SETTINGS_ANNOTATIONS = (IDLE_AFTER, WAKE_TIMEOUT, MAX_PENDING, WORKLOAD, STARTING_PAGE)
# Written by the controller, on the Service: {"state", "since", "workload"} (JSON), and
# the last request any server reported (RFC 3339); on the workload: the replica count it
# had when it was put to sleep, which waking restores.
STATE = "nodeagent.io/scale-to-zero"
LAST_REQUEST = "nodeagent.io/last-request"
REPLICAS_BEFORE_SLEEP = "nodeagent.io/replicas-before-sleep"

DEFAULT_WAKE_TIMEOUT = 120.0
DEFAULT_MAX_PENDING = 1000
MIN_IDLE_AFTER = 1.0  # seconds; below that a Service would flap between requests
WORKLOAD_KINDS = {"deployment": "deployments", "deployments": "deployments",
                  "statefulset": "statefulsets", "statefulsets": "statefulsets"}
# Container states that mean the workload will not come up by itself soon.
FAILING_REASONS = frozenset({"CrashLoopBackOff", "ErrImagePull", "ImagePullBackOff",
                             "CreateContainerConfigError", "CreateContainerError",
                             "InvalidImageName", "RunContainerError"})

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")


class SettingsError(ValueError):
    """A scale-to-zero annotation the controller cannot use."""


def parse_duration(text: str) -> float:
    """Seconds in `90`, `1.5s`, `15m`, `1h30m`, `250ms` (Go's duration units, positive)."""
    text = text.strip()
    try:
        seconds = float(text)
    except ValueError:
        pos, seconds = 0, 0.0
        for m in _DURATION.finditer(text):
            if m.start() != pos:
                break
            seconds += float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[
                m.group(2)]
            pos = m.end()
        if pos != len(text) or not text:
            raise SettingsError(f"{text[:40]!r} is not a duration (90s, 15m, 1h30m)") from None
    if not 0 < seconds < 10 * 365 * 86400:
        raise SettingsError(f"{text[:40]!r} is not a positive duration")
    return seconds


@dataclass(frozen=True)
class WakeSettings:
    idle_after: float
    timeout: float
    max_pending: int
    workload: tuple[str, str] | None  # (plural, name) named by annotation
    starting_page: bool = False


def _meta(obj: Obj) -> Obj:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _key(obj: Obj) -> tuple[str, str]:
    meta = _meta(obj)
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def settings_view(service: Obj) -> tuple[Any, ...]:
    """What the config reads of a Service's annotations (not the controller's own
    state and last-request annotations, which change without changing a route)."""
    annotations = _meta(service).get("annotations") or {}
    return tuple(annotations.get(a) for a in SETTINGS_ANNOTATIONS)


def wake_settings(service: Obj) -> WakeSettings | None:
    """The Service's scale-to-zero settings; None when it does not opt in. SettingsError
    for a value that cannot be used."""
    annotations = _meta(service).get("annotations") or {}
    idle = annotations.get(IDLE_AFTER)
    if idle is None:
        return None
    idle_after = parse_duration(str(idle))
    if idle_after < MIN_IDLE_AFTER:
        raise SettingsError(f"{IDLE_AFTER} must be at least {MIN_IDLE_AFTER:g}s")
    timeout = DEFAULT_WAKE_TIMEOUT
    if WAKE_TIMEOUT in annotations:
        timeout = parse_duration(str(annotations[WAKE_TIMEOUT]))
        if timeout > 3600:
            raise SettingsError(f"{WAKE_TIMEOUT} must be at most 1h")
    max_pending = DEFAULT_MAX_PENDING
    if MAX_PENDING in annotations:
        try:
            max_pending = int(str(annotations[MAX_PENDING]))
        except ValueError:
            raise SettingsError(f"{MAX_PENDING} must be a whole number") from None
        if not 0 <= max_pending <= 1_000_000:
            raise SettingsError(f"{MAX_PENDING} must be between 0 and 1000000")
    workload = None
    if WORKLOAD in annotations:
        kind, _, name = str(annotations[WORKLOAD]).partition("/")
        plural = WORKLOAD_KINDS.get(kind.lower())
        if plural is None or not name:
            raise SettingsError(f"{WORKLOAD} must be deployment/NAME or statefulset/NAME")
        workload = (plural, name)
    page = str(annotations.get(STARTING_PAGE, "false")).lower()
    if page not in ("true", "false"):
        raise SettingsError(f"{STARTING_PAGE} must be \"true\" or \"false\"")
    return WakeSettings(idle_after, timeout, max_pending, workload, page == "true")


def selects(service: Obj, pod: Obj) -> bool:
    """Whether the Service's selector selects the pod (same namespace, every label)."""
    selector = (service.get("spec") or {}).get("selector") or {}
    if not selector or _key(pod)[0] != _key(service)[0]:
        return False
    labels = _meta(pod).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def pod_failure(pod: Obj) -> str | None:
    """Why a pod's container is not starting (FAILING_REASONS), with the last exit's
    message; None if it is not failing that way."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (status.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in FAILING_REASONS:
            last = (status.get("lastState") or {}).get("terminated") or {}
            detail = last.get("message") or last.get("reason") or waiting.get("message") or ""
            return f"pod {_meta(pod).get('name')}: {waiting['reason']}" + (
                f": {str(detail).strip()[:200]}" if detail else "")
    return None


def pod_failure_view(pod: Obj) -> Any:
    """What a pod's status feeds the config with (its failure, not its heartbeats)."""
    return pod_failure(pod)


def _ready(pod: Obj) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def start_failure(service: Obj, pods: Iterable[Obj]) -> str:
    """Why the Service's workload fails to start: a selected pod's failure while none is
    ready; "" when none is failing (or one is ready)."""
    failures = []
    for pod in pods:
        if not selects(service, pod):
            continue
        if _ready(pod):
            return ""
        if (why := pod_failure(pod)) is not None:
            failures.append(why)
    return sorted(failures)[0] if failures else ""


def workload_owner(service: Obj, pods: Iterable[Obj]) -> tuple[str, str] | None:
    """The controller (kind, name) of the Service's pods: ("ReplicaSet", ...) or
    ("StatefulSet", ...), from the first selected pod that has one."""
    for pod in sorted(pods, key=_key):
        if not selects(service, pod):
            continue
        for ref in _meta(pod).get("ownerReferences") or []:
            if ref.get("controller") and ref.get("kind") in ("ReplicaSet", "StatefulSet"):
                return str(ref["kind"]), str(ref.get("name", ""))
    return None


def read_state(service: Obj) -> dict[str, Any]:
    """The controller's state annotation on a Service ({} when absent or unreadable)."""
    text = (_meta(service).get("annotations") or {}).get(STATE)
    if not text:
        return {}
    try:
        doc = json.loads(str(text))
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


@dataclass(frozen=True)
class WakeOutcome:
    routes: IngressRoutes
    enabled: dict[tuple[str, str], WakeSettings]  # (namespace, name) → settings
    problems: tuple[Problem, ...]
    # (namespace, name) → why its workload fails to start ("": it does not), per enabled
    failures: dict[tuple[str, str], str] = field(default_factory=dict)


def apply_wake(routes: IngressRoutes, rule_services: Mapping[int, tuple[str, str]],
               default_service: tuple[str, str] | None, services: Iterable[Obj],
               pods: Iterable[Obj], *, enabled: bool) -> WakeOutcome:
    """`routes` with `wake` set on the rules whose Service opts in (`rule_services`:
    rule index → its Service). `enabled` False (a ClusterTunnel switched the feature
    off): no rule gets `wake`, and routes come back unchanged."""
    if not enabled:
        return WakeOutcome(routes, {}, ())
    opted: dict[tuple[str, str], WakeSettings] = {}
    objects: dict[tuple[str, str], Obj] = {}
    problems: list[Problem] = []
    for service in services:
        annotations = _meta(service).get("annotations") or {}
        if IDLE_AFTER not in annotations:
            continue
        key = _key(service)
        try:
            settings = wake_settings(service)
        except SettingsError as exc:
            problems.append(Problem("Service", key[0], key[1], "InvalidScaleToZero",
                                    str(exc)))
            continue
        if settings is not None:
            opted[key] = settings
            objects[key] = service
    if not opted:
        return WakeOutcome(routes, {}, tuple(problems))
    pods = [p for p in pods if _key(p)[0] in {k[0] for k in opted}]
    failures = {key: start_failure(objects[key], pods) for key in opted}

    def with_wake(rule: IngressRule, key: tuple[str, str] | None) -> IngressRule:
        if key is None or key not in opted:
            return rule
        settings = opted[key]
        # Failing matters only while the rule has nowhere to go.
        failure = failures[key] if not rule.backends else ""
        return rule.model_copy(update={"wake": WakeRoute(
            service=f"{key[0]}/{key[1]}", timeout=settings.timeout,
            max_pending=settings.max_pending, failure=failure,
            starting_page=settings.starting_page)})

    rules = tuple(with_wake(rule, rule_services.get(i)) for i, rule in enumerate(routes.rules))
    default = routes.default_backend
    if default is not None:
        default = with_wake(default, default_service)
    return WakeOutcome(routes.model_copy(update={"rules": rules, "default_backend": default}),
                       opted, tuple(problems), failures)


def wake_load_balancers(services: tuple[LoadBalancerService, ...], outcome: WakeOutcome
                        ) -> tuple[LoadBalancerService, ...]:
    """`services` (the servers' LoadBalancer Services) with `wake` set on every port of
    those that opt in (`outcome`: `apply_wake`'s, so the same settings and problems as
    for Ingress rules): the servers hold a sleeping Service's TCP connections and ask
    for the wake on its UDP datagrams. Unchanged (the same objects) when none opts in."""
    if not outcome.enabled:
        return services
    out = []
    for service in services:
        namespace, _, name = service.name.partition("/")
        settings = outcome.enabled.get((namespace, name))
        if settings is None:
            out.append(service)
            continue
        failure = outcome.failures.get((namespace, name), "")
        ports = tuple(port.model_copy(update={"wake": WakeRoute(
            service=service.name, timeout=settings.timeout,
            max_pending=settings.max_pending,
            # Failing matters only while the port has nowhere to go.
            failure="" if port.backends else failure)}) for port in service.ports)
        out.append(service.model_copy(update={"ports": ports}))
    return tuple(out)
