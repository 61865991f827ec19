"""Health checks: the model, the wire lines between server and agent, the thresholds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeagent.config.health import (
    CheckedTarget,
    CheckRequest,
    HealthCheck,
    HealthReport,
    Thresholds,
)


def test_request_and_report_round_trip() -> None:
    request = CheckRequest(checks=(CheckedTarget(host="10.0.0.1", port=80, check=HealthCheck(
        kind="http", path="/healthz", interval=1)),))
    line = request.line()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert CheckRequest.parse(line) == request
    report = HealthReport(host="10.0.0.1", port=80, state="unhealthy", detail="503")
    assert HealthReport.parse(report.line()) == report


@pytest.mark.parametrize("line", [b"", b"{", b'{"checks": 1}', b'{"checks": [], "x": 1}',
                                  b'{"host": "a", "port": 0, "state": "ok"}'])
def test_bad_lines_are_value_errors(line: bytes) -> None:
    for model in (CheckRequest, HealthReport):
        if model is CheckRequest and line == b'{"host": "a", "port": 0, "state": "ok"}':
            continue
        with pytest.raises(ValueError):
            model.parse(line)


@given(st.binary(max_size=300))
def test_random_lines_never_raise_anything_else(line: bytes) -> None:
    for model in (CheckRequest, HealthReport):
        try:
            model.parse(line)
        except ValueError:
            pass


@pytest.mark.parametrize("path", ["healthz", "/a b", "/a\r\nHost: x"])
def test_paths_that_would_break_a_request_line_are_refused(path: str) -> None:
    with pytest.raises(ValueError):
        HealthCheck(kind="http", path=path)


def test_thresholds() -> None:
    t = Thresholds(healthy_threshold=2, unhealthy_threshold=3)
    assert not t.observe(True) and t.state == "unknown"
    assert t.observe(True) and t.state == "healthy"
    assert not t.observe(False) and not t.observe(False) and t.state == "healthy"
    assert not t.observe(True)  # a success resets the failures
    assert [t.observe(False) for _ in range(3)] == [False, False, True]
    assert t.state == "unhealthy"
    assert not t.observe(True) and t.observe(True) and t.state == "healthy"


@given(st.integers(1, 5), st.integers(1, 5), st.lists(st.booleans(), max_size=50))
def test_state_follows_the_last_run_of_results(up: int, down: int,
                                               results: list[bool]) -> None:
    t = Thresholds(healthy_threshold=up, unhealthy_threshold=down)
    for ok in results:
        t.observe(ok)
    run = 0
    for ok in reversed(results):
        if ok != (results[-1] if results else True):
            break
        run += 1
    if results and results[-1] and run >= up:
        assert t.state == "healthy"
    if results and not results[-1] and run >= down:
        assert t.state == "unhealthy"
