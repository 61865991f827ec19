"""Policy routing for TPROXY, and reading the host's links — over netlink, with pyroute2.

Why two tools: routes, rules and links are plain rtnetlink objects, and pyroute2's IPRoute
speaks rtnetlink directly — typed, no subprocess, no output parsing, and each call is
naturally idempotent to check (dump, compare, add). Packet-filter rules are another
matter: pyroute2's nftables module can update set elements but cannot express
`redirect`/`tproxy` rules without hand-building kernel expressions, and `nft -f -`
gives what matters more for rules, one atomic transaction for the whole table, the
proven path kube-proxy's nftables mode takes. So rules go through nftables.py /
iptables.py and routing stays here.

TPROXY only assigns a packet to a local socket; the routing decision still has to deliver
the packet locally. That is the classic pair:

    ip rule add fwmark MARK/MARK lookup TABLE
    ip route add local 0.0.0.0/0 dev lo table TABLE    (and ::/0 for IPv6)
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

# Rule preference: before `main` (32766) and after `local` (0); kept apart from the
# small numbers CNIs and VPNs tend to pick.
DEFAULT_RULE_PRIORITY = 1066
_RT_SCOPE_HOST = 254
_RTN_LOCAL = 2
_FAMILIES = (socket.AF_INET, socket.AF_INET6)
_DEFAULT_DST = {socket.AF_INET: "0.0.0.0/0", socket.AF_INET6: "::/0"}


def _iproute(netns: str | None) -> Any:
    from pyroute2 import IPRoute

    return IPRoute(netns=netns) if netns is not None else IPRoute()


@dataclass(frozen=True)
class PolicyRouting:
    """The fwmark rule and local table that deliver TPROXY'd packets to local sockets."""

    mark: int
    table: int
    priority: int = DEFAULT_RULE_PRIORITY
    netns: str | None = None

    def _rule_present(self, ipr: Any, family: int) -> bool:
        for rule in ipr.get_rules(family=family):
            if (
                rule.get_attr("FRA_FWMARK") == self.mark
                and rule.get_attr("FRA_FWMASK") == self.mark
                and (rule.get_attr("FRA_TABLE") or rule["table"]) == self.table
            ):
                return True
        return False

    def _route_present(self, ipr: Any, family: int) -> bool:
        for route in ipr.get_routes(family=family, table=self.table):
            if route["type"] == _RTN_LOCAL and route["dst_len"] == 0:
                return True
        return False

    def ensure(self) -> bool:
        """Install what is missing; True if anything was added. Safe to call repeatedly."""
        changed = False
        ipr = _iproute(self.netns)
        try:
            lo = ipr.link_lookup(ifname="lo")[0]
            for family in _FAMILIES:
                if not self._route_present(ipr, family):
                    ipr.route(
                        "replace", dst=_DEFAULT_DST[family], type="local", oif=lo,
                        table=self.table, scope=_RT_SCOPE_HOST, family=family,
                    )
                    changed = True
                if not self._rule_present(ipr, family):
                    ipr.rule(
                        "add", fwmark=self.mark, fwmask=self.mark, table=self.table,
                        priority=self.priority, family=family,
                    )
                    changed = True
        finally:
            ipr.close()
        return changed

    def remove(self) -> bool:
        """Remove our rule and route; True if anything was removed. Safe to repeat."""
        changed = False
        ipr = _iproute(self.netns)
        try:
            for family in _FAMILIES:
                while self._rule_present(ipr, family):
                    ipr.rule(
                        "del", fwmark=self.mark, fwmask=self.mark, table=self.table,
                        priority=self.priority, family=family,
                    )
                    changed = True
                if self._route_present(ipr, family):
                    ipr.route(
                        "del", dst=_DEFAULT_DST[family], type="local",
                        table=self.table, scope=_RT_SCOPE_HOST, family=family,
                    )
                    changed = True
        finally:
            ipr.close()
        return changed

    def present(self) -> bool:
        ipr = _iproute(self.netns)
        try:
            return all(
                self._rule_present(ipr, f) and self._route_present(ipr, f) for f in _FAMILIES
            )
        finally:
            ipr.close()


def list_interfaces(netns: str | None = None) -> list[str]:
    """Names of the host's links, for validate_model(interfaces=...)."""
    ipr = _iproute(netns)
    try:
        return sorted(str(link.get_attr("IFLA_IFNAME")) for link in ipr.get_links())
    finally:
        ipr.close()
