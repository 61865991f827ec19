"""Requests held for a sleeping route (scale to zero), through a real front and upstream:
held until the route table gains backends, never polled; 504 at the wake timeout naming
the route; 503 with Retry-After over max-pending; 502 with the reason when the workload
fails to start; activity counted for the controller."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import trio

from nodeagent.http import HeldRequests, Route, RouteSpec, UpstreamUnavailable, WakeSpec
from tests.http.helpers import Front, Upstream, running_front, start_tcp
from tests.http.test_proxy import client, route_to

WAKE = WakeSpec("shop/web", timeout=10.0, max_pending=3)


def asleep(wake: WakeSpec = WAKE) -> list[RouteSpec]:
    return [RouteSpec("a.test", "/", Route("shop/a", (), wake=wake))]


def awake(port: int, wake: WakeSpec = WAKE) -> list[RouteSpec]:
    return [RouteSpec("a.test", "/", Route("shop/a", route_to(port).backends, wake=wake))]


@dataclass
class SleepingFront:
    """A front whose route a.test/ sleeps (`asleep(wake)`), its holds and a client."""

    front: Front
    client: httpx.AsyncClient
    holds: HeldRequests
    answers: list[httpx.Response] = field(default_factory=list)  # of `requests()`'s

    async def get(self, path: str = "/", **headers: str) -> httpx.Response:
        return await self.client.get(f"{self.front.url}{path}",
                                     headers={"host": "a.test", **headers})

    @asynccontextmanager
    async def requests(self) -> AsyncIterator[Callable[..., None]]:
        """`ask(path, **headers)` starts a request whose answer goes to `answers`;
        leaving the block waits for every answer."""
        async with trio.open_nursery() as nursery:
            def ask(path: str = "/", **headers: str) -> None:
                async def one() -> None:
                    self.answers.append(await self.get(path, **headers))
                nursery.start_soon(one)
            yield ask

    async def held(self, count: int) -> None:
        """Until `count` requests are held (plain data the front updates: polled)."""
        with trio.fail_after(5):
            while sum(self.holds.pending.values()) < count:  # noqa: ASYNC110
                await trio.sleep(0.01)

    def swap(self, routes: list[RouteSpec]) -> None:
        """A new route table in force, as the server's table owner does it."""
        self.front.set_routes(routes)
        self.holds.routes_changed()


@asynccontextmanager
async def sleeping_front(wake: WakeSpec = WAKE, *, http2: bool = False
                         ) -> AsyncIterator[SleepingFront]:
    holds = HeldRequests()
    async with running_front(asleep(wake), holds=holds) as f, client(
            http1=not http2, http2=http2) as c:
        yield SleepingFront(f, c, holds)


