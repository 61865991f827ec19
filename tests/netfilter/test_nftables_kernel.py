"""The nftables backend against a real kernel, and real connections through its rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from netfilter.model import InterceptModel, InterceptRule, InvalidRule, Mode
from netfilter.nftables import NftablesBackend, render_nftables
from netfilter.routing import PolicyRouting
from tests.netfilter.lab import CLUSTER_IP, CLUSTER_IP_LEGACY, REMOTE4, REMOTE6, REMOTE_PORT, Lab
from tests.netfilter.models import lab_model, many_destinations
from tests.netfilter.test_render import GOLDEN

pytestmark = [pytest.mark.netns, pytest.mark.needs("nft")]


def _route(lab: Lab, model: InterceptModel) -> None:
    if model.needs_policy_routing:
        PolicyRouting(model.tproxy_mark, model.route_table, netns=lab.ns("node")).ensure()


def test_apply_read_back_noop_remove(lab: Lab, nft: NftablesBackend) -> None:
    model = lab_model()
    assert nft.list_applied() == ""
    assert nft.apply(model) is True
    text = nft.list_applied()
    assert "table inet nodeagent" in text and "redirect to :15001" in text
    assert nft.verify(model) == []

    # Re-applying the same model — or an equal one built afresh — runs no transaction:
    # the kernel's ruleset generation does not move.
    gen = nft.generation()
    assert nft.apply(model) is False
    assert nft.apply(lab_model()) is False
    assert nft.generation() == gen
    assert nft.list_applied() == text

    # A different model is one transaction (the generation moves by exactly one).
    assert nft.apply(lab_model(Mode.TPROXY)) is True
    assert nft.generation() == gen + 1

    assert nft.remove() is True
    assert nft.list_applied() == ""
    listing = json.loads(lab.sh("node", ["nft", "-j", "list", "tables"]).stdout)
    assert [o for o in listing["nftables"] if "table" in o] == []
    assert nft.remove() is False


def test_invalid_model_applies_nothing_and_keeps_previous(lab: Lab, nft: NftablesBackend) -> None:
    good = lab_model()
    nft.apply(good)
    before = nft.list_applied()
    bad = InterceptModel(
        rules=(InterceptRule.parse("bad", "tcp", ["10.0.0.0/8", "10.1.0.0/16"]),),
        proxy_ports=good.proxy_ports,
    )
    with pytest.raises(InvalidRule, match=r"'bad'.*10\.1\.0\.0/16 overlaps 10\.0\.0\.0/8"):
        nft.apply(bad)
    assert nft.list_applied() == before


def test_only_our_table_is_touched(lab: Lab, nft: NftablesBackend) -> None:
    lab.sh("node", ["nft", "-f", "-"], input=(
        "table ip other {\n chain c {\n  type filter hook input priority 0;\n  counter\n }\n}\n"
    ))
    nft.apply(lab_model())
    nft.apply(lab_model(Mode.TPROXY))
    nft.remove()
    assert "table ip other" in lab.sh("node", ["nft", "list", "ruleset"]).stdout


def test_reconcile_replaces_stale_table(lab: Lab, nft: NftablesBackend) -> None:
    model = lab_model()
    # What a crashed agent of an older config left behind, plus a hand edit.
    lab.sh("node", ["nft", "-f", "-"], input=render_nftables(lab_model(Mode.TPROXY)))
    assert nft.verify(model) != []
    assert nft.reconcile(model) is True
    assert nft.verify(model) == []
    assert nft.reconcile(model) is False

    # A hand edit keeps the fingerprint comment but is still found by reconcile.
    lab.sh("node", ["nft", "flush", "chain", "inet", "nodeagent", "nat-prerouting"])
    assert nft.apply(model) is False  # the cheap check trusts the fingerprint ...
    assert any("nat-prerouting" in p for p in nft.verify(model))  # ... verify does not
    assert nft.reconcile(model) is True
    assert nft.verify(model) == []

    lab.sh("node", ["nft", "delete", "element", "inet", "nodeagent", "remote-dst4",
                    "{ 198.51.100.0/24 }"])
    assert nft.verify(model) == ["set remote-dst4 elements differ (0 in kernel)"]

    assert nft.reconcile(None) is True
    assert nft.list_applied() == ""


@pytest.mark.parametrize("mode", [Mode.REDIRECT, Mode.TPROXY])
def test_pod_traffic_is_intercepted(lab: Lab, nft: NftablesBackend, mode: Mode) -> None:
    model = lab_model(mode)
    assert lab.connect("pod", REMOTE4[0]) == f"direct {REMOTE4[0]} {REMOTE_PORT}"
    _route(lab, model)
    nft.apply(model)
    # The proxy sees the destination the client meant, in both families.
    assert lab.connect("pod", REMOTE4[0]) == f"proxy {REMOTE4[0]} {REMOTE_PORT}"
    assert lab.connect("pod", REMOTE6[0]) == f"proxy {REMOTE6[0]} {REMOTE_PORT}"
    # Excluded destinations and other ports bypass it.
    assert lab.connect("pod", REMOTE4[1]) == f"direct {REMOTE4[1]} {REMOTE_PORT}"
    assert lab.connect("pod", REMOTE6[1]) == f"direct {REMOTE6[1]} {REMOTE_PORT}"
    # Removing the rules restores direct behaviour.
    nft.remove()
    assert lab.connect("pod", REMOTE4[0]) == f"direct {REMOTE4[0]} {REMOTE_PORT}"


def test_source_interface_selects(lab: Lab, nft: NftablesBackend) -> None:
    nft.apply(lab_model(source_interfaces=(lab.node_remote_if,)))
    assert lab.connect("pod", REMOTE4[0]) == f"direct {REMOTE4[0]} {REMOTE_PORT}"
    nft.apply(lab_model(source_interfaces=(lab.node_pod_if,)))
    assert lab.connect("pod", REMOTE4[0]) == f"proxy {REMOTE4[0]} {REMOTE_PORT}"


@pytest.mark.parametrize("mode", [Mode.REDIRECT, Mode.TPROXY])
def test_host_traffic_and_skip_mark(lab: Lab, nft: NftablesBackend, mode: Mode) -> None:
    model = lab_model(mode, host_traffic=True)
    _route(lab, model)
    nft.apply(model)
    assert lab.connect("node", REMOTE4[0]) == f"proxy {REMOTE4[0]} {REMOTE_PORT}"
    assert lab.connect("node", REMOTE6[0]) == f"proxy {REMOTE6[0]} {REMOTE_PORT}"
    # The agent's own sockets carry the skip mark and go out directly.
    assert lab.connect("node", REMOTE4[0], mark=model.skip_mark) == (
        f"direct {REMOTE4[0]} {REMOTE_PORT}"
    )
    assert lab.connect("node", REMOTE6[0], mark=model.skip_mark) == (
        f"direct {REMOTE6[0]} {REMOTE_PORT}"
    )
    # Other mark bits next to ours (kube-proxy's 0x4000) do not hide the skip bit.
    assert lab.connect("node", REMOTE4[0], mark=model.skip_mark | 0x4000) == (
        f"direct {REMOTE4[0]} {REMOTE_PORT}"
    )


def _kube_proxy_nft(lab: Lab) -> None:
    """kube-proxy nftables mode, reduced to one ClusterIP: its own table, nat at dstnat."""
    lab.sh("node", ["nft", "-f", "-"], input=f"""
