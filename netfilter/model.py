"""The interception rule model: what to intercept, validated and normalised, with no I/O.

An `InterceptModel` is pure data. `validate_model()` checks it (naming the rule in every
error) and returns the normal form that both backends render: destination, source and
exclusion lists sorted with adjacent networks merged, port lists sorted with adjacent
ranges merged. Rendering always goes through the normal form, so two models that mean
the same thing render to the same text (and re-applying one after the other is a no-op).
"""

from __future__ import annotations

import bisect
import functools
import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# kube-proxy's masquerade (0x4000) and drop (0x8000) bits, in both its iptables and its
# nftables modes. Our marks must never share a bit with them or we would either skip
# traffic kube-proxy merely wanted masqueraded or make kube-proxy masquerade ours.
KUBE_PROXY_MARK_BITS = 0x4000 | 0x8000

# Rule names become parts of nft set names and iptables comments: a letter first (nft
# identifiers cannot start with a digit), then letters, digits and '-', short enough that
# "<name>-exclude6" stays readable.
_RULE_NAME = re.compile(r"^[a-z][a-z0-9-]{0,39}\Z")
# Linux IFNAMSIZ is 16 including the NUL; '/' and whitespace are never valid in a name.
_IFNAME = re.compile(r"^[^/\s]{1,15}\Z")


class NetfilterError(Exception):
    """Base of every error this package raises."""


class InvalidRule(NetfilterError):
    """A rule (or the model's global settings, rule_name "*") cannot be applied as given."""

    def __init__(self, rule_name: str, message: str) -> None:
        super().__init__(f"intercept rule {rule_name!r}: {message}")
        self.rule_name = rule_name
        self.message = message


class Protocol(StrEnum):
    TCP = "tcp"
    UDP = "udp"


class Mode(StrEnum):
    # NAT the connection to the local proxy port; the proxy asks SO_ORIGINAL_DST.
    REDIRECT = "redirect"
    # Hand the packet to a local IP_TRANSPARENT socket unchanged; the proxy reads its own
    # local address. Needs the fwmark -> local route table policy routing (routing.py).
    TPROXY = "tproxy"


class Family(StrEnum):
    IPV4 = "ipv4"
    IPV6 = "ipv6"


def family_of(net: IPNetwork) -> Family:
    return Family.IPV4 if net.version == 4 else Family.IPV6


@dataclass(frozen=True, order=True)
class PortRange:
    first: int
    last: int

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


@dataclass(frozen=True)
class InterceptRule:
    """Which connections to intercept.

    A connection matches when its protocol is `protocol`, its destination lies in
    `destinations` but not in `exclude`, its destination port is in `ports` (empty: any
    port), and — for traffic arriving from pods — it came in on one of
    `source_interfaces` (if any are given) AND from one of `source_cidrs` (if any are
    given). `host_traffic` also intercepts connections opened by processes on the node
    itself (the OUTPUT hook); source selectors describe arrival and do not apply there.
    """

    name: str
    protocol: Protocol
    destinations: tuple[IPNetwork, ...]
    ports: tuple[PortRange, ...] = ()
    source_interfaces: tuple[str, ...] = ()
    source_cidrs: tuple[IPNetwork, ...] = ()
    exclude: tuple[IPNetwork, ...] = ()
    host_traffic: bool = False

    @classmethod
    def parse(
        cls,
        name: str,
        protocol: str,
        destinations: Iterable[str],
        *,
        ports: Iterable[str | int] = (),
        source_interfaces: Iterable[str] = (),
        source_cidrs: Iterable[str] = (),
        exclude: Iterable[str] = (),
        host_traffic: bool = False,
    ) -> InterceptRule:
        """Build a rule from config-file strings ("10.0.0.0/8", "80", "8000-8100")."""
        try:
            proto = Protocol(protocol.lower())
        except ValueError:
            raise InvalidRule(name, f"protocol must be tcp or udp, not {protocol!r}") from None
        return cls(
            name=name,
            protocol=proto,
            destinations=parse_cidrs(name, "destinations", destinations),
            ports=tuple(parse_port(name, p) for p in ports),
            source_interfaces=tuple(source_interfaces),
            source_cidrs=parse_cidrs(name, "source_cidrs", source_cidrs),
            exclude=parse_cidrs(name, "exclude", exclude),
            host_traffic=host_traffic,
        )

    @functools.cached_property
    def _by_family(self) -> dict[Family, tuple[IPNetwork, ...]]:
        # Cached: planners ask per family and per chain, and lists can be 10,000 long.
        # (cached_property writes the instance __dict__, which a frozen dataclass allows.)
        return {
            Family.IPV4: tuple(n for n in self.destinations if n.version == 4),
            Family.IPV6: tuple(n for n in self.destinations if n.version == 6),
        }

    def destinations_of(self, family: Family) -> tuple[IPNetwork, ...]:
        return self._by_family[family]

    def families(self) -> tuple[Family, ...]:
        return tuple(f for f in Family if self._by_family[f])


