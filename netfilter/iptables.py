"""The iptables-legacy backend, for hosts whose other rules (kube-proxy's) are in legacy
iptables: the model rendered into our own `NODEAGENT-*` chains.

Ownership: we create and flush only chains named NODEAGENT-*, and touch exactly one rule
in each built-in chain we hook into (`-A PREROUTING -j NODEAGENT-PREROUTING`, the same for
OUTPUT). Everything goes through `iptables-legacy-restore --noflush` (and the ip6tables
twin), so the other rules of the table are never rewritten by us. Declaring a chain
(`:NODEAGENT-X - [0:0]`) in a --noflush restore flushes just that chain, which is how the
whole set of our chains is replaced in one restore, the way kube-proxy's iptables mode
does it. Legacy iptables commits each table as one blob replace, so each table's change is
atomic; the two families (and nat vs mangle) are separate commits.

Tables: REDIRECT mode uses `nat` (REDIRECT is NAT); TPROXY mode uses `mangle` (TPROXY and
MARK are mangle targets), with the same lo re-entry trick as the nftables backend for host
traffic. Our jump is appended, so in nat PREROUTING it runs after kube-proxy's
`KUBE-SERVICES` jump: a Service VIP that kube-proxy DNATs is kube-proxy's, as in the
nftables backend. One thing iptables cannot do: see the post-DNAT destination. Its only
prerouting tables are raw (-300), mangle (-150) and nat (-100); TPROXY works in mangle
only, which runs before kube-proxy's DNAT. So `tproxy_after_dnat` has no effect here; a
host that needs post-DNAT interception must use the nftables backend (our own table sits
happily next to legacy rules — it is a table we own, not a mix into theirs).

Lists: iptables has no sets, so without ipset each destination (and source, and
exclusion) is one rule, in a per-rule chain so that evaluation stays one pass: the rule
count grows linearly with the list sizes. When the `ipset` tool is present we put each
list in a `hash:net` set instead and the rule count is constant again; sets are swapped
in atomically (`create -new`, fill, `swap`, `destroy`) before the restore that uses them.
That is the trade-off: without ipset a 10,000-destination rule costs 10,000 iptables
rules (linear match per new connection, slower restores); with it, one.

No-op detection works like the nftables backend's: the first rule of our top chain is a
comment carrying the sha256 of the rendered script (and its ipset contents), read back
with iptables-save.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from netfilter._run import Runner
from netfilter.model import (
    Family,
    InterceptModel,
    InterceptRule,
    IPNetwork,
    Mode,
    Protocol,
    validate_model,
)

CHAIN_PREFIX = "NODEAGENT-"
SET_PREFIX = "nodeagent-"
FINGERPRINT_PREFIX = "nodeagent sha256:"
# multiport takes at most 15 ports, a range counting as two.
_MULTIPORT_MAX = 15
_TOOLS = {
    Family.IPV4: ("iptables-legacy-restore", "iptables-legacy-save"),
    Family.IPV6: ("ip6tables-legacy-restore", "ip6tables-legacy-save"),
}
_ANY = {Family.IPV4: "0.0.0.0", Family.IPV6: "::"}
_IPSET_FAMILY = {Family.IPV4: "inet", Family.IPV6: "inet6"}
_HOOKS = ("PREROUTING", "OUTPUT")


def _of(nets: Iterable[IPNetwork], family: Family) -> list[IPNetwork]:
    return [n for n in nets if (n.version == 4) == (family is Family.IPV4)]


def _ipset_members(nets: Sequence[IPNetwork]) -> list[str]:
    # hash:net refuses a /0; two halves say the same.
    out: list[str] = []
    for n in nets:
        out += [str(h) for h in n.subnets(1)] if n.prefixlen == 0 else [str(n)]
    return out


@dataclass(frozen=True)
class IpSet:
    name: str
    family: Family
    members: tuple[str, ...]


@dataclass
class FamilyPlan:
    """Our chains for one family, in the one table the mode uses."""

    family: Family
    table: str
    chains: dict[str, list[str]] = field(default_factory=dict)  # name -> rule specs
    jumps: list[str] = field(default_factory=list)  # built-in chains we hook
    sets: list[IpSet] = field(default_factory=list)
    fingerprint: str = ""

    def add(self, chain: str, spec: str) -> None:
        self.chains.setdefault(chain, []).append(spec)

    def body(self) -> str:
        lines = [f":{c} - [0:0]" for c in self.chains]
        for chain, specs in self.chains.items():
            lines += [f"-A {chain} {s}" for s in specs]
        return "\n".join(lines) + "\n"

    def script(self) -> str:
        """The restore input for a host without our chains (golden-tested)."""
        return f"*{self.table}\n{self.body()}COMMIT\n"


def _jump_spec(hook: str) -> str:
    return f"-A {hook} -j {CHAIN_PREFIX}{hook}"


@dataclass
class _Planner:
    model: InterceptModel
    family: Family
    use_ipset: bool

    def __post_init__(self) -> None:
        table = "mangle" if self.model.mode is Mode.TPROXY else "nat"
        self.plan = FamilyPlan(self.family, table)

    def sfx(self) -> str:
        return "4" if self.family is Family.IPV4 else "6"

    def port(self, rule: InterceptRule) -> int:
        port = self.model.proxy_ports.port_for(rule.protocol, self.family)
        assert port is not None  # validate_rule guarantees it
        return port

    def target(self, rule: InterceptRule, *, output: bool) -> str:
        m = self.model
        mark = f"{m.tproxy_mark:#x}/{m.tproxy_mark:#x}"
        if m.mode is Mode.REDIRECT:
            return f"REDIRECT --to-ports {self.port(rule)}"
        if output:
            # Marked host traffic is rerouted to lo and TPROXY'd in PREROUTING.
            return f"MARK --set-xmark {mark}"
        return (
            f"TPROXY --on-port {self.port(rule)} --on-ip {_ANY[self.family]} "
            f"--tproxy-mark {mark}"
        )

    def net_matches(
        self, chain: str, set_name: str, nets: Sequence[IPNetwork], flag: str, then: str
    ) -> None:
        """One rule per CIDR, or one ipset match; `flag` is -d or -s."""
        if self.use_ipset:
            direction = "dst" if flag == "-d" else "src"
            name = f"{SET_PREFIX}{set_name}"
            # PREROUTING and OUTPUT pipelines of one rule share its sets.
            if all(s.name != name for s in self.plan.sets):
                self.plan.sets.append(IpSet(name, self.family, tuple(_ipset_members(nets))))
            self.plan.add(chain, f"-m set --match-set {name} {direction} -j {then}")
        else:
            for n in nets:
                self.plan.add(chain, f"{flag} {n} -j {then}")

    def rule_chains(self, rule: InterceptRule, index: int, *, output: bool) -> str:
        """Build the per-rule pipeline; returns its entry chain."""
        tag = f"{CHAIN_PREFIX}{'H' if output else 'R'}{index}"
        sets_tag = f"r{index}"
        stages: list[str] = []
        if not output and rule.source_interfaces:
            stages.append("IIF")
        if not output and rule.source_cidrs:
            stages.append("SRC")
        stages += ["DST", "ACT"]
        names = [f"{tag}-{s}" for s in stages]
        proto = rule.protocol.value
        for stage, chain, nxt in zip(stages, names, [*names[1:], ""], strict=True):
            if stage == "IIF":
                for ifname in rule.source_interfaces:
                    self.plan.add(chain, f"-i {ifname} -j {nxt}")
            elif stage == "SRC":
                src = _of(rule.source_cidrs, self.family)
                self.net_matches(chain, f"{sets_tag}-src{self.sfx()}", src, "-s", nxt)
            elif stage == "DST":
                ex = _of(rule.exclude, self.family)
                if ex:
                    self.net_matches(chain, f"{sets_tag}-ex{self.sfx()}", ex, "-d", "RETURN")
                dst = rule.destinations_of(self.family)
                self.net_matches(chain, f"{sets_tag}-dst{self.sfx()}", dst, "-d", nxt)
            else:
                target = self.target(rule, output=output)
                if not rule.ports:
                    self.plan.add(chain, f"-p {proto} -j {target}")
                for group in _port_groups(rule):
                    self.plan.add(
                        chain, f"-p {proto} -m multiport --dports {group} -j {target}"
                    )
        return names[0]

    def head(self, chain: str) -> None:
        m = self.model
        self.plan.add(chain, f"-m mark --mark {m.skip_mark:#x}/{m.skip_mark:#x} -j RETURN")

    def exclusions(self, chain: str) -> None:
        ex = _of(self.model.exclude, self.family)
        if ex:
            self.net_matches(chain, f"exclude{self.sfx()}", ex, "-d", "RETURN")

    def build(self) -> FamilyPlan:
        m, fam = self.model, self.family
        rules = [(i, r) for i, r in enumerate(m.rules) if fam in r.families()]
        host = [(i, r) for i, r in rules if r.host_traffic]
        pre = f"{CHAIN_PREFIX}PREROUTING"
        self.plan.chains[pre] = []
        self.plan.jumps.append("PREROUTING")
        self.head(pre)
        if m.mode is Mode.TPROXY:
            mark = f"{m.tproxy_mark:#x}/{m.tproxy_mark:#x}"
            for proto in sorted({r.protocol for _, r in host}):
                port = m.proxy_ports.port_for(Protocol(proto), fam)
                self.plan.add(pre, (
                    f"-i lo -p {proto} -m mark --mark {mark} -j TPROXY --on-port {port} "
                    f"--on-ip {_ANY[fam]} --tproxy-mark {mark}"
                ))
        self.exclusions(pre)
        for i, r in rules:
            entry = self.rule_chains(r, i, output=False)
            self.plan.add(pre, f'-p {r.protocol} -m comment --comment "rule {r.name}" -j {entry}')
        if host:
            out = f"{CHAIN_PREFIX}OUTPUT"
            self.plan.chains[out] = []
            self.plan.jumps.append("OUTPUT")
            self.head(out)
            self.exclusions(out)
            for i, r in host:
                entry = self.rule_chains(r, i, output=True)
                self.plan.add(
                    out, f'-p {r.protocol} -m comment --comment "host rule {r.name}" -j {entry}'
                )
        # The fingerprint covers the chains and the set contents they refer to.
        digest = hashlib.sha256(self.plan.body().encode())
        for s in self.plan.sets:
            digest.update(f"{s.name} {' '.join(s.members)}\n".encode())
        self.plan.fingerprint = FINGERPRINT_PREFIX + digest.hexdigest()
        self.plan.chains[pre].insert(0, f'-m comment --comment "{self.plan.fingerprint}"')
        return self.plan


def _port_groups(rule: InterceptRule) -> list[str]:
    groups: list[list[str]] = [[]]
    used = 0
    for p in rule.ports:
        cost = 1 if p.first == p.last else 2
        if used + cost > _MULTIPORT_MAX:
            groups.append([])
            used = 0
        groups[-1].append(str(p.first) if p.first == p.last else f"{p.first}:{p.last}")
        used += cost
    return [",".join(g) for g in groups if g]


def plan_iptables(model: InterceptModel, *, use_ipset: bool = False) -> dict[Family, FamilyPlan]:
    normal = validate_model(model)
    return {f: _Planner(normal, f, use_ipset).build() for f in Family}


def render_iptables(model: InterceptModel, *, use_ipset: bool = False) -> dict[Family, str]:
    """Per family, the restore input that installs our chains on a host without them.

    (apply() adds to it what the host's current state needs: the jump rules if missing,
    and the removal of chains a previous model had.)
    """
    return {f: p.script() for f, p in plan_iptables(model, use_ipset=use_ipset).items()}


def render_ipsets(model: InterceptModel) -> str:
    """The `ipset restore` input that swaps in every set the ipset flavour uses."""
    return _ipset_script(
        [s for p in plan_iptables(model, use_ipset=True).values() for s in p.sets]
    )


def _ipset_script(sets: Sequence[IpSet]) -> str:
    lines: list[str] = []
    for s in sets:
        opts = f"hash:net family {_IPSET_FAMILY[s.family]} maxelem {max(65536, len(s.members))}"
        tmp = f"{s.name}-new"
        lines += [f"create {s.name} {opts} -exist", f"create {tmp} {opts} -exist",
                  f"flush {tmp}"]
        lines += [f"add {tmp} {m}" for m in s.members]
        lines += [f"swap {tmp} {s.name}", f"destroy {tmp}"]
    return "\n".join(lines) + "\n" if lines else ""


# -- the host's current state --------------------------------------------------------


@dataclass
class _TableState:
    chains: dict[str, list[str]] = field(default_factory=dict)  # ours only
    jumps: set[str] = field(default_factory=set)  # built-in chains with our jump

    def fingerprint(self) -> str | None:
        for spec in self.chains.get(f"{CHAIN_PREFIX}PREROUTING", []):
            if FINGERPRINT_PREFIX in spec:
                return spec.split('"')[1]
        return None


def _parse_save(text: str) -> dict[str, _TableState]:
    tables: dict[str, _TableState] = {}
    current: _TableState | None = None
    for line in text.splitlines():
        if line.startswith("*"):
            current = tables.setdefault(line[1:], _TableState())
        elif current is None:
            continue
        elif line.startswith(f":{CHAIN_PREFIX}"):
            current.chains.setdefault(line[1:].split()[0], [])
        elif line.startswith("-A "):
            chain, _, spec = line[3:].partition(" ")
            if chain.startswith(CHAIN_PREFIX):
                current.chains.setdefault(chain, []).append(spec)
            elif chain in _HOOKS and line == _jump_spec(chain):
                current.jumps.add(chain)
    return tables


class IptablesBackend:
    """Applies models as NODEAGENT-* chains with iptables-legacy (and ipset if present)."""

    def __init__(self, netns: str | None = None, *, use_ipset: bool | None = None) -> None:
        self.runner = Runner(netns)
        self.use_ipset = ipset_available(self.runner) if use_ipset is None else use_ipset
        # As in NftablesBackend: an unchanged model is not validated and rendered again.
        self._last: tuple[InterceptModel, dict[Family, FamilyPlan]] | None = None

    def plan(self, model: InterceptModel) -> dict[Family, FamilyPlan]:
        if self._last is not None and (self._last[0] is model or self._last[0] == model):
            return self._last[1]
        plans = plan_iptables(model, use_ipset=self.use_ipset)
        self._last = (model, plans)
        return plans

    def _state(self, family: Family) -> dict[str, _TableState]:
        save = _TOOLS[family][1]
        out: dict[str, _TableState] = {}
        for table in ("nat", "mangle"):
            text = self.runner.run([save, "-t", table]).stdout
            out[table] = _parse_save(text).get(table, _TableState())
        return out

    def _restore(self, family: Family, script: str) -> None:
        self.runner.run([_TOOLS[family][0], "--noflush"], input=script)

    @staticmethod
    def _teardown(table: str, state: _TableState, keep: Iterable[str] = ()) -> list[str]:
        """Restore lines removing our chains (and jumps) in `table`, except `keep`."""
        kept = set(keep)
        stale = [c for c in state.chains if c not in kept]
        lines = [f":{c} - [0:0]" for c in stale]  # flush, so nothing references others
        lines += [
            f"-D {hook} -j {CHAIN_PREFIX}{hook}" for hook in sorted(state.jumps)
            if f"{CHAIN_PREFIX}{hook}" not in kept
        ]
        lines += [f"-X {c}" for c in stale]
        return lines

    def _family_script(self, plan: FamilyPlan, state: dict[str, _TableState]) -> str | None:
        cur = state[plan.table]
        other = "nat" if plan.table == "mangle" else "mangle"
        up_to_date = (
            cur.fingerprint() == plan.fingerprint
            and set(cur.chains) == set(plan.chains)
            and cur.jumps == set(plan.jumps)
            and not state[other].chains
            and not state[other].jumps
        )
        if up_to_date:
            return None
        lines = [f"*{plan.table}", *plan.body().splitlines()]
        lines += [_jump_spec(h) for h in plan.jumps if h not in cur.jumps]
        lines += self._teardown(plan.table, cur, keep=plan.chains)
        lines.append("COMMIT")
        if state[other].chains or state[other].jumps:
            lines += [f"*{other}", *self._teardown(other, state[other]), "COMMIT"]
        return "\n".join(lines) + "\n"

    def apply(self, model: InterceptModel) -> bool:
        """Make our chains equal `model`; True if anything was changed.

        Raises InvalidRule before touching the host if the model is invalid, and
        CommandFailed if a restore was refused (that table then stays as it was).
        """
        plans = self.plan(model)
        scripts = {f: self._family_script(p, self._state(f)) for f, p in plans.items()}
        if all(s is None for s in scripts.values()):
            return False
        sets = [s for p in plans.values() for s in p.sets]
        if sets:
            self.runner.run(["ipset", "restore"], input=_ipset_script(sets))
        for family, script in scripts.items():
            if script is not None:
                self._restore(family, script)
        self._destroy_sets(keep={s.name for s in sets})
        return True

    def remove(self) -> bool:
        """Remove our chains, jumps and sets; True if there were any."""
        changed = False
        for family in Family:
            state = self._state(family)
            lines: list[str] = []
            for table, tstate in state.items():
                if tstate.chains or tstate.jumps:
                    lines += [f"*{table}", *self._teardown(table, tstate), "COMMIT"]
            if lines:
                self._restore(family, "\n".join(lines) + "\n")
                changed = True
        return self._destroy_sets(keep=set()) or changed

    def _destroy_sets(self, keep: set[str]) -> bool:
        if not self.use_ipset:
            return False
        names = self.runner.run(["ipset", "list", "-n"]).stdout.split()
        stale = [n for n in names if n.startswith(SET_PREFIX) and n not in keep]
        for name in stale:
            self.runner.run(["ipset", "destroy", name])
        return bool(stale)

    def list_applied(self) -> str:
        """Our chains and jumps as iptables-save shows them now; "" when there are none."""
        out: list[str] = []
        for family in Family:
            save = _TOOLS[family][1]
            for table in ("nat", "mangle"):
                text = self.runner.run([save, "-t", table]).stdout
                ours = [
                    line for line in text.splitlines()
                    if CHAIN_PREFIX in line and not line.startswith("#")
                ]
                if ours:
                    out += [f"# {family} {table}", *ours]
        return "\n".join(out) + "\n" if out else ""

    def verify(self, model: InterceptModel) -> list[str]:
        """What differs between the host's chains and `model`; empty if nothing does."""
        problems: list[str] = []
        for family, plan in self.plan(model).items():
            state = self._state(family)
            cur = state[plan.table]
            if cur.fingerprint() != plan.fingerprint:
                problems.append(f"{family}: fingerprint differs")
            for chain, specs in plan.chains.items():
                got = cur.chains.get(chain)
                if got is None:
                    problems.append(f"{family}: missing chain {chain}")
                elif len(got) != len(specs):
                    problems.append(
                        f"{family}: chain {chain} has {len(got)} rules, not {len(specs)}"
                    )
            for chain in sorted(set(cur.chains) - set(plan.chains)):
                problems.append(f"{family}: unexpected chain {chain}")
            if cur.jumps != set(plan.jumps):
                problems.append(f"{family}: jumps {sorted(cur.jumps)} != {plan.jumps}")
            other = "nat" if plan.table == "mangle" else "mangle"
            if state[other].chains or state[other].jumps:
                problems.append(f"{family}: stale chains in {other}")
        return problems

    def reconcile(self, model: InterceptModel | None) -> bool:
        """At start: remove whatever is left (model None), or rebuild unless it is exact."""
        if model is None:
            return self.remove()
        if not self.verify(model):
            return False
        plans = self.plan(model)
        sets = [s for p in plans.values() for s in p.sets]
        if sets:
            self.runner.run(["ipset", "restore"], input=_ipset_script(sets))
        for family, plan in plans.items():
            state = self._state(family)
            # Force the rewrite: every chain of ours is re-declared (flushed) and refilled.
            state[plan.table].chains.setdefault(f"{CHAIN_PREFIX}PREROUTING", [])
            script = self._family_script(
                FamilyPlan(plan.family, plan.table, plan.chains, plan.jumps, plan.sets, ""),
                state,
            )
            assert script is not None
            self._restore(family, script)
        self._destroy_sets(keep={s.name for s in sets})
        return True


def ipset_available(runner: Runner | None = None) -> bool:
    """Whether the ipset tool is installed and the kernel answers it."""
    if shutil.which("ipset") is None:
        return False
    proc = (runner or Runner()).run(["ipset", "list", "-n"], check=False)
    return proc.returncode == 0
