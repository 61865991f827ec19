"""tunnel.bootstrap: whom a bootstrap connection counts against, and the slots it takes."""

from __future__ import annotations

import pytest

from tunnel.bootstrap import BootstrapRefusal, BootstrapSlots, source_of


@pytest.mark.parametrize(("address", "source"), [
    ("192.0.2.7:51234", "192.0.2.7"),
    ("192.0.2.7", "192.0.2.7"),
    ("[2001:db8:1:2:aaaa::1]:443", "2001:db8:1:2::/64"),
    ("[2001:db8:1:2:bbbb::9]:443", "2001:db8:1:2::/64"),  # the same /64: the same source
    ("[::ffff:192.0.2.7]:8", "192.0.2.7"),  # IPv4-mapped counts as the IPv4 address
    ("[fe80::1%eth0]:443", "fe80::/64"),
    ("dialer", "dialer"),  # not an address: itself
])
def test_source_of(address: str, source: str) -> None:
    assert source_of(address) == source


def test_slots_are_capped_per_source_and_in_all() -> None:
    slots = BootstrapSlots(max_total=3, max_per_source=2)
    assert slots.take("a") is None and slots.take("a") is None
    assert slots.take("a") is BootstrapRefusal.PER_SOURCE
    assert slots.take("b") is None
    assert slots.take("c") is BootstrapRefusal.FULL
    assert (slots.total, slots.held_by("a"), slots.held_by("b")) == (3, 2, 1)
    slots.give_back("a")
    assert slots.take("c") is None and slots.held_by("c") == 1
    for source in ("a", "b", "c"):
        slots.give_back(source)
    assert slots.total == 0 and slots.held_by("a") == 0
    with pytest.raises(ValueError):
        slots.give_back("a")


def test_no_cap_per_source_behind_a_proxy() -> None:
    slots = BootstrapSlots(max_total=5, max_per_source=None)
    assert all(slots.take("proxy") is None for _ in range(5))
    assert slots.take("proxy") is BootstrapRefusal.FULL
