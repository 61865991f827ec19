"""Token buckets and a route's rate limiter with made-up times (no sleeping, exact counts),
and the 429 on sockets (HTTP/1.1 with Retry-After, gRPC-shaped answers on HTTP/2)."""

from __future__ import annotations

import httpx
import pytest
import trio

from nodeagent.config import RateLimit
from nodeagent.http import Backend, Route, RouteSpec
from nodeagent.http.gate import GateRegistry
from nodeagent.http.ratelimit import RateLimiter, TokenBucket, retry_after
from tests.http.helpers import Upstream, running_front, start_tcp


def test_bucket_starts_full_refills_at_rate_and_caps_at_burst() -> None:
    bucket = TokenBucket(rate=2.0, burst=3, now=100.0)
    assert [bucket.take(100.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take(100.0) == pytest.approx(0.5)  # one token every 0.5 s
    assert bucket.take(100.25) == pytest.approx(0.25)
    assert bucket.take(100.5) == 0.0
    assert bucket.refill(1000.0) == 3  # never above burst
    assert bucket.take(999.0) == 0.0  # a clock that goes back takes nothing away


def test_retry_after_is_whole_seconds_at_least_one() -> None:
    assert [retry_after(w) for w in (0.01, 1.0, 1.2, 59.9)] == [1, 1, 2, 60]


def test_per_client_limit_first_then_the_route() -> None:
    limiter = RateLimiter(rate=10, burst=4, per_client_rate=1, per_client_burst=2)
    now = 0.0
    assert limiter.check("a", now) is None and limiter.check("a", now) is None
    reason, wait = limiter.check("a", now) or ("", 0)
    assert reason == "rate_limited_client" and wait == pytest.approx(1.0)
    # a's refusal did not spend the route's tokens: b and c get the two left.
    assert limiter.check("b", now) is None and limiter.check("c", now) is None
    assert (limiter.check("d", now) or ("",))[0] == "rate_limited"
    assert limiter.limited == {"rate_limited": 1, "rate_limited_client": 1}
    assert limiter.check("d", now + 0.1) is None  # the route refilled one token


def test_requests_over_a_window_match_the_rate() -> None:
    limiter = RateLimiter(rate=5, burst=5, per_client_rate=None, per_client_burst=None)
    passed = sum(limiter.check("x", t / 100) is None for t in range(1000))  # 10 s, 100/s
    assert passed == 5 + 50 - 1 or passed == 5 + 50  # burst + rate x time


def test_client_buckets_are_bounded_idle_ones_go_first() -> None:
    limiter = RateLimiter(rate=None, burst=None, per_client_rate=1, per_client_burst=1,
                          max_clients=100)
    for i in range(100):
        limiter.check(f"c{i}", 0.0)
    limiter.check("busy", 0.0)  # over the cap at t=0: nobody idle, the oldest half goes
    assert len(limiter.clients) <= 100 and "busy" in limiter.clients
    limiter.check("late", 10.0)  # at t=10 every other bucket is full again: all dropped
    assert set(limiter.clients) <= {"busy", "late"} | {f"c{i}" for i in range(100)}
    assert len(limiter.clients) < 100


def test_ipv6_clients_count_by_their_64() -> None:
    gates = GateRegistry()
    gate = gates.gate("r", None, RateLimit(per_client_rate=1, per_client_burst=1))
    assert gate is not None and gate.limiter is not None
    from nodeagent.http.front import client_key
    assert gate.limiter.check(client_key("2001:db8:1:2::5"), 0.0) is None
    assert gate.limiter.check(client_key("2001:db8:1:2::99"), 0.0) is not None
    assert gate.limiter.check(client_key("2001:db8:1:3::5"), 0.0) is None


async def test_429_with_retry_after_on_http1_and_resource_exhausted_shape_on_h2(
        nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    gates = GateRegistry()
    gate = gates.gate("slow", None, RateLimit(rate=0.001, burst=2))
    specs = [RouteSpec(None, "/", Route("slow", (Backend(None, "127.0.0.1", port),),
                                        gate=gate))]
    async with running_front(specs) as f:
        async with httpx.AsyncClient(trust_env=False, timeout=10) as c:
            codes = [(await c.get(f"{f.url}/")).status_code for _ in range(2)]
            r = await c.get(f"{f.url}/")
            assert codes == [200, 200] and r.status_code == 429
            assert int(r.headers["retry-after"]) >= 900  # 1 token per 1000 s
            assert "route slow: over its request rate" in r.text
        async with httpx.AsyncClient(trust_env=False, timeout=10, http1=False,
                                     http2=True) as c:
            r = await c.post(f"{f.url}/svc/Method", content=b"\0\0\0\0\0",
                             headers={"content-type": "application/grpc", "te": "trailers"})
            assert r.status_code == 200 and r.headers["grpc-status"] == "8"  # EXHAUSTED
        assert f.front.stats.refused_rate_limited == 2
    # A config reload with the same settings keeps the route's buckets.
    assert gates.gate("slow", None, RateLimit(rate=0.001, burst=2)) is gate
    assert gates.gate("slow", None, RateLimit(rate=1, burst=2)) is not gate
