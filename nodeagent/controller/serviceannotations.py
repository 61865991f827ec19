"""The gateway settings a Service carries in annotations, parsed (pure: text in, a value
or a problem out). Whatever turns a Service into routes (Ingress backends, LoadBalancer
Services) calls these, so one annotation means one thing everywhere; a bad value is a
problem for an Event on the Service and the setting stays off (deny by default: a typo
never turns a feature on)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ValidationError

from nodeagent.config.health import HealthCheck

PROXY_PROTOCOL_ANNOTATION = "nodeagent.io/proxy-protocol"
HEALTH_CHECK_ANNOTATION = "nodeagent.io/health-check"
# The annotation's optional settings and the HealthCheck fields they set.
_HEALTH_SETTINGS = {"interval": "interval", "timeout": "timeout",
                    "healthy": "healthy_threshold", "unhealthy": "unhealthy_threshold"}

ProxyProtocol = Literal["v1", "v2"]
_VERSIONS: dict[str, ProxyProtocol] = {"v1": "v1", "v2": "v2"}


def gateway_view(service: Mapping[str, Any]) -> tuple[str | None, ...]:
    """What the config reads of a Service's gateway annotations: a change of these, and
    only these, recomputes config (controller/inputs.py)."""
    annotations = (service.get("metadata") or {}).get("annotations") or {}
    return (annotations.get(PROXY_PROTOCOL_ANNOTATION), annotations.get(HEALTH_CHECK_ANNOTATION))


def proxy_protocol_of(annotations: Mapping[str, str] | None
                      ) -> tuple[ProxyProtocol | None, str | None]:
    """The Service's `nodeagent.io/proxy-protocol` (v1, v2; off, none or absent: no
    header) as (setting, problem): the backends get that PROXY header before each
    connection's bytes (TcpMapping.proxy_protocol). An unknown value: (None, why)."""
    raw = (annotations or {}).get(PROXY_PROTOCOL_ANNOTATION)
    if raw is None:
        return None, None
    value = raw.strip().lower()
    if value in _VERSIONS:
        return _VERSIONS[value], None
    if value in ("", "off", "none", "false"):
        return None, None
    return None, (f"annotation {PROXY_PROTOCOL_ANNOTATION}: {raw[:40]!r} is not v1, v2 or "
                  f"off; no PROXY header is sent")


def health_check_of(annotations: Mapping[str, str] | None
                    ) -> tuple[HealthCheck | None, str | None]:
    """The Service's `nodeagent.io/health-check` as (check, problem): `tcp` or
    `http:/path`, then optional `interval=5 timeout=2 healthy=2 unhealthy=3` (seconds,
    results in a row). Each endpoint is then checked by the agent of its node. A value
    that does not parse: (None, why), and no check (the endpoints stay in rotation)."""
    raw = (annotations or {}).get(HEALTH_CHECK_ANNOTATION)
    if raw is None or not raw.strip():
        return None, None
    words = raw.split()
    kind, _, path = words[0].partition(":")
    fields: dict[str, Any] = {"kind": kind.lower()}
    if path:
        fields["path"] = path
    for word in words[1:]:
        key, _, value = word.partition("=")
        if key not in _HEALTH_SETTINGS or not value:
            return None, (f"annotation {HEALTH_CHECK_ANNOTATION}: {word[:40]!r} is not one of "
                          f"{', '.join(k + '=N' for k in _HEALTH_SETTINGS)}; no health check")
        fields[_HEALTH_SETTINGS[key]] = value
    if fields["kind"] == "tcp" and path:
        return None, (f"annotation {HEALTH_CHECK_ANNOTATION}: a tcp check has no path "
                      f"(http:/path checks one); no health check")
    try:
        return HealthCheck.model_validate(fields), None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return None, (f"annotation {HEALTH_CHECK_ANNOTATION}: {where}: {first['msg']} "
                      f"(value {raw[:60]!r}); no health check")
