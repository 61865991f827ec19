"""What an address stands for, and the two checks that use it: the protected floor and the
node that owns an address (which decides relays). Both judge the same addresses, so an
IPv6 form of an IPv4 address cannot pass one and not the other."""

from __future__ import annotations

import ipaddress

import pytest

from nodeagent.config import RoutesConfig
from nodeagent.config.addresses import addresses_meant

V4 = ipaddress.IPv4Address


def test_an_ipv4_mapped_address_stands_for_its_ipv4_address() -> None:
    assert addresses_meant("::ffff:10.244.1.5") == (
        ipaddress.IPv6Address("::ffff:10.244.1.5"), V4("10.244.1.5"))
    assert addresses_meant("db.example") == ()
    assert addresses_meant("10.1.2.3") == (V4("10.1.2.3"),)
    assert addresses_meant("2001:db8::1") == (ipaddress.IPv6Address("2001:db8::1"),)


def relayed_routes() -> RoutesConfig:
    return RoutesConfig(egress=("::/0:*", "0.0.0.0/0:*"),  # type: ignore[arg-type]
                        node_cidrs={"b": ("10.244.1.0/24",), "c": ("fd00:c::/64",)})  # type: ignore[dict-item]


@pytest.mark.parametrize("host", ["10.244.1.5", "::ffff:10.244.1.5", "::ffff:af4:105"])
def test_the_owner_of_an_address_is_found_in_every_form(host: str) -> None:
    routes = relayed_routes()
    assert routes.node_for_address(host) == "b", host
    # No relay policy: none of these is relayed (the server refuses relay_not_allowed).
    assert not routes.relay_allows("a", host, 80)


def test_owner_lookup_leaves_other_addresses_alone() -> None:
    routes = relayed_routes()
    assert routes.node_for_address("fd00:c::5") == "c"
    assert routes.node_for_address("10.244.2.5") is None
    assert routes.node_for_address("::ffff:10.244.2.5") is None
    assert routes.node_for_address("db.example") is None


def test_the_floor_and_the_owner_use_the_same_addresses() -> None:
    routes = RoutesConfig(egress=("::/0:*",),  # type: ignore[arg-type]
                          protected=("10.244.1.0/24",))  # type: ignore[arg-type]
    assert routes.check_egress("a", "::ffff:10.244.1.5", 80) == "protected"
    assert routes.protected_ranges("::ffff:10.244.1.5") == [ipaddress.ip_network("10.244.1.0/24")]
