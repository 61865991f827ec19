"""The PROXY header core: exact bytes of the spec's examples, round trips, and random
and adversarial bytes that may only ever end in ProxyHeaderError."""

from __future__ import annotations

import ipaddress
import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.proxyprotocol import (
    V2_SIGNATURE,
    ProxyHeader,
    ProxyHeaderError,
    build_header,
    parse_v2,
    v2_length,
)
from nodeagent.proxyprotocol.header import V2_HEADER_SIZE, V2_MAX_LENGTH


def parse(data: bytes) -> ProxyHeader:
    return parse_v2(data[:V2_HEADER_SIZE + v2_length(data[:V2_HEADER_SIZE])])


def test_v1_tcp4_is_the_spec_line() -> None:
    assert build_header("v1", ("192.168.0.1", 56324), ("192.168.0.11", 443)) == (
        b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\n")


def test_v1_tcp6_and_mixed_families_go_v6() -> None:
    assert build_header("v1", ("2001:db8::1", 1), ("2001:db8::2", 2)) == (
        b"PROXY TCP6 2001:db8::1 2001:db8::2 1 2\r\n")
    mapped = str(ipaddress.IPv6Address("::ffff:10.0.0.1")).encode()
    assert build_header("v1", ("10.0.0.1", 1), ("::1", 2)) == (
        b"PROXY TCP6 " + mapped + b" ::1 1 2\r\n")
    # An IPv4-mapped address (a dual-stack listener's view of an IPv4 client) is IPv4.
    assert build_header("v1", ("::ffff:10.0.0.1", 1), ("::ffff:10.0.0.2", 2)) == (
        b"PROXY TCP4 10.0.0.1 10.0.0.2 1 2\r\n")


def test_v2_tcp4_exact_bytes() -> None:
    header = build_header("v2", ("10.0.0.1", 1000), ("10.0.0.2", 80))
    assert header == (V2_SIGNATURE + b"\x21\x11\x00\x0c" + bytes([10, 0, 0, 1, 10, 0, 0, 2])
                      + struct.pack("!HH", 1000, 80))
    assert parse(header) == ProxyHeader(("10.0.0.1", 1000), ("10.0.0.2", 80))


def test_v2_local_and_unspec_name_no_client() -> None:
    local = V2_SIGNATURE + b"\x20\x00\x00\x00"
    assert parse(local) == ProxyHeader(None, None)
    unspec = V2_SIGNATURE + b"\x21\x00\x00\x03abc"  # PROXY UNSPEC with bytes to skip
    assert parse(unspec) == ProxyHeader(None, None)


def test_v2_tlvs_after_the_addresses_are_skipped() -> None:
    header = build_header("v2", ("2001:db8::1", 5), ("2001:db8::2", 6))
    tlv = b"\x04\x00\x03abc"  # PP2_TYPE_NOOP
    length = struct.unpack("!H", header[14:16])[0] + len(tlv)
    with_tlv = header[:14] + struct.pack("!H", length) + header[16:] + tlv
    assert parse(with_tlv) == ProxyHeader(("2001:db8::1", 5), ("2001:db8::2", 6))


@pytest.mark.parametrize(("head", "reason"), [
    (b"GET / HTTP/1.1\r\nHost", "bad_signature"),
    (b"PROXY TCP4 1.2.3.4 ", "bad_signature"),  # v1 is not taken from balancers
    (V2_SIGNATURE + b"\x11\x11\x00\x0c", "bad_version"),
    (V2_SIGNATURE + b"\x22\x11\x00\x0c", "bad_command"),
    (V2_SIGNATURE + b"\x21\x11\xff\xff", "bad_length"),
])
def test_bad_heads_have_reasons(head: bytes, reason: str) -> None:
    with pytest.raises(ProxyHeaderError) as caught:
        v2_length(head[:V2_HEADER_SIZE])
    assert caught.value.reason == reason


@pytest.mark.parametrize(("data", "reason"), [
    (V2_SIGNATURE + b"\x21\x11\x00\x04abcd", "bad_length"),  # too short for two IPv4
    (V2_SIGNATURE + b"\x21\x12\x00\x0c" + bytes(12), "bad_family"),  # UDP on TCP
    (V2_SIGNATURE + b"\x21\x41\x00\x0c" + bytes(12), "bad_family"),  # no such family
])
def test_bad_bodies_have_reasons(data: bytes, reason: str) -> None:
    with pytest.raises(ProxyHeaderError) as caught:
        parse(data)
    assert caught.value.reason == reason


def test_build_refuses_names() -> None:
    with pytest.raises(ProxyHeaderError) as caught:
        build_header("v2", ("example.com", 1), ("10.0.0.1", 2))
    assert caught.value.reason == "bad_address"


addresses = st.one_of(
    st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(str))
ports = st.integers(0, 65535)


@given(addresses, ports, addresses, ports)
def test_v2_round_trip(src: str, sport: int, dst: str, dport: int) -> None:
    header = parse(build_header("v2", (src, sport), (dst, dport)))
    assert header.source is not None and header.destination is not None
    # The same addresses, as IPv6 when the families differed (mapped IPv4 becomes IPv4).
    for (host, port), (want_host, want_port) in ((header.source, (src, sport)),
                                                 (header.destination, (dst, dport))):
        assert port == want_port
        got, want = ipaddress.ip_address(host), ipaddress.ip_address(want_host)
        if isinstance(got, ipaddress.IPv6Address) and got.ipv4_mapped is not None:
            got = got.ipv4_mapped
        if isinstance(want, ipaddress.IPv6Address) and want.ipv4_mapped is not None:
            want = want.ipv4_mapped
        assert got == want


@given(addresses, ports, addresses, ports)
def test_v1_is_one_short_ascii_line(src: str, sport: int, dst: str, dport: int) -> None:
    line = build_header("v1", (src, sport), (dst, dport))
    assert line.endswith(b"\r\n") and line.count(b"\r\n") == 1
    assert len(line) <= 107  # the spec's worst case
    fields = line[:-2].split(b" ")
    assert fields[0] == b"PROXY" and fields[1] in (b"TCP4", b"TCP6") and len(fields) == 6


@given(st.binary(max_size=V2_HEADER_SIZE + V2_MAX_LENGTH + 50))
def test_random_bytes_only_raise_header_errors(data: bytes) -> None:
    head = data[:V2_HEADER_SIZE].ljust(V2_HEADER_SIZE, b"\0")
    try:
        length = v2_length(head)
        parse_v2(head + data[V2_HEADER_SIZE:].ljust(length, b"\0")[:length])
    except ProxyHeaderError:
        pass


@given(st.integers(0, 0xFF), st.integers(0, 0xFF), st.binary(max_size=V2_MAX_LENGTH))
def test_any_v2_head_after_the_signature_only_raises_header_errors(
        version_command: int, family: int, body: bytes) -> None:
    data = V2_SIGNATURE + bytes([version_command, family]) + struct.pack("!H", len(body))
    try:
        header = parse_v2(data + body)
    except ProxyHeaderError:
        return
    for address in (header.source, header.destination):
        if address is not None:
            ipaddress.ip_address(address[0])
            assert 0 <= address[1] <= 65535
