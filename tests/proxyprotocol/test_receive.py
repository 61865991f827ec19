"""Reading a balancer's header from a stream: exactly its bytes, within the deadline,
from trusted peers only; every refusal counted by reason."""

from __future__ import annotations

import ipaddress

import pytest
import trio
import trio.testing

from nodeagent.proxyprotocol import ProxyHeader, build_header
from nodeagent.proxyprotocol.receive import ProxyTrust, looks_like_proxy_header

BALANCER = ("10.9.0.5", 40000)


def trust(timeout: float = 5.0) -> ProxyTrust:
    return ProxyTrust((ipaddress.ip_network("10.9.0.0/24"),), timeout=timeout)


async def feed(data: bytes, *, close: bool = True) -> tuple[trio.abc.ReceiveStream, bytes]:
    send, receive = trio.testing.memory_stream_one_way_pair()
    await send.send_all(data)
    if close:
        await send.aclose()
    return receive, data


async def test_header_names_the_client_and_leaves_the_rest() -> None:
    t = trust()
    header = build_header("v2", ("203.0.113.7", 5555), ("198.51.100.1", 443))
    stream, _ = await feed(header + b"GET / HTTP/1.1\r\n")
    assert await t.client_of(stream, BALANCER, "http:0") == ProxyHeader(
        ("203.0.113.7", 5555), ("198.51.100.1", 443))
    assert await stream.receive_some(100) == b"GET / HTTP/1.1\r\n"
    assert t.stats.results == {"accepted": 1}


async def test_untrusted_peer_is_not_read() -> None:
    t = trust()
    stream, _ = await feed(b"hello")
    assert await t.client_of(stream, ("10.10.0.1", 1), "tcp:x") == ProxyHeader(
        ("10.10.0.1", 1), None)
    assert await stream.receive_some(100) == b"hello"
    assert not t.stats.results


async def test_ipv4_mapped_peer_is_trusted() -> None:
    assert trust().trusts("::ffff:10.9.0.5") and not trust().trusts("not-an-ip")


@pytest.mark.parametrize(("data", "reason"), [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "bad_signature"),
    (build_header("v2", ("1.2.3.4", 1), ("5.6.7.8", 2))[:20], "truncated"),
    (b"", "truncated"),
])
async def test_refusals_are_counted(data: bytes, reason: str) -> None:
    t = trust()
    stream, _ = await feed(data)
    assert await t.client_of(stream, BALANCER, "http:0") is None
    assert t.stats.results == {reason: 1}


async def test_no_header_in_time_is_a_timeout() -> None:
    t = trust(timeout=0.05)
    stream, _ = await feed(b"\r\n\r\n", close=False)
    with trio.fail_after(5):
        assert await t.client_of(stream, BALANCER, "http:0") is None
    assert t.stats.results == {"timeout": 1}


def test_what_looks_like_a_header() -> None:
    assert looks_like_proxy_header(b"PROXY TCP4 1.2.3.4")
    assert looks_like_proxy_header(build_header("v2", ("1.2.3.4", 1), ("5.6.7.8", 2)))
    assert looks_like_proxy_header(b"\r\n\r\n\x00")
    assert not looks_like_proxy_header(b"\r\n\r\n")  # might be blank lines before a request
    assert not looks_like_proxy_header(b"GET / HTTP/1.1\r\n")
    assert not looks_like_proxy_header(b"PRI * HTTP/2.0")