table ip kube-proxy {{
    chain nat-prerouting {{
        type nat hook prerouting priority dstnat; policy accept;
        ip daddr {CLUSTER_IP} tcp dport 80 dnat to {REMOTE4[0]}:{REMOTE_PORT}
    }}
}}
""")


def _kube_proxy_iptables(lab: Lab) -> None:
    """kube-proxy iptables mode, reduced to one ClusterIP: nat PREROUTING (-100) DNAT."""
    for args in (
        ["-N", "KUBE-SERVICES"],
        ["-A", "PREROUTING", "-j", "KUBE-SERVICES"],
        ["-A", "KUBE-SERVICES", "-d", CLUSTER_IP_LEGACY, "-p", "tcp", "--dport", "80",
         "-j", "DNAT", "--to-destination", f"{REMOTE4[0]}:{REMOTE_PORT}"],
    ):
        lab.sh("node", ["iptables-legacy", "-t", "nat", *args])


@pytest.mark.parametrize("mode", [Mode.REDIRECT, Mode.TPROXY])
@pytest.mark.parametrize("kube_proxy", [
    "nftables", pytest.param("iptables", marks=pytest.mark.needs("iptables-legacy"))])
def test_cluster_ip_matched_after_kube_proxy_dnat(
    lab: Lab, nft: NftablesBackend, mode: Mode, kube_proxy: str
) -> None:
    if kube_proxy == "nftables":
        _kube_proxy_nft(lab)
        vip = CLUSTER_IP
    else:
        _kube_proxy_iptables(lab)
        vip = CLUSTER_IP_LEGACY
    # Without our rules the VIP works: kube-proxy DNATs it to the remote endpoint.
    assert lab.connect("pod", vip, 80) == f"direct {REMOTE4[0]} {REMOTE_PORT}"
    model = lab_model(mode)
    _route(lab, model)
    nft.apply(model)
    # Our rules name only the endpoint range, not the VIP: the proxy gets the
    # connection, and the destination it sees is the post-DNAT endpoint.
    assert lab.connect("pod", vip, 80) == f"proxy {REMOTE4[0]} {REMOTE_PORT}"


def test_redirect_alone_cannot_follow_dnat(lab: Lab, nft: NftablesBackend) -> None:
    """Why REDIRECT mode has the TPROXY lane: without it, kube-proxy's DNAT wins."""
    _kube_proxy_nft(lab)
    nft.apply(lab_model(Mode.REDIRECT, tproxy_after_dnat=False))
    assert lab.connect("pod", CLUSTER_IP, 80) == f"direct {REMOTE4[0]} {REMOTE_PORT}"
    # Traffic that kube-proxy did not DNAT is still redirected.
    assert lab.connect("pod", REMOTE4[0]) == f"proxy {REMOTE4[0]} {REMOTE_PORT}"


@pytest.mark.parametrize("golden", sorted(GOLDEN.glob("*.nft")), ids=lambda p: p.name)
def test_nft_goldens_are_accepted_by_the_kernel(lab: Lab, golden: Path) -> None:
    lab.sh("node", ["nft", "-c", "-f", str(golden)])


def test_rule_count_in_kernel_constant_for_10_vs_10000(lab: Lab, nft: NftablesBackend) -> None:
    def kernel_rules() -> int:
        listing = json.loads(lab.sh("node", ["nft", "-j", "list", "table", "inet",
                                             "nodeagent"]).stdout)
        return sum(1 for o in listing["nftables"] if "rule" in o)

    nft.apply(many_destinations(10))
    small = kernel_rules()
    nft.apply(many_destinations(10_000))
    assert kernel_rules() == small
    assert nft.verify(many_destinations(10_000)) == []
