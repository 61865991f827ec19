"""The config stream's wire contract, without sockets: paths, lines, heartbeats."""

from __future__ import annotations

import json

import pytest

from nodeagent.config import NodeConfig
from nodeagent.configstream.protocol import (
    HEARTBEAT_LINE,
    LineError,
    activity_body,
    config_line,
    node_config_path,
    parse_activity,
    parse_config_path,
    parse_line,
    parse_report_path,
    parse_wake,
    report_path,
    servers_config_path,
    wake_body,
)


def test_paths_round_trip() -> None:
    assert parse_config_path(node_config_path("edge-1")) == ("nodes", "edge-1")
    assert parse_config_path(servers_config_path("cloud-a")) == ("servers", "cloud-a")


@pytest.mark.parametrize("path", [
    "/v1/config/nodes/", "/v1/config/nodes", "/v1/config/pods/x", "/v2/config/nodes/x",
    "/v1/config/nodes/x/y", "/", "", "/v1/certificates",
])
def test_other_paths_are_not_watches(path: str) -> None:
    assert parse_config_path(path) is None


def test_a_config_line_parses_back_with_its_version() -> None:
    config = NodeConfig(version=7, allow=["127.0.0.1:80"])
    line = config_line(7, config)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    doc = parse_line(line.rstrip(b"\n"))
    assert doc["version"] == 7
    assert "version" not in doc["config"]  # the line carries it once
    assert NodeConfig.model_validate({**doc["config"], "version": 7}) == config


def test_the_heartbeat_is_an_empty_object() -> None:
    assert parse_line(HEARTBEAT_LINE.rstrip(b"\n")) == {}


@pytest.mark.parametrize("line", [b"not json", b"[1, 2]", b"42", json.dumps("x").encode()])
def test_a_line_that_is_not_an_object_is_refused(line: bytes) -> None:
    with pytest.raises(LineError):
        parse_line(line)


def test_report_paths_and_bodies_round_trip() -> None:
    assert parse_report_path(report_path("s1", "wake")) == ("wake", "s1")
    assert parse_report_path(report_path("s1", "activity")) == ("activity", "s1")
    for path in ("/v1/servers/s1/other", "/v1/servers//wake", "/v1/config/servers/s1",
                 "/v1/servers/s1/wake/x"):
        assert parse_report_path(path) is None
    body = activity_body({"shop/web": (1.5, 0), "shop/api": (None, 3)})
    assert parse_activity(body) == {"shop/web": (1.5, 0), "shop/api": (None, 3)}
    assert parse_wake(wake_body("shop/web")) == "shop/web"


@pytest.mark.parametrize("body", [
    b"", b"[]", b"{nope", b'{"services": []}', b'{"services": {"web": {}}}',
    b'{"services": {"a/b/c": {}}}', b'{"services": {"a/b": 1}}',
    b'{"services": {"a/b": {"idle": -1}}}', b'{"services": {"a/b": {"idle": "x"}}}',
    b'{"services": {"a/b": {"in_flight": true}}}', b'{"services": {"a/b": {"in_flight": -2}}}',
    b'{"services": {' + b",".join(b'"n/s%d": {}' % i for i in range(151)) + b"}}",
])
def test_bad_activity_reports_are_refused_with_a_clear_error(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_activity(body)


@pytest.mark.parametrize("body", [b"", b"{}", b'{"service": 3}', b'{"service": "web"}',
                                  b'{"service": "/web"}', b'{"service": "a/"}'])
def test_bad_wake_requests_are_refused_with_a_clear_error(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_wake(body)
