"""tunnel.proxy without sockets: proxy URLs and their redaction, which proxy an address
goes through (HTTPS_PROXY/NO_PROXY as Kubernetes components read them), and the HTTP
CONNECT and SOCKS5 handshakes driven with bytes. The real proxies (tinyproxy, microsocks)
are tests/e2e/test_proxy.py."""

from __future__ import annotations

import base64
import ipaddress

import h11
import pytest

from tunnel.proxy import DIRECT, ProxyRules, parse_proxy_url
from tunnel.proxy.handshake import (
    MAX_RESPONSE_HEAD,
    HttpConnectHandshake,
    ProxyError,
    Socks5Handshake,
    handshake_for,
)
from tunnel.transports import Endpoint

SECRET = "s3cret-p@ss"

# ---------------------------------------------------------------- URLs


def test_url_forms_and_default_ports() -> None:
    assert parse_proxy_url("proxy.corp:3128").scheme == "http"
    assert parse_proxy_url("http://proxy.corp").port == 80
    socks = parse_proxy_url("socks5://[fd00::1]")
    assert (socks.scheme, socks.host, socks.port) == ("socks5", "fd00::1", 1080)
    assert parse_proxy_url("SOCKS5H://p:1").scheme == "socks5h"
    user = parse_proxy_url("http://al%40ice:p%3Ass@p:3128")
    assert (user.username, user.password) == ("al@ice", "p:ss")


