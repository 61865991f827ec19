"""The Service annotations of the gateway features, parsed."""

from __future__ import annotations

import pytest

from nodeagent.controller.serviceannotations import PROXY_PROTOCOL_ANNOTATION, proxy_protocol_of


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