@dataclass(frozen=True)
class ProxyPorts:
    """The local ports the transparent proxy listens on, per protocol and family.

    None means "not served": a rule that needs that combination is invalid.
    """

    tcp4: int | None = None
    tcp6: int | None = None
    udp4: int | None = None
    udp6: int | None = None

    def port_for(self, protocol: Protocol, family: Family) -> int | None:
        if protocol is Protocol.TCP:
            return self.tcp4 if family is Family.IPV4 else self.tcp6
        return self.udp4 if family is Family.IPV4 else self.udp6


@dataclass(frozen=True)
class InterceptModel:
    """Everything one node intercepts, plus how.

    `skip_mark` is the SO_MARK the agent puts on its own sockets: packets carrying all
    of its bits are never intercepted. `tproxy_mark` is the fwmark bit that policy
    routing (fwmark -> `route_table`, a `local` default route) uses to deliver TPROXY'd
    packets to the local socket. `tproxy_after_dnat` (REDIRECT mode only) adds a TPROXY
    lane for connections that something else (kube-proxy) has already DNAT'ed, because
    the kernel runs at most one DNAT per connection and a REDIRECT would never fire for
    them; see nftables.py for the whole argument.
    """

    rules: tuple[InterceptRule, ...]
    proxy_ports: ProxyPorts
    mode: Mode = Mode.REDIRECT
    exclude: tuple[IPNetwork, ...] = ()
    skip_mark: int = 0x20
    tproxy_mark: int = 0x40
    route_table: int = 1066
    tproxy_after_dnat: bool = True

    @property
    def needs_policy_routing(self) -> bool:
        """Whether the fwmark -> local table route must be in place (routing.py)."""
        if not self.rules:
            return False
        return self.mode is Mode.TPROXY or self.tproxy_after_dnat

    @property
    def needs_transparent_listener(self) -> bool:
        """Whether the proxy's listeners need IP_TRANSPARENT (TPROXY'd connections)."""
        return self.needs_policy_routing

    def families(self) -> tuple[Family, ...]:
        return tuple(f for f in Family if any(f in r.families() for r in self.rules))


def parse_cidrs(rule_name: str, what: str, values: Iterable[str]) -> tuple[IPNetwork, ...]:
    out: list[IPNetwork] = []
    for value in values:
        try:
            out.append(ipaddress.ip_network(value.strip(), strict=True))
        except ValueError as e:
            raise InvalidRule(rule_name, f"{what}: {value!r} is not a valid CIDR ({e})") from None
    return tuple(out)


def parse_port(rule_name: str, value: str | int) -> PortRange:
    text = str(value).strip()
    try:
        if "-" in text:
            a, b = text.split("-", 1)
            pr = PortRange(int(a), int(b))
        else:
            pr = PortRange(int(text), int(text))
    except ValueError:
        raise InvalidRule(rule_name, f"ports: {value!r} is not a port or a range a-b") from None
    _check_port_range(rule_name, pr)
    return pr


