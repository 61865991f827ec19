"""Models shared by the netfilter tests (goldens, kernel round trips, real traffic)."""

from __future__ import annotations

import functools
import ipaddress

from netfilter.model import (
    InterceptModel,
    InterceptRule,
    Mode,
    PortRange,
    Protocol,
    ProxyPorts,
    parse_cidrs,
)
from tests.netfilter.lab import PROXY_TCP4, PROXY_TCP6, REMOTE_PORT

PORTS = ProxyPorts(tcp4=PROXY_TCP4, tcp6=PROXY_TCP6, udp4=15003, udp6=15004)


def lab_model(
    mode: Mode = Mode.REDIRECT,
    *,
    host_traffic: bool = False,
    tproxy_after_dnat: bool = True,
    source_interfaces: tuple[str, ...] = (),
) -> InterceptModel:
    """Intercept the lab's remote range on REMOTE_PORT, except .20 / ::20."""
    return InterceptModel(
        rules=(
            InterceptRule.parse(
                "remote", "tcp", ["198.51.100.0/24", "2001:db8:1::/64"],
                ports=[REMOTE_PORT], exclude=["198.51.100.20/32", "2001:db8:1::20/128"],
                source_interfaces=source_interfaces, host_traffic=host_traffic,
            ),
        ),
        proxy_ports=PORTS,
        mode=mode,
        tproxy_after_dnat=tproxy_after_dnat,
    )


def golden_model(mode: Mode) -> InterceptModel:
    """Every feature at once, for the golden renderings."""
    rules = [
        InterceptRule.parse(
            "cloud", "tcp",
            ["10.20.0.0/16", "10.21.0.0/17", "10.21.128.0/17", "fd00:20::/48"],
            ports=["443", "80", "8000-8099", "8100-8199"],
            source_interfaces=["cni0"],
            exclude=["10.20.5.0/24"],
            host_traffic=True,
        ),
        InterceptRule.parse(
            "site-b", "tcp", ["192.168.50.0/24"], source_cidrs=["10.244.0.0/16"],
        ),
    ]
    if mode is Mode.TPROXY:
        rules.append(InterceptRule.parse("dns", "udp", ["10.30.0.10/32"], ports=[53]))
    return InterceptModel(
        rules=tuple(rules),
        proxy_ports=PORTS,
        mode=mode,
        exclude=parse_cidrs("*", "exclude", ["10.20.0.1/32", "fd00:20::1/128"]),
    )


@functools.cache
def many_destinations(count: int, *, name: str = "bulk") -> InterceptModel:
    """`count` disjoint /28s (never adjacent, so none merge) in 10.0.0.0/8 and beyond."""
    step = 32  # a /28 every 32 addresses: a gap of 16 keeps them from merging
    base = int(ipaddress.IPv4Address("10.0.0.0"))
    nets = [ipaddress.IPv4Network((base + i * step, 28)) for i in range(count)]
    return InterceptModel(
        rules=(InterceptRule(name, Protocol.TCP, tuple(nets), ports=(PortRange(443, 443),),
                             host_traffic=True),),
        proxy_ports=PORTS,
    )