async def test_a_held_request_is_forwarded_when_the_route_gains_backends(
        nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    async with sleeping_front() as s:
        holds = s.holds
        async with s.requests() as ask:
            ask("/x")
            ask("/x")
            await s.held(2)
            assert set(holds.wanted()) == {"shop/web"}
            assert s.front.opener.opens == 0
            # A table swap that leaves it asleep: they look again and keep waiting.
            s.swap(asleep())
            await trio.sleep(0.05)
            assert holds.pending == {"shop/web": 2} and not s.answers
            s.swap(awake(port))
        assert [r.status_code for r in s.answers] == [200, 200]
        assert holds.stats.held == 2 and holds.stats.forwarded == 2
        assert holds.pending == {} and holds.wanted() == {}
        assert sum(holds.stats.cold_starts) == 2
        # Awake: forwarded at once, counted as the Service's activity.
        r = await s.get("/y")
        assert r.status_code == 200 and holds.stats.held == 2
        idle, in_flight = holds.activity()["shop/web"]
        assert idle is not None and idle >= 0 and in_flight == 0


async def test_wake_timeout_overflow_and_failure_answers() -> None:
    quick = WakeSpec("shop/web", timeout=0.3, max_pending=1)
    async with sleeping_front(quick) as s:
        async with s.requests() as ask:
            ask()
            await s.held(1)
            # Over max-pending (1): 503 at once, with Retry-After.
            over = await s.get()
            assert over.status_code == 503 and over.headers["retry-after"] == "1"
            assert "shop/a is starting" in over.text
        (timed_out,) = s.answers
        assert timed_out.status_code == 504
        assert "route shop/a (Service shop/web) did not wake within 0.3s" in timed_out.text
        assert s.holds.stats.timeouts == 1 and s.holds.stats.overflowed == 1
        # The controller says the workload fails to start: 502 with its reason, at once.
        s.front.set_routes(asleep(WakeSpec("shop/web", 10.0, 5, failure="pod web-x: "
                                                                  "CrashLoopBackOff: no DB")))
        failed = await s.get()
        assert failed.status_code == 502
        assert "CrashLoopBackOff: no DB" in failed.text and "route shop/a" in failed.text
        # A route without wake and without backends is still a plain 503.
        s.front.set_routes([RouteSpec("a.test", "/", Route("shop/a", ()))])
        plain = await s.get()
        assert plain.status_code == 503 and "no ready backends" in plain.text
    assert s.holds.pending == {}


async def test_a_held_request_whose_route_goes_away_gets_its_new_answer() -> None:
    async with sleeping_front() as s:
        async with s.requests() as ask:
            ask()
            await s.held(1)
            s.swap([])  # the Ingress was deleted
        assert s.answers[0].status_code == 404


async def test_a_browser_gets_a_starting_page_that_reloads_and_the_wake_is_asked() -> None:
    page = WakeSpec("shop/web", timeout=1.0, max_pending=3, starting_page=True)
    async with sleeping_front(page) as s:
        holds = s.holds
        r = await s.get(accept="text/html,*/*;q=0.8")
        assert r.status_code == 503 and r.headers["refresh"] == "2"
        assert r.headers["content-type"].startswith("text/html")
        assert "shop/a is starting" in r.text
        assert set(holds.wanted()) == {"shop/web"} and holds.stats.held == 0
        # Anything else (an API client, a POST) is held as usual.
        async with s.requests() as ask:
            ask(accept="application/json")
            await s.held(1)
        assert holds.stats.held == 1 and s.answers[0].status_code == 504


async def test_an_http2_request_is_held_and_forwarded_too(nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    async with sleeping_front(http2=True) as s:
        async with s.requests() as ask:
            ask("/x")
            await s.held(1)
            s.swap(awake(port))
        assert s.answers[0].status_code == 200 and s.answers[0].http_version == "HTTP/2"
        assert s.holds.stats.forwarded == 1
        assert s.holds.activity()["shop/web"][1] == 0  # counted, then done


async def test_an_http2_request_over_max_pending_gets_retry_after() -> None:
    one = WakeSpec("shop/web", timeout=0.5, max_pending=1)
    async with sleeping_front(one, http2=True) as s:
        async with s.requests() as ask:
            ask()
            await s.held(1)
            over = await s.get()
            assert over.http_version == "HTTP/2"
            assert over.status_code == 503 and over.headers["retry-after"] == "1"
        assert s.answers[0].status_code == 504


async def test_a_woken_routes_refused_first_dials_are_retried_on_both_protocols(
        nursery: trio.Nursery) -> None:
    """The node's agent may refuse the woken backend's first dials (an agent too old to
    wait for its allow list, or one whose wait ran out): the held request's refused
    dials are tried again until one goes through, on HTTP/1.1 and HTTP/2 alike (not
    answered 502)."""
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    for http2 in (False, True):
        async with sleeping_front(http2=http2) as s:
            async with s.requests() as ask:
                ask("/x")
                await s.held(1)
                s.front.opener.fail = UpstreamUnavailable(
                    502, "tcp://127.0.0.1 is not allowed on node edge-1")
                s.swap(awake(port))
                with trio.fail_after(5):
                    while len(s.front.opener.backends) < 3:  # noqa: ASYNC110
                        await trio.sleep(0.005)
                assert not s.answers
                s.front.opener.fail = None  # the agent has its allow list now
            (answer,) = s.answers
            assert answer.status_code == 200, answer.text
            assert answer.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
            assert s.holds.stats.forwarded == 1


async def test_a_woken_route_still_refused_at_the_wake_deadline_gets_the_dial_error(
        ) -> None:
    quick = WakeSpec("shop/web", timeout=0.5, max_pending=3)
    async with sleeping_front(quick) as s:
        async with s.requests() as ask:
            ask()
            await s.held(1)
            s.front.opener.fail = UpstreamUnavailable(502, "not allowed on node edge-1")
            s.swap(awake(9, quick))
        assert s.answers[0].status_code == 502
        assert "not allowed on node edge-1" in s.answers[0].text
