"""The gateway settings a Service carries in annotations, parsed (pure: text in, a value
or a problem out). Whatever turns a Service into routes (Ingress backends, LoadBalancer
Services) calls these, so one annotation means one thing everywhere; a bad value is a
problem for an Event on the Service and the setting stays off (deny by default: a typo
never turns a feature on)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

PROXY_PROTOCOL_ANNOTATION = "nodeagent.io/proxy-protocol"

ProxyProtocol = Literal["v1", "v2"]
_VERSIONS: dict[str, ProxyProtocol] = {"v1": "v1", "v2": "v2"}


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
