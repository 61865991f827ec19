"""Requests held for a sleeping route (scale to zero), through a real front and upstream:
held until the route table gains backends, never polled; 504 at the wake timeout naming
the route; 503 with Retry-After over max-pending; 502 with the reason when the workload
fails to start; activity counted for the controller."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from nodeagent.http import HeldRequests, Route, RouteSpec, UpstreamUnavailable, WakeSpec
from tests.http.helpers import Upstream, running_front, start_tcp
from tests.http.test_proxy import client, route_to

WAKE = WakeSpec("shop/web", timeout=10.0, max_pending=3)


async def held(holds: HeldRequests, count: int) -> None:
    """Until `count` requests are held (plain data the front updates: polled)."""
    with trio.fail_after(5):
        while sum(holds.pending.values()) < count:  # noqa: ASYNC110
            await trio.sleep(0.01)


def asleep(wake: WakeSpec = WAKE) -> list[RouteSpec]:
    return [RouteSpec("a.test", "/", Route("shop/a", (), wake=wake))]


def awake(port: int, wake: WakeSpec = WAKE) -> list[RouteSpec]:
    return [RouteSpec("a.test", "/", Route("shop/a", route_to(port).backends, wake=wake))]


async def test_a_held_request_is_forwarded_when_the_route_gains_backends(
        nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    holds = HeldRequests()
    async with running_front(asleep(), holds=holds) as f, client() as c:
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await c.get(f"{f.url}/x", headers={"host": "a.test"}))

        async with trio.open_nursery() as inner:
            inner.start_soon(ask)
            inner.start_soon(ask)
            await held(holds, 2)
            assert set(holds.wanted()) == {"shop/web"}
            assert f.opener.opens == 0
            # A table swap that leaves it asleep: they look again and keep waiting.
            f.set_routes(asleep())
            holds.routes_changed()
            await trio.sleep(0.05)
            assert holds.pending == {"shop/web": 2} and not answers
            f.set_routes(awake(port))
            holds.routes_changed()
        assert [r.status_code for r in answers] == [200, 200]
        assert holds.stats.held == 2 and holds.stats.forwarded == 2
        assert holds.pending == {} and holds.wanted() == {}
        assert sum(holds.stats.cold_starts) == 2
        # Awake: forwarded at once, counted as the Service's activity.
        r = await c.get(f"{f.url}/y", headers={"host": "a.test"})
        assert r.status_code == 200 and holds.stats.held == 2
        idle, in_flight = holds.activity()["shop/web"]
        assert idle is not None and idle >= 0 and in_flight == 0


async def test_wake_timeout_overflow_and_failure_answers(nursery: trio.Nursery) -> None:
    holds = HeldRequests()
    quick = WakeSpec("shop/web", timeout=0.3, max_pending=1)
    async with running_front(asleep(quick), holds=holds) as f, client() as c:
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await c.get(f"{f.url}/", headers={"host": "a.test"}))

        async with trio.open_nursery() as inner:
            inner.start_soon(ask)
            await held(holds, 1)
            # Over max-pending (1): 503 at once, with Retry-After.
            over = await c.get(f"{f.url}/", headers={"host": "a.test"})
            assert over.status_code == 503 and over.headers["retry-after"] == "1"
            assert "shop/a is starting" in over.text
        (timed_out,) = answers
        assert timed_out.status_code == 504
        assert "route shop/a (Service shop/web) did not wake within 0.3s" in timed_out.text
        assert holds.stats.timeouts == 1 and holds.stats.overflowed == 1
        # The controller says the workload fails to start: 502 with its reason, at once.
        f.set_routes(asleep(WakeSpec("shop/web", 10.0, 5, failure="pod web-x: "
                                                            "CrashLoopBackOff: no DB")))
        failed = await c.get(f"{f.url}/", headers={"host": "a.test"})
        assert failed.status_code == 502
        assert "CrashLoopBackOff: no DB" in failed.text and "route shop/a" in failed.text
        # A route without wake and without backends is still a plain 503.
        f.set_routes([RouteSpec("a.test", "/", Route("shop/a", ()))])
        plain = await c.get(f"{f.url}/", headers={"host": "a.test"})
        assert plain.status_code == 503 and "no ready backends" in plain.text
    assert holds.pending == {}


async def test_a_held_request_whose_route_goes_away_gets_its_new_answer(
        nursery: trio.Nursery) -> None:
    holds = HeldRequests()
    async with running_front(asleep(), holds=holds) as f, client() as c:
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await c.get(f"{f.url}/", headers={"host": "a.test"}))

        async with trio.open_nursery() as inner:
            inner.start_soon(ask)
            await held(holds, 1)
            f.set_routes([])  # the Ingress was deleted
            holds.routes_changed()
        assert answers[0].status_code == 404


async def test_a_browser_gets_a_starting_page_that_reloads_and_the_wake_is_asked(
        nursery: trio.Nursery) -> None:
    holds = HeldRequests()
    page = WakeSpec("shop/web", timeout=1.0, max_pending=3, starting_page=True)
    async with running_front(asleep(page), holds=holds) as f, client() as c:
        r = await c.get(f"{f.url}/", headers={"host": "a.test",
                                               "accept": "text/html,*/*;q=0.8"})
        assert r.status_code == 503 and r.headers["refresh"] == "2"
        assert r.headers["content-type"].startswith("text/html")
        assert "shop/a is starting" in r.text
        assert set(holds.wanted()) == {"shop/web"} and holds.stats.held == 0
        # Anything else (an API client, a POST) is held as usual.
        async with trio.open_nursery() as inner:
            answers: list[httpx.Response] = []

            async def ask() -> None:
                answers.append(await c.get(f"{f.url}/", headers={
                    "host": "a.test", "accept": "application/json"}))

            inner.start_soon(ask)
            await held(holds, 1)
        assert holds.stats.held == 1 and answers[0].status_code == 504


async def test_an_http2_request_is_held_and_forwarded_too(nursery: trio.Nursery) -> None:
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    holds = HeldRequests()
    async with running_front(asleep(), holds=holds) as f, httpx.AsyncClient(
            http1=False, http2=True, trust_env=False, timeout=10) as c:
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await c.get(f"{f.url}/x", headers={"host": "a.test"}))

        async with trio.open_nursery() as inner:
            inner.start_soon(ask)
            await held(holds, 1)
            f.set_routes(awake(port))
            holds.routes_changed()
        assert answers[0].status_code == 200 and answers[0].http_version == "HTTP/2"
        assert holds.stats.forwarded == 1
        assert holds.activity()["shop/web"][1] == 0  # counted, then done


async def test_an_http2_request_over_max_pending_gets_retry_after(
        nursery: trio.Nursery) -> None:
    holds = HeldRequests()
    one = WakeSpec("shop/web", timeout=0.5, max_pending=1)
    async with running_front(asleep(one), holds=holds) as f, httpx.AsyncClient(
            http1=False, http2=True, trust_env=False, timeout=10) as c:
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await c.get(f"{f.url}/", headers={"host": "a.test"}))

        async with trio.open_nursery() as inner:
            inner.start_soon(ask)
            await held(holds, 1)
            over = await c.get(f"{f.url}/", headers={"host": "a.test"})
            assert over.http_version == "HTTP/2"
            assert over.status_code == 503 and over.headers["retry-after"] == "1"
        assert answers[0].status_code == 504


async def test_a_woken_routes_refused_first_dials_are_retried_on_both_protocols(
        nursery: trio.Nursery) -> None:
    """The node's agent may learn it may dial the woken backend a moment after this
    server's routes gained it: the held request's refused dials are tried again until
    one goes through, on HTTP/1.1 and HTTP/2 alike (not answered 502)."""
    up = Upstream()
    port = await start_tcp(nursery, up.handle)
    for http2 in (False, True):
        holds = HeldRequests()
        async with running_front(asleep(), holds=holds) as f, httpx.AsyncClient(
                http1=not http2, http2=http2, trust_env=False, timeout=10) as c:
            answers: list[httpx.Response] = []

            async def ask(c: httpx.AsyncClient = c, f: Any = f,
                          answers: list[httpx.Response] = answers) -> None:
                answers.append(await c.get(f"{f.url}/x", headers={"host": "a.test"}))

            async with trio.open_nursery() as inner:
                inner.start_soon(ask)
                await held(holds, 1)
                f.opener.fail = UpstreamUnavailable(
                    502, "tcp://127.0.0.1 is not allowed on node edge-1")
                f.set_routes(awake(port))
                holds.routes_changed()
                with trio.fail_after(5):
                    while len(f.opener.backends) < 3:  # noqa: ASYNC110
                        await trio.sleep(0.005)
                assert not answers
                f.opener.fail = None  # the agent has its allow list now
            (answer,) = answers
            assert answer.status_code == 200, answer.text
            assert answer.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
            assert holds.stats.forwarded == 1


async def test_a_woken_route_still_refused_at_the_wake_deadline_gets_the_dial_error(
        nursery: trio.Nursery) -> None:
    holds = HeldRequests()
    quick = WakeSpec("shop/web", timeout=0.5, max_pending=3)
    async with running_front(asleep(quick), holds=holds) as f, client() as c:
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await c.get(f"{f.url}/", headers={"host": "a.test"}))

        async with trio.open_nursery() as inner:
            inner.start_soon(ask)
            await held(holds, 1)
            f.opener.fail = UpstreamUnavailable(502, "not allowed on node edge-1")
            f.set_routes(awake(9, quick))
            holds.routes_changed()
        assert answers[0].status_code == 502
        assert "not allowed on node edge-1" in answers[0].text
