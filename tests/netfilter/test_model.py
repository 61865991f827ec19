"""The pure rule model: validation errors that name the rule, and normalisation."""

from __future__ import annotations

import ipaddress
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netfilter.model import (
    InterceptModel,
    InterceptRule,
    InvalidRule,
    Mode,
    NetfilterError,
    PortRange,
    Protocol,
    ProxyPorts,
    normalize_cidrs,
    normalize_ports,
    validate_model,
)
from tests.netfilter.models import PORTS


def model_of(*rules: InterceptRule, **kw: object) -> InterceptModel:
    return InterceptModel(rules=rules, proxy_ports=kw.pop("proxy_ports", PORTS), **kw)  # type: ignore[arg-type]


def rule(
    name: str = "web", dests: tuple[str, ...] = ("10.0.0.0/8",), **kw: object
) -> InterceptRule:
    return InterceptRule.parse(name, str(kw.pop("protocol", "tcp")), dests, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: rule(dests=("10.0.0.0/8", "10.1.0.0/16")), "10.1.0.0/16 overlaps 10.0.0.0/8"),
        (lambda: rule(dests=("10.0.0.0/8", "10.0.0.0/8")), "10.0.0.0/8 is listed twice"),
        (lambda: rule(dests=("10.0.0.1/8",)), "'10.0.0.1/8' is not a valid CIDR"),
        (lambda: rule(dests=("banana",)), "'banana' is not a valid CIDR"),
        (lambda: rule(dests=()), "no destinations"),
        (lambda: rule(ports=["0"]), "0 is out of range"),
        (lambda: rule(ports=["65536"]), "65536 is out of range"),
        (lambda: rule(ports=["90-80"]), "range 90-80 is reversed"),
        (lambda: rule(ports=["http"]), "'http' is not a port"),
        (lambda: rule(ports=["80-90", "85"]), "85 overlaps 80-90"),
        (lambda: rule(protocol="sctp"), "protocol must be tcp or udp"),
        (lambda: rule(source_cidrs=["fd00::/8"]), "source_cidrs has no ipv4 entry"),
        (lambda: rule(exclude=["192.168.0.0/16"]), "192.168.0.0/16 lies outside every dest"),
        (lambda: rule(exclude=["10.1.0.0/16", "10.1.2.0/24"]), "exclude: 10.1.2.0/24 overlaps"),
        (lambda: rule(protocol="udp"), "UDP interception needs mode tproxy"),
        (lambda: rule(source_interfaces=["eth0", "eth0"]), "'eth0' is listed twice"),
        (lambda: rule(source_interfaces=["a/b"]), "'a/b' is not an interface name"),
        (lambda: rule(name="Web"), "name must be a lowercase letter"),
        (lambda: rule(name="9web"), "name must be a lowercase letter"),
        # A trailing newline would reach the rendered ruleset.
        (lambda: rule(name="web\n"), "name must be a lowercase letter"),
        (lambda: rule(source_interfaces=["eth0\n"]), "is not an interface name"),
    ],
)
def test_invalid_rules_name_the_rule(make: object, message: str) -> None:
    with pytest.raises(InvalidRule) as info:
        validate_model(model_of(make()))  # type: ignore[operator]
    assert message in str(info.value)
    assert info.value.rule_name in ("web", "Web", "9web", "web\n")
    assert isinstance(info.value, NetfilterError)


def test_unknown_interface_checked_against_host_links() -> None:
    model = model_of(rule(source_interfaces=["cni0"]))
    assert validate_model(model, interfaces=["lo", "cni0"])
    with pytest.raises(InvalidRule, match="'web': source_interfaces: no interface 'cni0'"):
        validate_model(model, interfaces=["lo", "eth0"])


def test_missing_proxy_port_and_model_settings() -> None:
    with pytest.raises(InvalidRule, match="'web': no proxy port for tcp/ipv6"):
        validate_model(model_of(rule(dests=("fd00::/8",)), proxy_ports=ProxyPorts(tcp4=1)))
    with pytest.raises(InvalidRule, match="'dup': another rule has the same name"):
        validate_model(model_of(rule("dup"), rule("dup", ("192.168.0.0/16",))))
    with pytest.raises(InvalidRule, match="kube-proxy"):
        validate_model(model_of(rule(), skip_mark=0x4000))
    with pytest.raises(InvalidRule, match="share bits"):
        validate_model(model_of(rule(), skip_mark=0x3, tproxy_mark=0x2))
    with pytest.raises(InvalidRule, match="reserved"):
        validate_model(model_of(rule(), route_table=254))
    with pytest.raises(InvalidRule, match=r"'\*': exclude: 10.0.0.0/9 overlaps 10.0.0.0/8"):
        validate_model(model_of(rule(), exclude=tuple(
            ipaddress.ip_network(n) for n in ("10.0.0.0/8", "10.0.0.0/9"))))


