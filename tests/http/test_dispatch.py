"""The route step without sockets: every answer a request gets before any upstream."""

from __future__ import annotations

import pytest

from nodeagent.http.dispatch import Refusal, route_request
from nodeagent.http.headers import read_request
from nodeagent.http.routetable import Backend, Route, RouteSpec, RouteTable

SHOP = Route("shop", (Backend("edge-1", "10.0.0.5", 8080),))
SECURE = Route("secure", (Backend(None, "127.0.0.1", 8443),), tls_redirect=True)
EMPTY = Route("empty", ())
TABLE = RouteTable.build(
    [
        RouteSpec("shop.example", "/", SHOP),
        RouteSpec("secure.example", "/", SECURE),
        RouteSpec("empty.example", "/", EMPTY),
    ]
)


def decide(
    method: bytes,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    *,
    https: bool = False,
    max_body: int | None = None,
) -> Route | Refusal:
    req = read_request(b"1.1", target, headers)
    return route_request(TABLE, method, req, https=https, max_body=max_body)


def test_routes_by_host_and_path() -> None:
    assert decide(b"GET", b"/cart", [(b"host", b"shop.example")]) is SHOP
    assert decide(b"GET", b"/cart", [(b"host", b"SHOP.example.:80")]) is SHOP
    # the absolute-form authority routes, not the Host field
    assert decide(b"GET", b"http://shop.example/x", [(b"host", b"other.example")]) is SHOP


@pytest.mark.parametrize(
    ("method", "target", "host", "max_body", "status", "close", "location"),
    [
        (b"CONNECT", b"shop.example:443", b"shop.example", None, 405, True, None),
        (b"GET", b"/", b"nowhere.example", None, 404, False, None),
        (b"GET", b"/", b"", None, 404, False, None),
        (b"GET", b"/", b"a" * 8000, None, 404, False, None),
        (
            b"GET",
            b"/a?b=1",
            b"Secure.Example:80",
            None,
            308,
            False,
            "https://secure.example/a?b=1",
        ),
        (b"GET", b"/", b"empty.example", None, 503, False, None),
        (b"POST", b"/", b"shop.example", 99, 413, False, None),
        (b"GET", b"/a%2fb", b"shop.example", None, 400, True, None),
        (b"GET", b"/../etc/passwd", b"shop.example", None, 400, True, None),
        (b"GET", b"/a\\b", b"shop.example", None, 400, True, None),
        (b"GET", b"relative", b"shop.example", None, 400, True, None),
    ],
)
def test_refusals(
    method: bytes,
    target: bytes,
    host: bytes,
    max_body: int | None,
    status: int,
    close: bool,
    location: str | None,
) -> None:
    headers = [(b"host", host), (b"content-length", b"100")]
    got = decide(method, target, headers, max_body=max_body)
    assert isinstance(got, Refusal)
    assert (got.status, got.close, got.location) == (status, close, location)
    assert got.reason


def test_https_requests_are_not_redirected_and_bodies_within_limit_pass() -> None:
    assert decide(b"GET", b"/", [(b"host", b"secure.example")], https=True) is SECURE
    headers = [(b"host", b"shop.example"), (b"content-length", b"99")]
    assert decide(b"POST", b"/", headers, max_body=99) is SHOP
    assert decide(b"POST", b"/", [(b"host", b"shop.example")], max_body=0) is SHOP


API = Route("api", (Backend("edge-1", "10.0.0.6", 8080),))
API_ONLY = RouteTable.build([RouteSpec("shop.example", "/api", API)])


@pytest.mark.parametrize(
    "target", [b"/api/../admin", b"/api/%2e%2e/admin", b"/api/.%2E/admin", b"/api/./../admin"]
)
def test_dot_segments_are_resolved_before_routing(target: bytes) -> None:
    req = read_request(b"1.1", target, [(b"host", b"shop.example")])
    got = route_request(API_ONLY, b"GET", req, https=False, max_body=None)
    assert isinstance(got, Refusal) and got.status == 404
    assert got.reason == "no route for shop.example/admin"


def test_the_normalised_path_routes() -> None:
    req = read_request(b"1.1", b"/x/../%61pi/v1", [(b"host", b"shop.example")])
    assert route_request(API_ONLY, b"GET", req, https=False, max_body=None) is API
    assert req.target == b"/api/v1"


def test_a_long_path_is_clipped_in_the_answer() -> None:
    req = read_request(b"1.1", b"/n" * 5000, [(b"host", b"shop.example")])
    got = route_request(API_ONLY, b"GET", req, https=False, max_body=None)
    assert isinstance(got, Refusal) and got.status == 404
    assert len(got.reason) < 150


@pytest.mark.parametrize(
    "target,host",
    [
        (b"/", b"shop.example:abc"),
        (b"/", b"shop.example:80x"),
        (b"/", b"shop.example:65536"),
        (b"/", b"shop.example:000080"),  # six digits
        (b"/", b"shop.example:-1"),
        (b"/", b"shop.example: 80"),
        (b"/", b"shop.example:80:80"),
        (b"/", b"shop.example:\xd9\xa8\xd9\xa0"),  # Arabic-Indic digits: not ASCII
        (b"/", b"[::1]x"),
        (b"/", b"[::1]:ab"),
        (b"/", b"[::1"),
        (b"/", b"::1"),  # an IPv6 literal without brackets
        (b"/", b"user@shop.example"),
        (b"http://shop.example:abc/x", b"shop.example"),
        (b"http://user:pw@shop.example/x", b"shop.example"),
    ],
)
def test_a_host_port_that_is_not_one_is_refused_and_closes(target: bytes, host: bytes) -> None:
    got = decide(b"GET", target, [(b"host", host)])
    assert isinstance(got, Refusal), (target, host)
    assert (got.status, got.close, got.code) == (400, True, "bad_host")
    assert got.reason.startswith("bad Host: ")
    assert b"shop" not in got.reason.encode()  # no client bytes in the answer or the log


@pytest.mark.parametrize(
    "host", [b"shop.example:0", b"shop.example:65535", b"shop.example:08080", b"[::1]:80"]
)
def test_ports_in_range_pass(host: bytes) -> None:
    req = read_request(b"1.1", b"/", [(b"host", host)])
    assert req.bad_host is None and req.host == host


def test_an_empty_port_is_the_default_one_and_is_normalised_away() -> None:
    for host, seen in ((b"shop.example:", b"shop.example"), (b"[::1]:", b"[::1]")):
        req = read_request(b"1.1", b"/", [(b"host", host), (b"x-a", b"1")])
        assert req.bad_host is None and req.host == seen
        assert req.headers == [(b"host", seen), (b"x-a", b"1")]  # what goes upstream
    assert decide(b"GET", b"/cart", [(b"host", b"shop.example:")]) is SHOP
    assert decide(b"GET", b"http://shop.example:/x", [(b"host", b"o")]) is SHOP
