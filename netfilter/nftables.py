"""The nftables backend: the model rendered into one owned table, `inet nodeagent`.

Everything we program lives in that table and nowhere else, and every change is one
`nft -f -` transaction that deletes and recreates the whole table, the way kube-proxy's
nftables mode does (`add table` first so the `delete` cannot fail on a fresh host). A
transaction is all-or-nothing in the kernel: a script the kernel refuses leaves the
previous table untouched, and packets never see a half-built table.

Hooks and priorities (alongside kube-proxy)
-------------------------------------------
kube-proxy DNATs Service VIPs in nat chains at priority dstnat (-100) in prerouting and
output: in its iptables mode through the iptables `nat` table, in its nftables mode
through its own `ip kube-proxy`/`ip6 kube-proxy` tables. We must see such a connection on
its post-DNAT destination (the endpoint pod IP), because that is what decides whether it
goes to a remote site. Two kernel facts shape the choice:

1. All nat-type chains of one hook (iptables' nat table and every nft nat chain) are run
   by a single NAT lookup at -100, in priority order, and the lookup stops at the first
   chain that sets up a binding (nf_nat_inet_fn). Once kube-proxy has DNAT'ed a
   connection, no later nat chain — ours at dstnat+10 included — is ever consulted for
   it, and SO_ORIGINAL_DST would report the pre-DNAT VIP anyway. A REDIRECT therefore
   can never take over a connection that kube-proxy has already DNAT'ed.
2. A filter-type chain at a priority after -100 sees every packet with the DNAT already
   applied, and TPROXY is not NAT: it hands the packet, unchanged, to a local
   IP_TRANSPARENT socket (whose local address is then the post-DNAT destination) and
   policy routing delivers it locally. Replies are un-DNAT'ed by conntrack as usual, so
   the client still sees the VIP.

So every chain of ours sits at priority dstnat+10 (-90):
- TPROXY mode: a filter chain in prerouting TPROXYs matching packets; a route chain in
  output marks host traffic, which policy routing loops through `lo` back into
  prerouting, where the lo rule TPROXYs it. Both run after kube-proxy's DNAT.
- REDIRECT mode: nat chains in prerouting and output at dstnat+10 redirect what
  kube-proxy did not DNAT (ordering after kube-proxy means we never steal a Service VIP
  from it); and, unless `tproxy_after_dnat` is off, the same filter/route chains as
  TPROXY mode take the connections that were DNAT'ed (`ct status dnat`).
Every chain is written with the literal -90 because nft 1.0.6 accepts the `dstnat`
keyword only in prerouting (it prints prerouting chains back as `dstnat + 10`).

No-op detection
---------------
The table carries a comment with the sha256 of the rendered script, written in the same
transaction as the rules, so the comment can only describe the rules it was created
with. `apply()` reads that comment over netlink (one GETTABLE, about a millisecond even
with 10,000 set elements, where `nft -j list table` takes ~80 ms) and skips the
transaction when it matches. Comparing a rendered text with what `nft list` prints back
would be fragile: nft rewrites rules (drops implied `meta l4proto`, merges intervals,
prints prefixes as ranges) differently across versions. A manual edit inside our table
leaves the comment as it was, so `verify()` compares the kernel's JSON with the plan on the
things nft does not rewrite — chains, hooks, priorities, the ordered rule comments and the
set contents as integer intervals — and `reconcile()` (at start) re-applies on any
difference.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from netfilter._run import Runner
from netfilter.model import (
    Family,
    InterceptModel,
    InterceptRule,
    IPNetwork,
    Mode,
    PortRange,
    Protocol,
    _span,
    validate_model,
)

TABLE_FAMILY = "inet"
TABLE_NAME = "nodeagent"
# dstnat (-100) + 10: after kube-proxy's DNAT, see the module docstring.
PRIORITY = -90
FINGERPRINT_PREFIX = "nodeagent sha256:"

_NFPROTO_INET = 1


@dataclass(frozen=True)
class NftSet:
    name: str
    type: str  # ipv4_addr | ipv6_addr | inet_service | ifname
    elements: tuple[str, ...]
    # What verify() compares, as (first, last) integers: nft prints elements back in its
    # own notation. Kept as the source objects and only computed when verifying.
    spans: tuple[IPNetwork, ...] | tuple[PortRange, ...] = ()

    def intervals(self) -> tuple[tuple[int, int], ...]:
        return _merge(
            (p.first, p.last) if isinstance(p, PortRange) else _span(p) for p in self.spans
        )

    @property
    def interval(self) -> bool:
        return self.type != "ifname"

    def render(self) -> list[str]:
        lines = [f"\tset {self.name} {{", f"\t\ttype {self.type}"]
        if self.interval:
            # Elements are pre-normalised (sorted, disjoint, merged), so auto-merge has
            # nothing to do on a full apply; it is there so that an incremental
            # `add element` can never fail on an element touching an existing one.
            lines += ["\t\tflags interval", "\t\tauto-merge"]
        if self.elements:
            lines.append(f"\t\telements = {{ {', '.join(self.elements)} }}")
        lines.append("\t}")
        return lines


@dataclass(frozen=True)
class NftRule:
    text: str
    comment: str

    def render(self) -> str:
        return f'\t\t{self.text} comment "{self.comment}"'


@dataclass(frozen=True)
class NftChain:
    name: str
    type: str  # filter | nat | route
    hook: str  # prerouting | output
    rules: tuple[NftRule, ...]
    priority: int = PRIORITY

    def render(self) -> list[str]:
        return [
            f"\tchain {self.name} {{",
            f"\t\ttype {self.type} hook {self.hook} priority {self.priority}; policy accept;",
            *(r.render() for r in self.rules),
            "\t}",
        ]


@dataclass(frozen=True)
class NftPlan:
    """The table we want, as data: rendered to a script, and compared with the kernel."""

    sets: tuple[NftSet, ...]
    chains: tuple[NftChain, ...]
    body: str = field(init=False)
    fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        lines: list[str] = []
        for s in self.sets:
            lines += s.render()
        for c in self.chains:
            lines += c.render()
        body = "\n".join(lines) + "\n"
        object.__setattr__(self, "body", body)
        digest = hashlib.sha256(body.encode()).hexdigest()
        object.__setattr__(self, "fingerprint", FINGERPRINT_PREFIX + digest)

    def script(self) -> str:
        return (
            f"table {TABLE_FAMILY} {TABLE_NAME} {{}}\n"
            f"delete table {TABLE_FAMILY} {TABLE_NAME}\n"
            f"table {TABLE_FAMILY} {TABLE_NAME} {{\n"
            f'\tcomment "{self.fingerprint}"\n'
            f"{self.body}"
            "}\n"
        )


# -- planning ------------------------------------------------------------------------

_ADDR_TYPE = {Family.IPV4: "ipv4_addr", Family.IPV6: "ipv6_addr"}
_L3 = {Family.IPV4: "ip", Family.IPV6: "ip6"}
_SUFFIX = {Family.IPV4: "4", Family.IPV6: "6"}


def _merge(intervals: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


_AF = {Family.IPV4: socket.AF_INET, Family.IPV6: socket.AF_INET6}


def _addr_set(name: str, family: Family, nets: Sequence[IPNetwork]) -> NftSet:
    # str(net) is three times slower than inet_ntop on the packed address, and a fresh
    # apply formats every element of 10,000-entry lists.
    ntop, af = socket.inet_ntop, _AF[family]
    text = tuple(f"{ntop(af, n.network_address.packed)}/{n.prefixlen}" for n in nets)
    return NftSet(name, _ADDR_TYPE[family], text, tuple(nets))


def _mark_test(mark: int) -> str:
    # A bit test, not equality: other components (kube-proxy's masquerade bit, CNIs)
    # may have OR'ed their own bits into the mark before our chain runs.
    return f"meta mark & {mark:#010x} == {mark:#010x}"


@dataclass
class _Planner:
    model: InterceptModel
    sets: list[NftSet] = field(default_factory=list)

    def rule_sets(self, rule: InterceptRule) -> None:
        n = rule.name
        for fam in rule.families():
            sfx = _SUFFIX[fam]
            self.sets.append(_addr_set(f"{n}-dst{sfx}", fam, rule.destinations_of(fam)))
            ex = [e for e in rule.exclude if (e.version == 4) == (fam is Family.IPV4)]
            if ex:
                self.sets.append(_addr_set(f"{n}-exclude{sfx}", fam, ex))
            src = [s for s in rule.source_cidrs if (s.version == 4) == (fam is Family.IPV4)]
            if src:
                self.sets.append(_addr_set(f"{n}-src{sfx}", fam, src))
        if rule.ports:
            self.sets.append(
                NftSet(
                    f"{n}-ports", "inet_service", tuple(str(p) for p in rule.ports), rule.ports
                )
            )
        if rule.source_interfaces:
            self.sets.append(
                NftSet(
                    f"{n}-iifs", "ifname",
                    tuple(f'"{i}"' for i in rule.source_interfaces),
                )
            )

    def match(self, rule: InterceptRule, fam: Family, *, sources: bool) -> str:
        """The match part of one rule for one family; `sources` is False in output."""
        n, l3, sfx = rule.name, _L3[fam], _SUFFIX[fam]
        parts: list[str] = []
        if sources and rule.source_interfaces:
            parts.append(f"iifname @{n}-iifs")
        if sources and rule.source_cidrs:
            parts.append(f"{l3} saddr @{n}-src{sfx}")
        if any((e.version == 4) == (fam is Family.IPV4) for e in rule.exclude):
            parts.append(f"{l3} daddr != @{n}-exclude{sfx}")
        parts.append(f"{l3} daddr @{n}-dst{sfx}")
        if rule.ports:
            parts.append(f"{rule.protocol} dport @{n}-ports")
        else:
            parts.append(f"meta l4proto {rule.protocol}")
        return " ".join(parts)

    def port(self, rule: InterceptRule, fam: Family) -> int:
        port = self.model.proxy_ports.port_for(rule.protocol, fam)
        assert port is not None  # validate_rule guarantees it
        return port

    def head(self) -> list[NftRule]:
        return [
            NftRule(f"{_mark_test(self.model.skip_mark)} return", "skip agent sockets"),
            NftRule("ip daddr @exclude4 return", "exclude ipv4"),
            NftRule("ip6 daddr @exclude6 return", "exclude ipv6"),
        ]

    def plan(self) -> NftPlan:
        m = self.model
        ex4 = [e for e in m.exclude if e.version == 4]
        ex6 = [e for e in m.exclude if e.version == 6]
        self.sets += [_addr_set("exclude4", Family.IPV4, ex4),
                      _addr_set("exclude6", Family.IPV6, ex6)]
        for rule in m.rules:
            self.rule_sets(rule)
        host_rules = [r for r in m.rules if r.host_traffic]
        chains: list[NftChain] = []
        tmark = m.tproxy_mark
        set_tmark = f"meta mark set meta mark | {tmark:#010x}"

        if m.mode is Mode.REDIRECT:
            chains.append(NftChain("nat-prerouting", "nat", "prerouting", tuple(
                self.head() + [
                    NftRule(
                        f"{self.match(r, f, sources=True)} counter "
                        f"redirect to :{self.port(r, f)}",
                        f"rule {r.name} {f}",
                    )
                    for r in m.rules for f in r.families()
                ]
            )))
            if host_rules:
                chains.append(NftChain("nat-output", "nat", "output", tuple(
                    self.head() + [
                        NftRule(
                            f"{self.match(r, f, sources=False)} counter "
                            f"redirect to :{self.port(r, f)}",
                            f"host rule {r.name} {f}",
                        )
                        for r in host_rules for f in r.families()
                    ]
                )))

        tproxy_lane = m.mode is Mode.TPROXY or m.tproxy_after_dnat
        if tproxy_lane and m.rules:
            # In REDIRECT mode this lane only takes what kube-proxy (or anything else)
            # DNAT'ed, which the nat chain above can never see.
            ct = "ct status dnat " if m.mode is Mode.REDIRECT else ""
            pre: list[NftRule] = [self.head()[0]]
            # Host traffic marked in the output chain below comes back in on lo (policy
            # routing); it was already matched there, so TPROXY it straight away.
            for proto, fam in sorted({(r.protocol, f) for r in host_rules
                                      for f in r.families()}):
                port = m.proxy_ports.port_for(Protocol(proto), fam)
                pre.append(NftRule(
                    f'iifname "lo" {_mark_test(tmark)} meta nfproto {fam} '
                    f"meta l4proto {proto} tproxy {_L3[fam]} to :{port} accept",
                    f"host {proto} {fam} via lo",
                ))
            pre += self.head()[1:]
            pre += [
                NftRule(
                    f"{ct}{self.match(r, f, sources=True)} counter "
                    f"tproxy {_L3[f]} to :{self.port(r, f)} {set_tmark} accept",
                    f"rule {r.name} {f}",
                )
                for r in m.rules for f in r.families()
            ]
            chains.append(NftChain("mangle-prerouting", "filter", "prerouting", tuple(pre)))
            if host_rules:
                chains.append(NftChain("mangle-output", "route", "output", tuple(
                    self.head() + [
                        NftRule(
                            f"{ct}{self.match(r, f, sources=False)} counter {set_tmark}",
                            f"host rule {r.name} {f}",
                        )
                        for r in host_rules for f in r.families()
                    ]
                )))
        return NftPlan(tuple(self.sets), tuple(chains))


def plan_nftables(model: InterceptModel) -> NftPlan:
    """Validate and normalise `model` (without the interface check), then plan the table."""
    return _Planner(validate_model(model)).plan()


def render_nftables(model: InterceptModel) -> str:
    """The complete `nft -f -` script that replaces our table with `model`."""
    return plan_nftables(model).script()


def removal_script() -> str:
    return (
        f"table {TABLE_FAMILY} {TABLE_NAME} {{}}\n"
        f"delete table {TABLE_FAMILY} {TABLE_NAME}\n"
    )


# -- reading back --------------------------------------------------------------------


def _elem_interval(set_type: str, elem: Any) -> tuple[int, int] | str:
    if set_type == "ifname":
        return str(elem)
    if set_type == "inet_service":
        if isinstance(elem, dict) and "range" in elem:
            return (int(elem["range"][0]), int(elem["range"][1]))
        return (int(elem), int(elem))
    # inet_pton rather than ipaddress: a verify parses every element of 10,000-entry sets.
    af, bits = (socket.AF_INET, 32) if set_type == "ipv4_addr" else (socket.AF_INET6, 128)
    if isinstance(elem, dict) and "prefix" in elem:
        start = int.from_bytes(socket.inet_pton(af, elem["prefix"]["addr"]))
        return (start, start + (1 << (bits - int(elem["prefix"]["len"]))) - 1)
    if isinstance(elem, dict) and "range" in elem:
        lo, hi = elem["range"]
        return (int.from_bytes(socket.inet_pton(af, lo)), int.from_bytes(socket.inet_pton(af, hi)))
    addr = int.from_bytes(socket.inet_pton(af, elem))
    return (addr, addr)


def diff_plan(plan: NftPlan, listing: dict[str, Any]) -> list[str]:
    """Differences between a plan and `nft -j list table` output; empty when they agree."""
    chains: dict[str, dict[str, Any]] = {}
    rules: dict[str, list[str]] = {}
    sets: dict[str, dict[str, Any]] = {}
    for obj in listing.get("nftables", []):
        if "chain" in obj:
            chains[obj["chain"]["name"]] = obj["chain"]
        elif "rule" in obj:
            rules.setdefault(obj["rule"]["chain"], []).append(obj["rule"].get("comment", ""))
        elif "set" in obj:
            sets[obj["set"]["name"]] = obj["set"]
    problems: list[str] = []
    want_chains = {c.name: c for c in plan.chains}
    for name in sorted(set(chains) - set(want_chains)):
        problems.append(f"unexpected chain {name}")
    for name, chain in want_chains.items():
        got = chains.get(name)
        if got is None:
            problems.append(f"missing chain {name}")
            continue
        head = (got.get("type"), got.get("hook"), got.get("prio"), got.get("policy"))
        if head != (chain.type, chain.hook, chain.priority, "accept"):
            problems.append(f"chain {name} is {head}")
        want_rules = [r.comment for r in chain.rules]
        if rules.get(name, []) != want_rules:
            problems.append(f"chain {name} rules {rules.get(name, [])} != {want_rules}")
    want_sets = {s.name: s for s in plan.sets}
    for name in sorted(set(sets) - set(want_sets)):
        problems.append(f"unexpected set {name}")
    for name, want in want_sets.items():
        got_set = sets.get(name)
        if got_set is None:
            problems.append(f"missing set {name}")
            continue
        if got_set.get("type") != want.type:
            problems.append(f"set {name} has type {got_set.get('type')}")
            continue
        elems = [_elem_interval(want.type, e) for e in got_set.get("elem", [])]
        if want.type == "ifname":
            same = sorted(map(str, elems)) == sorted(e.strip('"') for e in want.elements)
        else:
            same = _merge(e for e in elems if isinstance(e, tuple)) == want.intervals()
        if not same:
            problems.append(f"set {name} elements differ ({len(elems)} in kernel)")
    return problems


# -- the backend ---------------------------------------------------------------------


class NftablesBackend:
    """Applies models to the kernel's `inet nodeagent` table (of one netns).

    Calls block (subprocess and netlink); the agent runs them in a worker thread.
    """

    def __init__(self, netns: str | None = None, *, nft: str = "nft") -> None:
        self.runner = Runner(netns)
        self.nft = nft
        self._sock: Any = None
        # The last model planned: re-applying it (the same object, or an equal one parsed
        # afresh from unchanged config) skips validating and rendering a large model. An
        # equality check of 10,000 networks costs ~8 ms; planning them ~35 ms.
        self._last: tuple[InterceptModel, NftPlan] | None = None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def plan(self, model: InterceptModel) -> NftPlan:
        if self._last is not None and (self._last[0] is model or self._last[0] == model):
            return self._last[1]
        plan = plan_nftables(model)
        self._last = (model, plan)
        return plan

    # netlink reads ------------------------------------------------------------------

    def _netlink(self) -> Any:
        if self._sock is None:
            from pyroute2.netlink.nfnetlink.nftsocket import NFTSocket

            with self.runner.namespace():
                self._sock = NFTSocket(nfgen_family=_NFPROTO_INET)
        return self._sock

    def applied_fingerprint(self) -> str | None:
        """The fingerprint comment of our table in the kernel; None if there is no table."""
        from pyroute2.netlink import NLM_F_REQUEST
        from pyroute2.netlink.exceptions import NetlinkError
        from pyroute2.netlink.nfnetlink.nftsocket import NFT_MSG_GETTABLE, nft_table_msg

        msg = nft_table_msg()
        msg["attrs"] = [("NFTA_TABLE_NAME", TABLE_NAME)]
        try:
            reply = self._netlink().request_get(msg, NFT_MSG_GETTABLE, NLM_F_REQUEST)
        except NetlinkError as e:
            if e.code == 2:  # ENOENT: no such table
                return None
            raise
        comment = reply[0].get_attr("NFTA_TABLE_USERDATA")
        return str(comment) if comment is not None else ""

    def generation(self) -> int:
        """The kernel's ruleset generation; every committed nft transaction bumps it."""
        from pyroute2.netlink import NLM_F_REQUEST
        from pyroute2.netlink.nfnetlink.nftsocket import NFT_MSG_GETGEN, nft_gen_msg

        reply = self._netlink().request_get(nft_gen_msg(), NFT_MSG_GETGEN, NLM_F_REQUEST)
        return int(reply[0].get_attr("NFTA_GEN_ID"))

    # applying -----------------------------------------------------------------------

    def apply(self, model: InterceptModel) -> bool:
        """Make the kernel's table equal `model`; True if a transaction ran.

        Raises InvalidRule before touching the kernel if the model is invalid, and
        CommandFailed if nft refused the script (the previous table then stays as it was).
        """
        plan = self.plan(model)
        if self.applied_fingerprint() == plan.fingerprint:
            return False
        self.runner.run([self.nft, "-f", "-"], input=plan.script())
        return True

    def remove(self) -> bool:
        """Delete our table (clean shutdown); True if there was one."""
        if self.applied_fingerprint() is None:
            return False
        self.runner.run([self.nft, "-f", "-"], input=removal_script())
        return True

    def list_applied(self) -> str:
        """Our table as the kernel has it now (`nft list`), or "" when there is none."""
        proc = self.runner.run(
            [self.nft, "list", "table", TABLE_FAMILY, TABLE_NAME], check=False
        )
        return proc.stdout if proc.returncode == 0 else ""

    def verify(self, model: InterceptModel) -> list[str]:
        """What differs between the kernel's table and `model`; empty if nothing does."""
        plan = self.plan(model)
        fingerprint = self.applied_fingerprint()
        if fingerprint is None:
            return ["no table"]
        problems = [] if fingerprint == plan.fingerprint else ["fingerprint differs"]
        proc = self.runner.run([self.nft, "-j", "list", "table", TABLE_FAMILY, TABLE_NAME])
        return problems + diff_plan(plan, json.loads(proc.stdout))

    def reconcile(self, model: InterceptModel | None) -> bool:
        """At start, after a crash: replace whatever table is left unless it is exactly
        `model` (checked in full, not just by fingerprint); with None, just remove it.

        One transaction drops the stale table and installs the new one, so there is no
        moment without rules. True if the kernel was changed.
        """
        if model is None:
            return self.remove()
        if not self.verify(model):
            return False
        self.runner.run([self.nft, "-f", "-"], input=self.plan(model).script())
        return True
