"""The route table: Ingress precedence rules, and properties against a naive reference."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.http.routetable import (
    Backend,
    Match,
    PathType,
    Route,
    RouteSpec,
    RouteTable,
    normalize_host,
)

B = Backend(None, "127.0.0.1", 80)


def r(name: str) -> Route:
    return Route(name, (B,))


def name_of(m: Match | None) -> str | None:
    return None if m is None else m.route.name


def test_host_tiers_exact_beats_wildcard_beats_any() -> None:
    t = RouteTable.build(
        [
            RouteSpec(None, "/", r("any")),
            RouteSpec("*.example.com", "/", r("wild")),
            RouteSpec("app.example.com", "/", r("exact")),
        ]
    )
    assert name_of(t.lookup("app.example.com", "/")) == "exact"
    assert name_of(t.lookup("APP.Example.COM:8443", "/x")) == "exact"
    assert name_of(t.lookup("other.example.com", "/")) == "wild"
    # A wildcard matches exactly one label.
    assert name_of(t.lookup("a.b.example.com", "/")) == "any"
    assert name_of(t.lookup("example.com", "/")) == "any"
    assert name_of(t.lookup("unrelated.org", "/")) == "any"


def test_tier_without_matching_path_falls_through() -> None:
    t = RouteTable.build(
        [
            RouteSpec("app.example.com", "/api", r("api")),
            RouteSpec("*.example.com", "/static", r("static")),
            RouteSpec(None, "/", r("any")),
        ]
    )
    assert name_of(t.lookup("app.example.com", "/api/v1")) == "api"
    assert name_of(t.lookup("app.example.com", "/static/x.js")) == "static"
    assert name_of(t.lookup("app.example.com", "/other")) == "any"


def test_prefix_is_element_wise_and_ignores_trailing_slash() -> None:
    t = RouteTable.build([RouteSpec("h", "/foo", r("foo")), RouteSpec("h", "/aaa/bbb/", r("bbb"))])
    assert name_of(t.lookup("h", "/foo")) == "foo"
    assert name_of(t.lookup("h", "/foo/")) == "foo"
    assert name_of(t.lookup("h", "/foo/bar")) == "foo"
    assert name_of(t.lookup("h", "/foo?x=1")) == "foo"
    assert t.lookup("h", "/foobar") is None
    assert name_of(t.lookup("h", "/aaa/bbb")) == "bbb"
    assert t.lookup("h", "/aaa/bbbxyz") is None
    assert t.lookup("h", "/Foo") is None  # case-sensitive


def test_exact_beats_prefix_and_longest_prefix_wins() -> None:
    t = RouteTable.build(
        [
            RouteSpec("h", "/", r("root")),
            RouteSpec("h", "/foo", r("foo")),
            RouteSpec("h", "/foo/bar", r("foobar")),
            RouteSpec("h", "/foo", r("foo-exact"), PathType.EXACT),
            RouteSpec("h", "/x", r("impl"), PathType.IMPLEMENTATION_SPECIFIC),
        ]
    )
    assert name_of(t.lookup("h", "/foo")) == "foo-exact"
    assert name_of(t.lookup("h", "/foo/")) == "foo"  # Exact /foo does not match /foo/
    assert name_of(t.lookup("h", "/foo/bar/baz")) == "foobar"
    assert name_of(t.lookup("h", "/foo/ba")) == "foo"
    assert name_of(t.lookup("h", "/x/y")) == "impl"  # ImplementationSpecific = Prefix
    assert name_of(t.lookup("h", "/elsewhere")) == "root"
    m = t.lookup("h", "/foo")
    assert m is not None and m.path_type is PathType.EXACT and m.host == "h"


def test_ties_go_to_smallest_rank_then_name_then_first() -> None:
    specs = [
        RouteSpec("h", "/a", r("ns/newer"), rank="2026-02-01T00:00:00Z"),
        RouteSpec("h", "/a", r("ns/older"), rank="2026-01-01T00:00:00Z"),
        RouteSpec("h", "/b", r("ns/zeta")),
        RouteSpec("h", "/b", r("ns/alpha")),
        RouteSpec("h", "/c", Route("same", (B,))),
        RouteSpec("h", "/c", Route("same", ())),
    ]
    t = RouteTable.build(specs)
    assert name_of(t.lookup("h", "/a")) == "ns/older"
    assert name_of(t.lookup("h", "/b")) == "ns/alpha"
    m = t.lookup("h", "/c")
    assert m is not None and m.route.backends == (B,)
    # The outcome does not depend on the input order.
    t2 = RouteTable.build(list(reversed(specs[:4])))
    assert name_of(t2.lookup("h", "/a")) == "ns/older"
    assert name_of(t2.lookup("h", "/b")) == "ns/alpha"


def test_default_backend_and_no_match() -> None:
    t = RouteTable.build([RouteSpec("h", "/a", r("a"))], default=r("default"))
    m = t.lookup("other", "/zzz")
    assert m is not None and m.route.name == "default" and m.path_type is None
    assert RouteTable.build([RouteSpec("h", "/a", r("a"))]).lookup("other", "/") is None
    assert RouteTable.empty().lookup("h", "/") is None


def test_host_normalization() -> None:
    assert normalize_host("Example.COM.:80") == "example.com"
    assert normalize_host("[::1]:8080") == "[::1]"
    t = RouteTable.build([RouteSpec("Example.com.", "/", r("x"))])
    assert name_of(t.lookup("example.COM:1234", "/")) == "x"


@pytest.mark.parametrize(
    "host,path",
    [("a.*.com", "/"), ("*", "/"), ("h:80", "/"), ("h", "relative"), ("h", "/a b"), ("", "/")],
)
def test_invalid_specs_are_rejected(host: str, path: str) -> None:
    with pytest.raises(ValueError):
        RouteSpec(host, path, r("x"))


def test_pathological_path_costs_linear_time() -> None:
    """A path of 60,000 slashes must cost about 10x one of 6,000, not 100x (quadratic):
    a ratio measured in the same run (best of 5 each), not a wall-clock bound."""
    t = RouteTable.build([RouteSpec("h", "/a/b", r("ab")), RouteSpec("h", "/", r("root"))])

    def cost(slashes: int) -> float:
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(20):
                assert name_of(t.lookup("h", "/a/b" + "/" * slashes)) == "ab"
                assert name_of(t.lookup("h", "/" * slashes)) == "root"
            best = min(best, time.perf_counter() - start)
        return best

    assert cost(60_000) / cost(6_000) < 40


# -- properties against a naive reference -----------------------------------------------


def reference(specs: list[RouteSpec], default: Route | None, host: str, path: str) -> Route | None:
    """The Ingress rules written out directly: filter every spec, then sort by precedence."""
    path = path.split("?", 1)[0]
    h = normalize_host(host)

    def host_tier(spec: RouteSpec) -> int | None:
        if spec.host is None:
            return 2
        if spec.host.startswith("*."):
            labels = h.split(".")
            ok = len(labels) >= 2 and labels[0] != "" and ".".join(labels[1:]) == spec.host[2:]
            return 1 if ok else None
        return 0 if spec.host == h else None

    def path_len(spec: RouteSpec) -> int | None:
        if spec.path_type is PathType.EXACT:
            return 1_000_000 if path == spec.path else None
        rule = spec.path.rstrip("/")
        if not rule:
            return 0  # "/" matches every path
        elements = rule.split("/")
        return len(rule) if path.split("/")[: len(elements)] == elements else None

    candidates = []
    for index, spec in enumerate(specs):
        tier = host_tier(spec)
        plen = path_len(spec)
        if tier is None or plen is None:
            continue
        candidates.append((tier, -plen, spec.rank, spec.route.name, index, spec.route))
    if not candidates:
        return default
    return min(candidates, key=lambda c: c[:5])[5]


labels = st.sampled_from(["a", "b", "api", "x-1"])
hosts = st.one_of(
    st.none(),
    st.lists(labels, min_size=1, max_size=3).map(".".join),
    st.lists(labels, min_size=1, max_size=2).map(lambda ls: "*." + ".".join(ls)),
)
segments = st.sampled_from(["a", "b", "ab", "", "c.d"])
paths = st.lists(segments, max_size=4).map(lambda s: "/" + "/".join(s))
spec_st = st.builds(
    RouteSpec,
    host=hosts,
    path=paths,
    route=st.builds(Route, name=st.sampled_from(["r1", "r2", "r3", "r4"]), backends=st.just(())),
    path_type=st.sampled_from(list(PathType)),
    rank=st.sampled_from(["", "1", "2"]),
)
req_hosts = st.lists(labels, min_size=1, max_size=4).map(".".join) | st.sampled_from(
    ["A.B:80", "api.a.", ""]
)
req_paths = paths | st.sampled_from(["/a?x=/b", "/ab/", "//a", "*", "/a//b/"])


@settings(max_examples=400, deadline=None)
@given(
    specs=st.lists(spec_st, max_size=12),
    default=st.none() | st.just(Route("default", ())),
    queries=st.lists(st.tuples(req_hosts, req_paths), min_size=1, max_size=10),
)
def test_lookup_agrees_with_reference(
    specs: list[RouteSpec], default: Route | None, queries: list[tuple[str, str]]
) -> None:
    table = RouteTable.build(specs, default=default)
    for host, path in queries:
        got = table.lookup(host, path)
        want = reference(specs, default, host, path)
        assert (got.route if got else None) is want, (host, path)


def test_lookup_is_right_at_scale() -> None:
    """10,000 hosts / 20,000 paths: every lookup finds its own route. (How fast is for
    scripts.bench.route_table, which prints ratios; a timing here would fail on a busy
    machine without saying anything about the code.)"""
    specs = []
    for i in range(10_000):
        route = r(f"r{i}")
        specs.append(RouteSpec(f"svc{i}.example.com", "/", route))
        specs.append(RouteSpec(f"svc{i}.example.com", f"/api/v{i % 5}", route, PathType.EXACT))
    table = RouteTable.build(specs)
    for i in range(10_000):
        m = table.lookup(f"svc{i}.example.com", "/api/v1/x")
        assert m is not None and m.route.name == f"r{i}"
        exact = table.lookup(f"svc{i}.example.com", f"/api/v{i % 5}")
        assert exact is not None and exact.route.name == f"r{i}"
    assert table.lookup("svc10000.example.com", "/") is None
