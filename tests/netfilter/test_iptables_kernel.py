"""The iptables-legacy backend against a real kernel, and real connections through it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from netfilter.iptables import IptablesBackend
from netfilter.model import Mode
from netfilter.routing import PolicyRouting
from tests.netfilter.lab import REMOTE4, REMOTE6, REMOTE_PORT, Lab
from tests.netfilter.models import lab_model
from tests.netfilter.test_render import GOLDEN

pytestmark = [pytest.mark.netns,
              pytest.mark.needs("nft", "iptables-legacy", "iptables-legacy-restore")]

FLAVOURS = [
    pytest.param(False, id="rules"),
    pytest.param(True, id="ipset", marks=pytest.mark.needs("ipset")),
]


def _save(lab: Lab, table: str, tool: str = "iptables-legacy-save", *args: str) -> str:
    """iptables-save output without its timestamped comment lines."""
    text = lab.sh("node", [tool, "-t", table, *args]).stdout
    return "".join(line for line in text.splitlines(True) if not line.startswith("#"))


@pytest.mark.parametrize("use_ipset", FLAVOURS)
def test_apply_read_back_noop_remove(lab: Lab, use_ipset: bool) -> None:
    ipt = IptablesBackend(lab.ns("node"), use_ipset=use_ipset)
    # Someone else's rules in the same tables: never touched.
    lab.sh("node", ["iptables-legacy", "-t", "nat", "-N", "KUBE-SERVICES"])
    lab.sh("node", ["iptables-legacy", "-t", "nat", "-A", "PREROUTING", "-j", "KUBE-SERVICES"])

    model = lab_model(host_traffic=True)
    assert ipt.apply(model) is True
    applied = ipt.list_applied()
    assert "-A PREROUTING -j NODEAGENT-PREROUTING" in applied
    assert "-A OUTPUT -j NODEAGENT-OUTPUT" in applied
    assert "REDIRECT --to-ports 15001" in applied and "REDIRECT --to-ports 15002" in applied
    assert ipt.verify(model) == []
    nat = _save(lab, "nat")
    # Our jump comes after kube-proxy's: Service VIPs stay kube-proxy's.
    assert nat.index("-j KUBE-SERVICES") < nat.index("-j NODEAGENT-PREROUTING")

    # No-op: nothing is restored the second time. Proof from the kernel: a restore
    # re-creates our rules with zeroed counters, and the counters survive.
    assert lab.connect("pod", REMOTE4[0]) == f"proxy {REMOTE4[0]} {REMOTE_PORT}"
    counted = _save(lab, "nat", "iptables-legacy-save", "-c")
    assert re.search(r"^\[1:\d+\] -A NODEAGENT-R0-ACT", counted, re.M)
    assert ipt.apply(model) is False
    assert ipt.apply(lab_model(host_traffic=True)) is False
    assert _save(lab, "nat", "iptables-legacy-save", "-c") == counted

    # Dropping host traffic removes the OUTPUT chain and its jump.
    assert ipt.apply(lab_model()) is True
    assert "NODEAGENT-OUTPUT" not in ipt.list_applied()
    assert ipt.verify(lab_model()) == []

    # Switching mode moves our chains from nat to mangle, leaving no trace in nat.
    assert ipt.apply(lab_model(Mode.TPROXY)) is True
    assert "NODEAGENT" not in _save(lab, "nat")
    assert "TPROXY --on-port 15001" in _save(lab, "mangle")
    assert ipt.verify(lab_model(Mode.TPROXY)) == []

    assert ipt.remove() is True
    assert ipt.list_applied() == ""
    for tool in ("iptables-legacy-save", "ip6tables-legacy-save"):
        for table in ("nat", "mangle"):
            assert "NODEAGENT" not in _save(lab, table, tool)
    assert "-A PREROUTING -j KUBE-SERVICES" in _save(lab, "nat")
    if use_ipset:
        assert "nodeagent-" not in lab.sh("node", ["ipset", "list", "-n"]).stdout
    assert ipt.remove() is False


def test_reconcile_after_crash(lab: Lab) -> None:
    ipt = IptablesBackend(lab.ns("node"), use_ipset=False)
    ipt.apply(lab_model(Mode.TPROXY, host_traffic=True))  # what the crashed agent left
    lab.sh("node", ["iptables-legacy", "-t", "mangle", "-F", "NODEAGENT-R0-ACT"])  # drift
    model = lab_model()
    assert ipt.verify(model) != []
    assert ipt.reconcile(model) is True
    assert ipt.verify(model) == []
    assert ipt.reconcile(model) is False
    # Drift that keeps the fingerprint is found by verify/reconcile, not by apply.
    lab.sh("node", ["iptables-legacy", "-t", "nat", "-F", "NODEAGENT-R0-ACT"])
    assert ipt.apply(model) is False
    assert ipt.verify(model) == ["ipv4: chain NODEAGENT-R0-ACT has 0 rules, not 1"]
    assert ipt.reconcile(model) is True
    assert ipt.verify(model) == []
    assert ipt.reconcile(None) is True
    assert ipt.list_applied() == ""


@pytest.mark.parametrize("use_ipset", FLAVOURS)
@pytest.mark.parametrize("mode", [Mode.REDIRECT, Mode.TPROXY])
def test_pod_traffic_is_intercepted(lab: Lab, use_ipset: bool, mode: Mode) -> None:
    ipt = IptablesBackend(lab.ns("node"), use_ipset=use_ipset)
    model = lab_model(mode, host_traffic=True)
    if mode is Mode.TPROXY:
        PolicyRouting(model.tproxy_mark, model.route_table, netns=lab.ns("node")).ensure()
    ipt.apply(model)
    assert lab.connect("pod", REMOTE4[0]) == f"proxy {REMOTE4[0]} {REMOTE_PORT}"
    assert lab.connect("pod", REMOTE6[0]) == f"proxy {REMOTE6[0]} {REMOTE_PORT}"
    assert lab.connect("pod", REMOTE4[1]) == f"direct {REMOTE4[1]} {REMOTE_PORT}"
    assert lab.connect("pod", REMOTE6[1]) == f"direct {REMOTE6[1]} {REMOTE_PORT}"
    assert lab.connect("node", REMOTE4[0]) == f"proxy {REMOTE4[0]} {REMOTE_PORT}"
    assert lab.connect("node", REMOTE4[0], mark=model.skip_mark) == (
        f"direct {REMOTE4[0]} {REMOTE_PORT}"
    )
    ipt.remove()
    assert lab.connect("pod", REMOTE4[0]) == f"direct {REMOTE4[0]} {REMOTE_PORT}"


@pytest.mark.parametrize("golden", [
    pytest.param(p, id=p.name, marks=[pytest.mark.needs("ipset")] if "-ipset-" in p.name else [])
    for p in sorted(GOLDEN.glob("iptables-*.rules"))])
def test_iptables_goldens_are_accepted_by_the_kernel(lab: Lab, golden: Path) -> None:
    if "-ipset-" in golden.name:
        mode = "tproxy" if "tproxy" in golden.name else "redirect"
        lab.sh("node", ["ipset", "restore"], input=(GOLDEN / f"ipset-{mode}.txt").read_text())
    tool = "iptables-legacy-restore" if golden.name.endswith("ipv4.rules") else (
        "ip6tables-legacy-restore")
    lab.sh("node", [tool, "--test", "--noflush"], input=golden.read_text())