def _check_port_range(rule_name: str, pr: PortRange) -> None:
    if not (1 <= pr.first <= 65535 and 1 <= pr.last <= 65535):
        raise InvalidRule(rule_name, f"ports: {pr} is out of range (1-65535)")
    if pr.first > pr.last:
        raise InvalidRule(rule_name, f"ports: range {pr.first}-{pr.last} is reversed")


def _span(net: IPNetwork) -> tuple[int, int]:
    """First and last address as integers (cheaper than .broadcast_address)."""
    start = int(net.network_address)
    return start, start + (1 << (net.max_prefixlen - net.prefixlen)) - 1


def normalize_cidrs(
    rule_name: str, what: str, nets: Sequence[IPNetwork]
) -> tuple[IPNetwork, ...]:
    """Sort, reject overlaps, merge adjacent networks.

    Overlaps are rejected, not silently merged: in config they are nearly always a
    mistake (a /16 listed inside a /8), and an nft interval set refuses overlapping
    elements in one transaction anyway. Adjacent networks are merged (two /25s become a
    /24) because that changes nothing about what matches and gives one canonical form.
    Integer spans, not ipaddress.collapse_addresses: this runs on every apply of lists
    with 10,000 entries and must stay in the low milliseconds.
    """
    out: list[IPNetwork] = []
    for version in (4, 6):
        fam = sorted(
            ((*_span(n), n) for n in nets if n.version == version),
            key=lambda t: (t[0], -t[1]),
        )
        # Runs of adjacent networks: [first index into fam, last index, end address].
        runs: list[list[int]] = []
        for i, (start, end, net) in enumerate(fam):
            if runs and start <= runs[-1][2]:
                prev = fam[runs[-1][1]][2]
                if net == prev:
                    raise InvalidRule(rule_name, f"{what}: {net} is listed twice")
                raise InvalidRule(rule_name, f"{what}: {net} overlaps {prev}")
            if runs and start == runs[-1][2] + 1:
                runs[-1][1:] = [i, end]
            else:
                runs.append([i, i, end])
        for first, last, end in runs:
            if first == last:
                out.append(fam[first][2])
            else:
                low = fam[first][2].network_address
                high = type(low)(end)
                out.extend(ipaddress.summarize_address_range(low, high))
    return tuple(out)


def normalize_ports(rule_name: str, ports: Sequence[PortRange]) -> tuple[PortRange, ...]:
    """Sort, reject overlaps (same reasoning as CIDRs), merge adjacent ranges."""
    for pr in ports:
        _check_port_range(rule_name, pr)
    out: list[PortRange] = []
    for pr in sorted(ports):
        if out and pr.first <= out[-1].last:
            raise InvalidRule(rule_name, f"ports: {pr} overlaps {out[-1]}")
        if out and pr.first == out[-1].last + 1:
            out[-1] = PortRange(out[-1].first, pr.last)
        else:
            out.append(pr)
    return tuple(out)


def _check_mark(name: str, value: int) -> None:
    if not 0 < value <= 0xFFFFFFFF:
        raise InvalidRule("*", f"{name} must be a non-zero 32-bit mark, not {value:#x}")
    if value & KUBE_PROXY_MARK_BITS:
        raise InvalidRule(
            "*", f"{name} {value:#x} shares bits with kube-proxy's marks 0x4000/0x8000"
        )


