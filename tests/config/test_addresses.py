"""What an address stands for, and the two checks that use it: the protected floor and the
node that owns an address (which decides relays). Both judge the same addresses, so an
IPv6 form of an IPv4 address cannot pass one and not the other."""

from __future__ import annotations

import ipaddress

import pytest

from nodeagent.config import RoutesConfig
from nodeagent.config.addresses import addresses_meant

V4 = ipaddress.IPv4Address


def embedded(host: str) -> set[str]:
    return {str(a) for a in addresses_meant(host)[1:]}


@pytest.mark.parametrize("host,expected", [
    ("::ffff:169.254.169.254", {"169.254.169.254"}),        # IPv4-mapped
    ("64:ff9b::a9fe:a9fe", {"169.254.169.254"}),            # NAT64 well-known prefix
    ("64:ff9b::127.0.0.1", {"127.0.0.1"}),
    ("2002:a9fe:a9fe::1", {"169.254.169.254"}),             # 6to4
    ("::127.0.0.1", {"127.0.0.1"}),                         # IPv4-compatible
    ("::ffff:0:127.0.0.1", {"127.0.0.1"}),                  # IPv4-translated
    # Teredo (RFC 4380's example): server 65.54.227.120, client 192.0.2.45 (obfuscated).
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", {"65.54.227.120", "192.0.2.45"}),
    ("2001:db8::1", set()),
    ("fd00::2", set()),
])
def test_the_ipv4_addresses_an_ipv6_address_embeds(host: str, expected: set[str]) -> None:
    meant = addresses_meant(host)
    assert meant[0] == ipaddress.ip_address(host)
    assert embedded(host) == expected


def test_nat64_local_use_counts_every_prefix_length() -> None:
    # 64:ff9b:1::/48 may be split at /48, /56, /64 or /96 (RFC 6052 §2.2, bits 64-71 are
    # the "u" octet): the network's choice is not in the address, so each candidate counts.
    assert {"169.254.169.254"} <= embedded("64:ff9b:1:a9fe:a9:fea9:fe00:0")  # /48
    assert {"169.254.169.254"} <= embedded("64:ff9b:1:a9:fe:a9fe::")          # /56
    assert {"169.254.169.254"} <= embedded("64:ff9b:1::a9:fea9:fe00:0")      # /64
    assert {"169.254.169.254"} <= embedded("64:ff9b:1::a9fe:a9fe")           # /96


def test_names_and_ipv4_stand_for_themselves() -> None:
    assert addresses_meant("db.example") == ()
    assert addresses_meant("10.1.2.3") == (V4("10.1.2.3"),)


FLOOR_FORMS = [
    "::ffff:169.254.169.254", "64:ff9b::169.254.169.254", "64:ff9b::127.0.0.1",
    "64:ff9b:1::a9fe:a9fe", "64:ff9b:1:a9fe:a9:fea9:fe00:0", "2002:a9fe:a9fe::1",
    "2002:7f00:1::", "::127.0.0.1", "::169.254.169.254", "::ffff:0:127.0.0.1",
    "64:ff9b::10.96.0.1", "2002:ac12:2::1",
    # Teredo with the metadata address as its server, then as its (obfuscated) client.
    "2001:0:a9fe:a9fe::1", "2001:0:102:304:0:0:5601:5601",
]


@pytest.mark.parametrize("host", FLOOR_FORMS)
def test_the_floor_sees_the_ipv4_inside_an_ipv6_address(host: str) -> None:
    routes = RoutesConfig(egress=("0.0.0.0/0:*", "::/0:*"),  # type: ignore[arg-type]
                          protected=("10.96.0.0/12", "172.18.0.2/32"))  # type: ignore[arg-type]
    assert routes.check_egress("n1", host, 80) == "protected", host
    assert routes.address_protected("n1", host, 80)
    assert routes.protected_ranges(host)


def test_embedded_addresses_outside_the_floor_pass_and_a_named_range_unlocks() -> None:
    wide = RoutesConfig(egress=("::/0:*",))  # type: ignore[arg-type]
    assert wide.check_egress("n1", "64:ff9b::203.0.113.5", 80) is None
    assert wide.check_egress("n1", "2001:db8::1", 80) is None
    # The metadata address named by its own CIDR is unlocked in its IPv6 forms too (each
    # address a target stands for is judged on its own); ::/0 never unlocks it.
    named = RoutesConfig(egress=("::/0:80", "169.254.169.254/32:80"))  # type: ignore[arg-type]
    assert named.check_egress("n1", "64:ff9b::169.254.169.254", 80) is None
    assert named.check_egress("n1", "64:ff9b::169.254.169.253", 80) == "protected"


def relayed_routes() -> RoutesConfig:
    return RoutesConfig(egress=("::/0:*", "0.0.0.0/0:*"),  # type: ignore[arg-type]
                        node_cidrs={"b": ("10.244.1.0/24",), "c": ("fd00:c::/64",)})  # type: ignore[dict-item]


@pytest.mark.parametrize("host", ["10.244.1.5", "::ffff:10.244.1.5", "::ffff:af4:105",
                                  "64:ff9b::10.244.1.5", "2002:af4:105::1", "::10.244.1.5"])
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
    for host in ("::ffff:10.244.1.5", "64:ff9b::10.244.1.5"):
        assert routes.check_egress("a", host, 80) == "protected"
        assert routes.protected_ranges(host) == [ipaddress.ip_network("10.244.1.0/24")]
