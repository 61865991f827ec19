"""Rendering for both backends: goldens, stability, and rule counts that do not grow.

Regenerate the goldens after an intended change with
`NODEAGENT_UPDATE_GOLDEN=1 .venv/bin/pytest tests/netfilter/test_render.py` and review
the diff like code.
"""

from __future__ import annotations

import dataclasses
import os
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netfilter.iptables import plan_iptables, render_ipsets, render_iptables
from netfilter.model import Family, InterceptModel, InterceptRule, Mode
from netfilter.nftables import plan_nftables, render_nftables
from tests.netfilter.models import PORTS, golden_model, many_destinations

GOLDEN = Path(__file__).parent / "golden"


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("NODEAGENT_UPDATE_GOLDEN"):
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with NODEAGENT_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"rendering differs from {path}"


@pytest.mark.parametrize("mode", list(Mode))
def test_nftables_golden(mode: Mode) -> None:
    check_golden(f"nftables-{mode}.nft", render_nftables(golden_model(mode)))


@pytest.mark.parametrize("mode", list(Mode))
def test_nftables_golden_without_dnat_lane(mode: Mode) -> None:
    model = dataclasses.replace(golden_model(mode), tproxy_after_dnat=False)
    check_golden(f"nftables-{mode}-no-dnat-lane.nft", render_nftables(model))


@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("use_ipset", [False, True], ids=["rules", "ipset"])
def test_iptables_golden(mode: Mode, use_ipset: bool) -> None:
    flavour = "-ipset" if use_ipset else ""
    for family, text in render_iptables(golden_model(mode), use_ipset=use_ipset).items():
        check_golden(f"iptables-{mode}{flavour}-{family}.rules", text)
    if use_ipset:
        check_golden(f"ipset-{mode}.txt", render_ipsets(golden_model(mode)))


def test_rendering_is_stable_and_order_independent() -> None:
    model = golden_model(Mode.TPROXY)
    assert render_nftables(model) == render_nftables(golden_model(Mode.TPROXY))
    shuffled = dataclasses.replace(model, rules=tuple(
        dataclasses.replace(r, destinations=tuple(reversed(r.destinations)),
                            ports=tuple(reversed(r.ports)))
        for r in model.rules
    ))
    assert render_nftables(shuffled) == render_nftables(model)
    assert render_iptables(shuffled) == render_iptables(model)


@settings(max_examples=30, deadline=None)
@given(st.randoms(use_true_random=False), st.integers(1, 200))
def test_any_order_of_destinations_renders_the_same(rnd: random.Random, count: int) -> None:
    model = many_destinations(count)
    rule = model.rules[0]
    nets = list(rule.destinations)
    rnd.shuffle(nets)
    shuffled = dataclasses.replace(
        model, rules=(dataclasses.replace(rule, destinations=tuple(nets)),)
    )
    assert render_nftables(shuffled) == render_nftables(model)


def _nft_rule_count(count: int) -> int:
    return sum(len(c.rules) for c in plan_nftables(many_destinations(count)).chains)


def _ipt_rule_count(count: int, use_ipset: bool) -> int:
    plans = plan_iptables(many_destinations(count), use_ipset=use_ipset)
    return sum(len(specs) for p in plans.values() for specs in p.chains.values())


def test_rule_count_constant_for_10_vs_10000_destinations() -> None:
    assert _nft_rule_count(10) == _nft_rule_count(10_000)
    assert _ipt_rule_count(10, use_ipset=True) == _ipt_rule_count(10_000, use_ipset=True)
    # The documented trade-off without ipset: one rule per destination, in PREROUTING's
    # and OUTPUT's pipeline (this model also intercepts host traffic).
    assert _ipt_rule_count(10_000, False) - _ipt_rule_count(10, False) == 2 * 9_990
    plan = plan_nftables(many_destinations(10_000))
    (dst4,) = [s for s in plan.sets if s.name == "bulk-dst4"]
    assert len(dst4.elements) == 10_000


def test_ipv6_only_model_has_no_ipv4_rules() -> None:
    model = InterceptModel(
        rules=(InterceptRule.parse("v6", "tcp", ["fd00::/8"]),), proxy_ports=PORTS
    )
    plans = plan_iptables(model)
    assert not any("R0" in c for c in plans[Family.IPV4].chains)
    assert "ip daddr @v6" not in render_nftables(model)
