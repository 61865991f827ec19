"""Which connections the agent intercepts, as the netfilter package's model, and which
netfilter backend programs them.

Pure translation of an intercept spec (the `intercept:` section of agent config) into
`netfilter.model.InterceptModel`, plus the per-connection rule lookup the transparent
listener uses to decide where a caught connection goes. It does not import the config
model: the config model imports it to validate a file at load time, so depending on the
spec's shape (`InterceptSpec`) instead of its class keeps the import graph one-way.
"""

from __future__ import annotations

import ipaddress
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from netfilter.model import (
    InterceptModel,
    InterceptRule,
    InvalidRule,
    Mode,
    ProxyPorts,
    parse_cidrs,
    validate_model,
)


class InterceptRuleSpec(Protocol):
    """One intercept rule as config states it (nodeagent.config.InterceptRuleConfig)."""

    @property
    def name(self) -> str: ...
    @property
    def protocol(self) -> str: ...
    @property
    def destinations(self) -> Sequence[str]: ...
    @property
    def ports(self) -> Sequence[int | str]: ...
    @property
    def source_interfaces(self) -> Sequence[str]: ...
    @property
    def source_cidrs(self) -> Sequence[str]: ...
    @property
    def exclude(self) -> Sequence[str]: ...
    @property
    def host_traffic(self) -> bool: ...
    @property
    def via(self) -> str: ...


class InterceptSpec(Protocol):
    """The intercept section as config states it (nodeagent.config.InterceptConfig)."""

    @property
    def mode(self) -> str: ...
    @property
    def backend(self) -> str: ...
    @property
    def proxy_port(self) -> int: ...
    @property
    def exclude(self) -> Sequence[str]: ...
    @property
    def rules(self) -> Sequence[InterceptRuleSpec]: ...


class Backend(Protocol):
    def apply(self, model: InterceptModel) -> bool: ...
    def remove(self) -> bool: ...
    def reconcile(self, model: InterceptModel | None) -> bool: ...
    def list_applied(self) -> str: ...


def build_model(config: InterceptSpec, *, skip_mark: int,
                interfaces: list[str] | None = None) -> InterceptModel:
    """InterceptConfig → the netfilter model, validated. Raises NetfilterError (its
    InvalidRule names the rule) for overlapping or invalid CIDRs, bad ports, unknown
    interfaces (when `interfaces` is given)."""
    for rule in config.rules:
        if rule.protocol != "tcp":
            # The rule model and both backends render udp, but the agent has no UDP relay
            # yet: a udp rule would divert datagrams to a port nobody serves.
            raise InvalidRule(rule.name, "protocol udp is not supported by the agent yet; "
                                         "intercept rules are tcp only")
    rules = tuple(
        InterceptRule.parse(
            rule.name, rule.protocol, rule.destinations, ports=rule.ports,
            source_interfaces=rule.source_interfaces, source_cidrs=rule.source_cidrs,
            exclude=rule.exclude, host_traffic=rule.host_traffic)
        for rule in config.rules
    )
    model = InterceptModel(
        rules=rules,
        proxy_ports=ProxyPorts(tcp4=config.proxy_port, tcp6=config.proxy_port),
        mode=Mode(config.mode),
        exclude=parse_cidrs("(global)", "exclude", config.exclude),
        skip_mark=skip_mark,
    )
    return validate_model(model, interfaces)


def choose_backend(name: str, netns: str | None = None) -> tuple[Backend, str]:
    """The backend to program and one line saying why. "auto" follows what the host
    already uses (netfilter.detect: legacy iptables holding kube-proxy's chains means an
    iptables-legacy host; otherwise our own nftables table)."""
    from netfilter.detect import Backend as Kind
    from netfilter.detect import detect_backend
    from netfilter.iptables import IptablesBackend
    from netfilter.nftables import NftablesBackend
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

    def matches(self, host: str, port: int) -> bool:
        address = ipaddress.ip_address(host)
        if not any(address.version == n.version and address in n for n in self.networks):
            return False
        if any(address.version == n.version and address in n for n in self.exclude):
            return False
        return not self.ports or any(a <= port <= b for a, b in self.ports)


def active_rule(config: InterceptRuleSpec, rule: InterceptRule) -> ActiveRule:
    return ActiveRule(
        name=rule.name, protocol=rule.protocol.value, networks=rule.destinations,
        exclude=rule.exclude, ports=tuple((r.first, r.last) for r in rule.ports),
        via=config.via)
