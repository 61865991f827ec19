"""The config stream's wire contract, without sockets: paths, lines, heartbeats."""

from __future__ import annotations

import json

import pytest

from nodeagent.config import NodeConfig
from nodeagent.configstream.protocol import (
    HEARTBEAT_LINE,
    LineError,
    config_line,
    node_config_path,
    parse_config_path,
    parse_line,
    servers_config_path,
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
