"""DNS by zone (nodeagent/agent/intercept/dnszones.py): which intercepted queries go to
the zones' resolver. Messages are built with dnslib; anything else is bad input that
must never raise."""

from __future__ import annotations

from dnslib import DNSRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.agent.intercept.dnszones import in_zones

ZONES = ("svc.cloud.internal.", "corp.")


def query(name: str, qtype: str = "A") -> bytes:
    packed: bytes = DNSRecord.question(name, qtype).pack()
    return packed


def test_names_in_and_below_a_zone_match_case_insensitively() -> None:
    assert in_zones(query("svc.cloud.internal"), ZONES)
    assert in_zones(query("db.svc.cloud.internal."), ZONES)
    assert in_zones(query("DB.Svc.CLOUD.internal"), ZONES)
    assert in_zones(query("x.corp", "AAAA"), ZONES)


def test_other_names_and_lookalikes_do_not() -> None:
    assert not in_zones(query("example.org"), ZONES)
    assert not in_zones(query("evilsvc.cloud.internal"), ZONES)  # not below the zone
    assert not in_zones(query("cloud.internal"), ZONES)  # the parent zone
    assert not in_zones(query("corp.example"), ZONES)


def test_answers_and_garbage_are_not_queries_of_a_zone() -> None:
    reply = DNSRecord.question("db.corp").reply().pack()
    assert not in_zones(reply, ZONES)
    assert not in_zones(b"", ZONES) and not in_zones(b"\x00" * 12, ZONES)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_give_an_answer_never_an_exception(data: bytes) -> None:
    assert in_zones(data, ZONES) in (True, False)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 40))
def test_a_query_with_garbage_after_its_header_never_raises(noise: bytes, cut: int) -> None:
    raw = query("db.svc.cloud.internal")
    assert in_zones(raw[:cut] + noise, ZONES) in (True, False)
