"""A Node's bandwidth annotations → the servers' `RoutesConfig.bandwidth` entry for it
(pure: the Node in, a `NodeBandwidth` or a problem out; docs/limits.md).

`nodeagent.io/bandwidth-to-node` and `nodeagent.io/bandwidth-from-node` hold bytes per
second, a number with an optional suffix as Kubernetes quantities write them (`k`, `M`,
`G`: powers of 1000; `Ki`, `Mi`, `Gi`: powers of 1024): `10Mi` is 10,485,760 bytes/s.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from nodeagent.config.gateway import NodeBandwidth

TO_NODE = "nodeagent.io/bandwidth-to-node"
FROM_NODE = "nodeagent.io/bandwidth-from-node"

_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*(k|M|G|Ki|Mi|Gi)?\Z")
_FACTORS = {None: 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20,
            "Gi": 2**30}


def parse_rate(text: str) -> float:
    """Bytes per second from `10Mi`, `500k`, `2000000`. ValueError says why not."""
    m = _QUANTITY.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not bytes per second (e.g. 500k, 10Mi, 2000000)")
    return float(m.group(1)) * _FACTORS[m.group(2)]


def node_bandwidth(annotations: dict[str, Any]) -> NodeBandwidth | None:
    """The Node's bandwidth, None when it sets none. ValueError names the annotation."""
    given: dict[str, float] = {}
    for field, name in (("to_node", TO_NODE), ("from_node", FROM_NODE)):
        if name in annotations:
            try:
                given[field] = parse_rate(str(annotations[name]))
            except ValueError as exc:
                raise ValueError(f"{name}: {exc}") from None
    if not given:
        return None
    try:
        return NodeBandwidth(**given)
    except ValidationError as exc:
        raise ValueError("; ".join(f"{e['loc'][0]}: {e['msg']}" for e in exc.errors(
            include_input=False, include_url=False))) from None


__all__ = ["FROM_NODE", "TO_NODE", "node_bandwidth", "parse_rate"]
