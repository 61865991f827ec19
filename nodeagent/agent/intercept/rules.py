"""Which netfilter backend programs the node's interception, and the per-connection rule
lookup the transparent listener uses to decide where a caught connection goes.

The translation of the `intercept:` config section into the netfilter model is the config
model's own (`nodeagent.config.intercept_model`): it validates every file with it, and the
config model must not depend on a role's package.
"""

from __future__ import annotations

import ipaddress
import shutil
from dataclasses import dataclass
from typing import Protocol

from netfilter.model import (
    InterceptModel,
    InterceptRule,
    NetfilterError,
)
from nodeagent.config import InterceptRuleConfig


class Backend(Protocol):
    def apply(self, model: InterceptModel) -> bool: ...
    def remove(self) -> bool: ...
    def reconcile(self, model: InterceptModel | None) -> bool: ...
    def list_applied(self) -> str: ...


def choose_backend(name: str, netns: str | None = None) -> tuple[Backend, str]:
    """The backend to program and one line saying why. "auto" follows what the host
    already uses (netfilter.detect: legacy iptables holding kube-proxy's chains means an
    iptables-legacy host; otherwise our own nftables table)."""
    from netfilter.detect import Backend as Kind
    from netfilter.detect import detect_backend
    from netfilter.iptables import IptablesBackend
    from netfilter.nftables import NftablesBackend
    # A backend named explicitly whose tool is missing: said now, in one line, not as a
    # failed rule transaction once the agent runs.
    tool = {"iptables": "iptables-legacy-restore", "nftables": "nft"}.get(name)
    if tool is not None and shutil.which(tool) is None:
        raise NetfilterError(f"intercept.backend is {name}, but {tool} is not installed")
    if name == "iptables":
        return IptablesBackend(netns), "intercept.backend is iptables"
    if name == "nftables":
        return NftablesBackend(netns), "intercept.backend is nftables"
    detection = detect_backend(netns)
    if detection.backend is Kind.IPTABLES_LEGACY:
        return IptablesBackend(netns, use_ipset=detection.ipset), detection.reason
    return NftablesBackend(netns), detection.reason


def remove_other_backend_leftovers(chosen: Backend, netns: str | None) -> bool:
    """Remove what a previous run left in the backend we are NOT using now (the host
    switched, or the config did): only our own table/chains, never anything else."""
    from netfilter.iptables import IptablesBackend
    from netfilter.nftables import NftablesBackend
    other: Backend
    if isinstance(chosen, IptablesBackend):
        if shutil.which("nft") is None:
            return False
        other = NftablesBackend(netns)
    else:
        if shutil.which("iptables-legacy-restore") is None:
            return False
        other = IptablesBackend(netns, use_ipset=False)
    return other.remove()


@dataclass(frozen=True)
class ActiveRule:
    """A rule as the listener matches connections against it."""

    name: str
    protocol: str
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    exclude: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]
    ports: tuple[tuple[int, int], ...]
    via: str
    # DNS by zone (udp): queries for these zones go to dns_resolver through the tunnel.
    dns_zones: tuple[str, ...] = ()
    dns_resolver: tuple[str, int] | None = None

    def matches(self, host: str, port: int) -> bool:
        address = ipaddress.ip_address(host)
        if not any(address.version == n.version and address in n for n in self.networks):
            return False
        if any(address.version == n.version and address in n for n in self.exclude):
            return False
        return not self.ports or any(a <= port <= b for a, b in self.ports)


def active_rule(config: InterceptRuleConfig, rule: InterceptRule) -> ActiveRule:
    return ActiveRule(
        name=rule.name, protocol=rule.protocol.value, networks=rule.destinations,
        exclude=rule.exclude, ports=tuple((r.first, r.last) for r in rule.ports),
        via=config.via, dns_zones=config.dns_zones,
        dns_resolver=(config.dns_resolver.host, config.dns_resolver.port)
        if config.dns_resolver is not None else None)


def remove_all(netns: str | None = None) -> list[str]:
    """`nodeagent agent --cleanup`: remove what any agent left in this host's kernel (our
    own nftables table, our iptables chains, the TPROXY policy routing at its default mark
    and table), never anything else. Returns what was removed, for the user."""
    from netfilter.iptables import IptablesBackend
    from netfilter.model import InterceptModel
    from netfilter.nftables import NftablesBackend
    from netfilter.routing import PolicyRouting
    removed = []
    if shutil.which("nft") is not None and NftablesBackend(netns).remove():
        removed.append("nftables table")
    if (shutil.which("iptables-restore") or shutil.which("iptables-legacy-restore")) and \
            IptablesBackend(netns, use_ipset=False).remove():
        removed.append("iptables chains")
    if PolicyRouting(mark=InterceptModel.tproxy_mark, table=InterceptModel.route_table,
                     netns=netns).remove():
        removed.append("policy routing")
    return removed