def validate_rule(
    rule: InterceptRule, model: InterceptModel, interfaces: Iterable[str] | None = None
) -> InterceptRule:
    """Check one rule against the model; return its normal form. Raises InvalidRule."""
    name = rule.name
    if not _RULE_NAME.match(name):
        raise InvalidRule(
            name, "name must be a lowercase letter then up to 39 of [a-z0-9-]"
        )
    if not rule.destinations:
        raise InvalidRule(name, "no destinations: an empty rule would intercept nothing")
    destinations = normalize_cidrs(name, "destinations", rule.destinations)
    exclude = normalize_cidrs(name, "exclude", rule.exclude)
    source_cidrs = normalize_cidrs(name, "source_cidrs", rule.source_cidrs)
    ports = normalize_ports(name, rule.ports)

    seen: set[str] = set()
    for ifname in rule.source_interfaces:
        if not _IFNAME.match(ifname):
            raise InvalidRule(name, f"source_interfaces: {ifname!r} is not an interface name")
        if ifname in seen:
            raise InvalidRule(name, f"source_interfaces: {ifname!r} is listed twice")
        seen.add(ifname)
    if interfaces is not None:
        known = set(interfaces)
        for ifname in rule.source_interfaces:
            if ifname not in known:
                raise InvalidRule(name, f"source_interfaces: no interface {ifname!r} on this host")

    families = {family_of(n) for n in destinations}
    for fam in families:
        # Sources and destinations are ANDed per family: a family with destinations but
        # no source CIDRs (when some are given) could never match, which is a config bug.
        if source_cidrs and not any(family_of(n) is fam for n in source_cidrs):
            raise InvalidRule(
                name, f"destinations include {fam} but source_cidrs has no {fam} entry, "
                "so no such packet could match",
            )
        if model.proxy_ports.port_for(rule.protocol, fam) is None:
            raise InvalidRule(
                name, f"no proxy port for {rule.protocol}/{fam} (set proxy_ports)"
            )
    if rule.protocol is Protocol.UDP and model.mode is Mode.REDIRECT:
        # A redirected UDP datagram loses its original destination for an unconnected
        # socket (SO_ORIGINAL_DST works on connected TCP only); TPROXY keeps it.
        raise InvalidRule(name, "UDP interception needs mode tproxy")
    _check_exclusions_inside(name, exclude, destinations)
    return replace(
        rule, destinations=destinations, exclude=exclude, source_cidrs=source_cidrs,
        ports=ports, source_interfaces=tuple(sorted(set(rule.source_interfaces))),
    )


def _check_exclusions_inside(
    rule_name: str, exclude: Sequence[IPNetwork], destinations: Sequence[IPNetwork]
) -> None:
    """An exclusion that touches no destination is dead config, most likely a typo."""
    # Destinations are sorted and disjoint, so one bisect per exclusion finds the only
    # destination that could overlap it (the last one starting at or before its end).
    for version in (4, 6):
        dests = [d for d in destinations if d.version == version]
        starts = [int(d.network_address) for d in dests]
        for ex in (e for e in exclude if e.version == version):
            i = bisect.bisect_right(starts, int(ex.broadcast_address)) - 1
            if i < 0 or int(dests[i].broadcast_address) < int(ex.network_address):
                raise InvalidRule(rule_name, f"exclude: {ex} lies outside every destination")


def validate_model(
    model: InterceptModel, interfaces: Iterable[str] | None = None
) -> InterceptModel:
    """Check the whole model and return its normal form.

    `interfaces` is the host's link names (routing.list_interfaces()); None skips that
    check (rendering for golden tests, or a model for another host). Raises InvalidRule
    naming the offending rule, or "*" for the model's own settings.
    """
    known = list(interfaces) if interfaces is not None else None
    _check_mark("skip_mark", model.skip_mark)
    _check_mark("tproxy_mark", model.tproxy_mark)
    if model.skip_mark & model.tproxy_mark:
        raise InvalidRule("*", "skip_mark and tproxy_mark share bits")
    if not 0 < model.route_table < 2**32 or model.route_table in (253, 254, 255):
        raise InvalidRule("*", f"route_table {model.route_table} is reserved or out of range")
    for port_name in ("tcp4", "tcp6", "udp4", "udp6"):
        port = getattr(model.proxy_ports, port_name)
        if port is not None and not 1 <= port <= 65535:
            raise InvalidRule("*", f"proxy port {port_name}={port} is out of range")
    names: set[str] = set()
    rules: list[InterceptRule] = []
    for rule in model.rules:
        if rule.name in names:
            raise InvalidRule(rule.name, "another rule has the same name")
        names.add(rule.name)
        rules.append(validate_rule(rule, model, known))
    exclude = normalize_cidrs("*", "exclude", model.exclude)
    return replace(model, rules=tuple(rules), exclude=exclude)