@pytest.mark.parametrize(("url", "says"), [
    ("", "empty"),
    ("https://p:3128", r"\(https://\) is not supported"),
    ("ftp://p:21", "unsupported proxy scheme"),
    ("http://p:99999", "not a valid proxy URL"),
    ("http://p:3128/path", "no path"),
    ("socks5://alice@p:1080", "needs user:password"),
    (f"socks5://{'a' * 256}:x@p", "at most 255 bytes"),
])
def test_bad_urls_say_why_without_echoing_them(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as info:
        parse_proxy_url(url.replace("//p", f"//alice:{SECRET}@p", 1) if "@" not in url
                        else url, source="HTTPS_PROXY")
    assert str(info.value).startswith("HTTPS_PROXY: ")
    assert SECRET not in str(info.value)


def test_password_is_redacted_in_str_and_repr() -> None:
    proxy = parse_proxy_url(f"http://alice:{SECRET}@proxy.corp:3128")
    assert str(proxy) == "http://alice:[redacted]@proxy.corp:3128"
    assert SECRET not in repr(proxy) and SECRET not in f"{proxy!r} {proxy}"
    assert str(parse_proxy_url("socks5://p:1080")) == "socks5://p:1080"


# ---------------------------------------------------------------- which proxy

TLS = Endpoint("tls", "tunnel.example.com", 443)
WSS = Endpoint("wss", "tunnel.example.com", 443, "/tunnel")
TCP = Endpoint("tcp", "tunnel.example.com", 7000)


def test_environment_https_for_tls_http_for_plain() -> None:
    rules = ProxyRules.from_environment({"HTTPS_PROXY": "http://s:3128",
                                         "HTTP_PROXY": "socks5://p:1080"})
    assert str(rules.for_endpoint(TLS)) == "http://s:3128"
    assert str(rules.for_endpoint(WSS)) == "http://s:3128"
    assert str(rules.for_endpoint(TCP)) == "socks5://p:1080"
    assert ProxyRules.from_environment({}).for_endpoint(TLS) is None
    assert DIRECT.for_endpoint(TLS) is None


def test_upper_case_wins_and_lower_case_is_read() -> None:
    both = {"HTTPS_PROXY": "http://upper:1", "https_proxy": "http://lower:1"}
    assert ProxyRules.from_environment(both).for_endpoint(TLS).host == "upper"  # type: ignore[union-attr]
    lower = {"https_proxy": "http://lower:1", "no_proxy": "example.com"}
    assert ProxyRules.from_environment(lower).for_endpoint(TLS) is None


@pytest.mark.parametrize(("no_proxy", "host", "port", "direct"), [
    ("*", "tunnel.example.com", 443, True),
    ("example.com", "tunnel.example.com", 443, True),  # a name matches its subdomains
    ("example.com", "example.com", 443, True),  # ...and itself
    (".example.com", "example.com", 443, False),  # a leading dot: subdomains only
    ("*.example.com", "tunnel.example.com", 443, True),
    ("ample.com", "tunnel.example.com", 443, False),  # not a suffix match on labels
    ("example.com:8443", "tunnel.example.com", 443, False),  # with a port: that port only
    ("example.com:443", "tunnel.example.com", 443, True),
    ("10.0.0.0/8", "10.1.2.3", 443, True),
    ("10.0.0.0/8", "11.1.2.3", 443, False),
    ("192.0.2.7", "192.0.2.7", 443, True),
    ("[2001:db8::1]:443", "2001:db8::1", 443, True),
    ("2001:db8::/32", "2001:db8::9", 443, True),
    (" other.org , EXAMPLE.COM ", "tunnel.example.com", 443, True),  # spaces, case
    ("not a cidr/99,", "tunnel.example.com", 443, False),  # malformed: ignored, as Go
])
def test_no_proxy(no_proxy: str, host: str, port: int, direct: bool) -> None:
    rules = ProxyRules.from_environment({"HTTPS_PROXY": "http://p:3128",
                                         "NO_PROXY": no_proxy})
    assert (rules.for_endpoint(Endpoint("tls", host, port)) is None) is direct


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.9.9.9", "::1"])
def test_loopback_is_never_proxied_by_the_environment(host: str) -> None:
    rules = ProxyRules.from_environment({"HTTPS_PROXY": "http://p:3128"})
    assert rules.for_endpoint(Endpoint("tls", host, 443)) is None


def test_explicit_proxy_applies_to_every_address() -> None:
    rules = ProxyRules(explicit=parse_proxy_url("socks5://p:1080"))
    assert rules.for_endpoint(Endpoint("tls", "127.0.0.1", 443)) is rules.explicit
    assert rules.for_endpoint(TCP) is rules.explicit
    assert rules.describe() == "proxy socks5://p:1080"


def test_invalid_variable_names_itself_and_hides_the_password() -> None:
    with pytest.raises(ValueError, match=r"^https_proxy: unsupported") as info:
        ProxyRules.from_environment({"https_proxy": f"ftp://u:{SECRET}@p"})
    assert SECRET not in str(info.value)
    rules = ProxyRules.from_environment({"HTTPS_PROXY": f"http://u:{SECRET}@p:3128"})
    assert SECRET not in rules.describe()
    assert "HTTPS_PROXY http://u:[redacted]@p:3128" in rules.describe()


# ---------------------------------------------------------------- HTTP CONNECT


def connect(url: str = "http://p:3128", host: str = "tunnel.example.com",
            port: int = 443) -> HttpConnectHandshake:
    handshake = handshake_for(parse_proxy_url(url), host, port)
    assert isinstance(handshake, HttpConnectHandshake)
    return handshake


def request_of(handshake: HttpConnectHandshake) -> h11.Request:
    """What the proxy reads, parsed by a real HTTP server state machine."""
    server = h11.Connection(h11.SERVER)
    server.receive_data(handshake.data_to_send())
    event = server.next_event()
    assert isinstance(event, h11.Request)
    return event


def test_connect_request_with_basic_auth() -> None:
    request = request_of(connect(f"http://alice:{SECRET}@p:3128"))
    assert (request.method, request.target) == (b"CONNECT", b"tunnel.example.com:443")
    headers = dict(request.headers)
    assert headers[b"host"] == b"tunnel.example.com:443"
    scheme, _, value = headers[b"proxy-authorization"].partition(b" ")
    assert scheme == b"Basic" and base64.b64decode(value) == f"alice:{SECRET}".encode()


def test_connect_request_without_credentials_and_ipv6_target() -> None:
    request = request_of(connect(host="2001:db8::1", port=8443))
    assert request.target == b"[2001:db8::1]:8443"
    assert b"proxy-authorization" not in dict(request.headers)


def test_connect_established_byte_by_byte() -> None:
    handshake = connect()
    handshake.data_to_send()
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 Connection established\r\n\r\n"
    for i in range(len(answer)):
        assert not handshake.done
        handshake.receive_data(answer[i:i + 1])
    assert handshake.done and handshake.leftover == b""
    assert handshake.data_to_send() == b""


def test_connect_keeps_bytes_after_the_answer() -> None:
    handshake = connect()
    handshake.receive_data(b"HTTP/1.0 200 OK\r\nProxy-Agent: x\r\n\r\n\x16\x03\x01")
    assert handshake.done and handshake.leftover == b"\x16\x03\x01"


@pytest.mark.parametrize(("answer", "reason", "says"), [
    (b"HTTP/1.1 407 Proxy Authentication Required\r\nContent-Length: 0\r\n\r\n",
     "proxy_auth", "the credentials in the proxy URL were refused"),
    (b"HTTP/1.0 401 Unauthorized\r\n\r\n", "proxy_auth", "credentials .* were refused"),
    (b"HTTP/1.1 502 Bad Gateway\r\n\r\n", "unavailable", "could not reach"),
    (b"HTTP/1.1 503 Service Unavailable\r\n\r\n", "unavailable", "could not reach"),
    (b"HTTP/1.1 403 Forbidden\r\n\r\n", "proxy", r"refused CONNECT .*\(403 Forbidden\)"),
    (b"SSH-2.0-OpenSSH_9.2\r\n\r\n", "proxy", "did not answer CONNECT in HTTP"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: nope\r\n\r\n", "proxy", "in HTTP"),
])
def test_connect_refusals(answer: bytes, reason: str, says: str) -> None:
    handshake = connect(f"http://alice:{SECRET}@p:3128")
    with pytest.raises(ProxyError, match=says) as info:
        handshake.receive_data(answer)
    assert info.value.reason == reason
    assert SECRET not in str(info.value)
    assert "http://alice:[redacted]@p:3128" in str(info.value)


def test_407_without_credentials_says_to_add_them() -> None:
    with pytest.raises(ProxyError, match="put user:password in the proxy URL") as info:
        connect().receive_data(b"HTTP/1.1 407 Auth\r\n\r\n")
    assert (info.value.reason, info.value.status) == ("proxy_auth", 407)


def test_connect_closed_before_answering() -> None:
    handshake = connect()
    handshake.receive_data(b"HTTP/1.1 20")
    with pytest.raises(ProxyError, match="closed the connection"):
        handshake.receive_data(b"")
    with pytest.raises(ProxyError, match="closed the connection"):
        connect().receive_data(b"")


def test_connect_answer_head_is_bounded() -> None:
    handshake = connect()
    handshake.receive_data(b"HTTP/1.1 200 OK\r\n")
    with pytest.raises(ProxyError, match="in HTTP"):
        for _ in range(MAX_RESPONSE_HEAD // 1000 + 2):
            handshake.receive_data(b"X-Filler: " + b"a" * 990 + b"\r\n")


def test_hostile_reason_phrase_is_made_printable_and_short() -> None:
    with pytest.raises(ProxyError) as info:
        connect().receive_data(b"HTTP/1.1 403 " + b"\x1b[31m" + b"x" * 500 + b"\r\n\r\n")
    assert "\x1b" not in str(info.value) and len(str(info.value)) < 300


# ---------------------------------------------------------------- SOCKS5


def socks(url: str = "socks5://p:1080", host: str = "tunnel.example.com",
          port: int = 443) -> Socks5Handshake:
    handshake = handshake_for(parse_proxy_url(url), host, port)
    assert isinstance(handshake, Socks5Handshake)
    return handshake


def name_request(host: str, port: int) -> bytes:
    return bytes([5, 1, 0, 3, len(host)]) + host.encode() + port.to_bytes(2, "big")


IPV4_SUCCESS = bytes([5, 0, 0, 1, 10, 0, 0, 1, 0x1F, 0x90])


def test_socks5_without_auth() -> None:
    handshake = socks()
    assert handshake.data_to_send() == bytes([5, 1, 0])
    handshake.receive_data(bytes([5, 0]))
    assert handshake.data_to_send() == name_request("tunnel.example.com", 443)
    for byte in IPV4_SUCCESS:  # the reply in pieces
        assert not handshake.done
        handshake.receive_data(bytes([byte]))
    assert handshake.done and handshake.leftover == b""


def test_socks5_username_password() -> None:
    handshake = socks(f"socks5://alice:{SECRET}@p:1080")
    assert handshake.data_to_send() == bytes([5, 2, 0, 2])
    handshake.receive_data(bytes([5, 2]))
    sent = handshake.data_to_send()
    assert sent == (bytes([1, 5]) + b"alice" + bytes([len(SECRET)]) + SECRET.encode())
    handshake.receive_data(bytes([1, 0]))
    assert handshake.data_to_send() == name_request("tunnel.example.com", 443)
    # A reply naming a host (ATYP 3), then bytes that are not the proxy's.
    handshake.receive_data(bytes([5, 0, 0, 3, 4]) + b"host" + bytes([0, 80]) + b"xy")
    assert handshake.done and handshake.leftover == b"xy"


def test_socks5_ip_targets() -> None:
    handshake = socks(host="2001:db8::1", port=8443)
    handshake.data_to_send()
    handshake.receive_data(bytes([5, 0]))
    assert handshake.data_to_send() == (bytes([5, 1, 0, 4])
                                        + ipaddress.IPv6Address("2001:db8::1").packed
                                        + (8443).to_bytes(2, "big"))
    handshake.receive_data(bytes([5, 0, 0, 4]) + bytes(16) + bytes([0, 1]))
    assert handshake.done


@pytest.mark.parametrize(("url", "steps", "reason", "says"), [
    (f"socks5://alice:{SECRET}@p:1080", [bytes([5, 2]), bytes([1, 1])], "proxy_auth",
     "refused the user name and password"),
    ("socks5://p:1080", [bytes([5, 0xFF])], "proxy_auth", "wants authentication"),
    ("socks5://p:1080", [bytes([5, 2])], "proxy_auth", "wants authentication"),
    (f"socks5://alice:{SECRET}@p:1080", [bytes([5, 0xFF])], "proxy_auth",
     "accepts none of our authentication methods"),
    ("socks5://p:1080", [bytes([5, 0]), bytes([5, 5, 0, 1]) + bytes(6)], "refused",
     "connection refused"),
    ("socks5://p:1080", [bytes([5, 0]), bytes([5, 4, 0, 1]) + bytes(6)], "unreachable",
     "host unreachable"),
    ("socks5://p:1080", [bytes([5, 0]), bytes([5, 2, 0, 1]) + bytes(6)], "proxy",
     "not allowed by its rules"),
    ("socks5://p:1080", [b"HTTP/1.1 400 Bad Request\r\n\r\n"], "proxy",
     "does not speak SOCKS5"),
    ("socks5://p:1080", [bytes([5, 0]), bytes([5, 0, 0, 9, 0, 0])], "proxy",
     "does not speak SOCKS5"),
    ("socks5://p:1080", [bytes([5, 0]), bytes([5, 0x42, 0, 1]) + bytes(6)], "proxy",
     "does not speak SOCKS5"),
    ("socks5://p:1080", [bytes([5]), b""], "proxy", "closed the connection"),
])
def test_socks5_refusals(url: str, steps: list[bytes], reason: str, says: str) -> None:
    handshake = socks(url)
    with pytest.raises(ProxyError, match=says) as info:
        for step in steps:
            handshake.data_to_send()
            handshake.receive_data(step)
    assert info.value.reason == reason
    assert SECRET not in str(info.value)
