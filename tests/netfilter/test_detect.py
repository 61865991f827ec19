"""Backend detection on real (namespaced) hosts."""

from __future__ import annotations

import pytest

from netfilter.detect import Backend, detect_backend
from netfilter.iptables import IptablesBackend
from tests.netfilter.lab import Lab
from tests.netfilter.models import lab_model

pytestmark = [pytest.mark.netns, pytest.mark.needs("nft")]


def test_empty_host_uses_nftables(lab: Lab) -> None:
    found = detect_backend(lab.ns("node"))
    assert found.backend is Backend.NFTABLES, found.reason


@pytest.mark.needs("iptables-legacy")
def test_kube_proxy_in_legacy_iptables_means_legacy(lab: Lab) -> None:
    lab.sh("node", ["iptables-legacy", "-t", "nat", "-N", "KUBE-SERVICES"])
    found = detect_backend(lab.ns("node"))
    assert found.backend is Backend.IPTABLES_LEGACY
    assert "kube-proxy" in found.reason


@pytest.mark.needs("iptables-legacy-restore")
def test_our_own_legacy_chains_do_not_count(lab: Lab) -> None:
    """Leftovers of ours in legacy iptables must not pin the host to legacy."""
    IptablesBackend(lab.ns("node"), use_ipset=False).apply(lab_model())
    assert detect_backend(lab.ns("node")).backend is Backend.NFTABLES


@pytest.mark.needs("iptables-nft")
def test_iptables_nft_rules_mean_nftables(lab: Lab) -> None:
    lab.sh("node", ["iptables-nft", "-t", "nat", "-N", "KUBE-SERVICES"])
    assert detect_backend(lab.ns("node")).backend is Backend.NFTABLES