def test_normal_form() -> None:
    model = validate_model(model_of(rule(
        dests=("fd00::/16", "10.0.128.0/17", "10.0.0.0/17", "192.168.0.0/24"),
        ports=["443", "81-90", "80"],
        source_interfaces=["veth1", "cni0"],
    )))
    r = model.rules[0]
    assert [str(n) for n in r.destinations] == ["10.0.0.0/16", "192.168.0.0/24", "fd00::/16"]
    assert [str(p) for p in r.ports] == ["80-90", "443"]
    assert r.source_interfaces == ("cni0", "veth1")
    assert validate_model(model) == model  # the normal form is a fixed point


def test_policy_routing_needs() -> None:
    assert model_of(rule(), mode=Mode.TPROXY).needs_policy_routing
    assert model_of(rule()).needs_policy_routing  # the post-DNAT TPROXY lane
    assert not model_of(rule(), tproxy_after_dnat=False).needs_policy_routing
    assert not model_of().needs_policy_routing


_v4_nets = st.builds(
    lambda addr, plen: ipaddress.IPv4Network((addr, plen), strict=False),
    st.integers(0, 2**32 - 1), st.integers(8, 32),
)
_v6_nets = st.builds(
    lambda addr, plen: ipaddress.IPv6Network((addr, plen), strict=False),
    st.integers(0, 2**128 - 1), st.integers(16, 128),
)


Net = ipaddress.IPv4Network | ipaddress.IPv6Network


def _covered(nets: list[Net]) -> set[tuple[int, int, int]]:
    return {(n.version, int(n.network_address), int(n.broadcast_address)) for n in nets}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(_v4_nets, _v6_nets), max_size=30))
def test_normalize_cidrs_property(nets: list[Net]) -> None:
    disjoint = not any(
        a is not b and a.version == b.version and a.overlaps(b)  # type: ignore[arg-type]
        for a in nets for b in nets
    ) and len(set(nets)) == len(nets)
    if not disjoint:
        with pytest.raises(InvalidRule, match=r"overlaps|listed twice"):
            normalize_cidrs("r", "destinations", nets)
        return
    out = normalize_cidrs("r", "destinations", nets)
    # Same addresses covered, in canonical order, nothing left to merge, idempotent.
    def addresses(ns: object) -> list[tuple[int, int, int]]:
        spans = sorted(_covered(list(ns)))  # type: ignore[call-overload]
        merged: list[tuple[int, int, int]] = []
        for v, lo, hi in spans:
            if merged and merged[-1][0] == v and lo == merged[-1][2] + 1:
                merged[-1] = (v, merged[-1][1], hi)
            else:
                merged.append((v, lo, hi))
        return merged
    assert addresses(out) == addresses(nets)
    assert list(out) == sorted(out, key=lambda n: (n.version, int(n.network_address)))
    assert normalize_cidrs("r", "destinations", out) == out
    assert len(list(ipaddress.collapse_addresses([n for n in out if n.version == 4]))) == len(
        [n for n in out if n.version == 4])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 65535), st.integers(0, 50)), max_size=20))
def test_normalize_ports_property(spans: list[tuple[int, int]]) -> None:
    ports = [PortRange(a, min(a + n, 65535)) for a, n in spans]
    covered = [set(range(p.first, p.last + 1)) for p in ports]
    overlapping = sum(len(c) for c in covered) != len(set().union(*covered))
    if overlapping:
        with pytest.raises(InvalidRule, match="overlaps"):
            normalize_ports("r", ports)
        return
    out = normalize_ports("r", ports)
    assert set().union(*[set(range(p.first, p.last + 1)) for p in out]) == set().union(*covered)
    # Canonical: sorted, and no two ranges touch (they would have been merged).
    assert all(a.last + 1 < b.first for a, b in itertools.pairwise(out))
    assert normalize_ports("r", out) == out


def test_rule_dataclass_accepts_objects() -> None:
    r = InterceptRule("x", Protocol.TCP, (ipaddress.ip_network("10.0.0.0/8"),))
    assert validate_model(model_of(r)).rules[0].families()
