"""The Service annotations of the gateway features, parsed."""

from __future__ import annotations

import pytest

from nodeagent.config.health import HealthCheck
from nodeagent.controller.serviceannotations import (
    HEALTH_CHECK_ANNOTATION,
    PROXY_PROTOCOL_ANNOTATION,
    health_check_of,
    proxy_protocol_of,
)


@pytest.mark.parametrize(("value", "want"), [
    ("v1", "v1"), ("v2", "v2"), (" V2 ", "v2"), ("off", None), ("", None), ("none", None)])
def test_proxy_protocol_values(value: str, want: str | None) -> None:
    assert proxy_protocol_of({PROXY_PROTOCOL_ANNOTATION: value}) == (want, None)


def test_proxy_protocol_absent_is_off() -> None:
    assert proxy_protocol_of(None) == (None, None)
    assert proxy_protocol_of({"other": "v2"}) == (None, None)


def test_proxy_protocol_bad_value_is_a_problem_and_off() -> None:
    setting, problem = proxy_protocol_of({PROXY_PROTOCOL_ANNOTATION: "v3" * 100})
    assert setting is None and problem is not None
    assert "is not v1, v2 or off" in problem and len(problem) < 200


@pytest.mark.parametrize(("value", "want"), [
    ("tcp", {"kind": "tcp"}),
    ("http:/healthz", {"kind": "http", "path": "/healthz"}),
    ("HTTP:/ready interval=10 timeout=1 healthy=1 unhealthy=5",
     {"kind": "http", "path": "/ready", "interval": 10, "timeout": 1,
      "healthy_threshold": 1, "unhealthy_threshold": 5}),
])
def test_health_check_values(value: str, want: dict[str, object]) -> None:
    check, problem = health_check_of({HEALTH_CHECK_ANNOTATION: value})
    assert problem is None and check == HealthCheck.model_validate(want)


@pytest.mark.parametrize(("value", "says"), [
    ("udp", "kind"), ("http:healthz", "path"), ("tcp:/x", "no path"),
    ("http:/x every=5", "is not one of"), ("http:/x interval=0", "interval"),
    ("http:/x interval=soon", "interval"), ("http:/x unhealthy=", "is not one of")])
def test_health_check_bad_values_are_problems(value: str, says: str) -> None:
    check, problem = health_check_of({HEALTH_CHECK_ANNOTATION: value})
    assert check is None and problem is not None and says in problem, problem


def test_health_check_absent_is_none() -> None:
    assert health_check_of(None) == (None, None)
    assert health_check_of({HEALTH_CHECK_ANNOTATION: "  "}) == (None, None)
