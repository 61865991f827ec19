"""Names the config accepts are whole-string matches: a pattern anchored with `$` also
matches before a final newline, so `edge-1\\n` would pass as a node name (and reach logs,
metric labels and dict keys) unless the whole string is matched."""

from __future__ import annotations

import pytest

from nodeagent.config import (
    DNS_LABEL,
    DNS_NAME,
    AgentConfig,
    ConfigError,
    ServerConfig,
    parse_config,
    valid_node_name,
)
from nodeagent.config.httprules import check_rule_host

TOKEN = "0123456789abcdef0123"
TRAILING = ["edge-1\n", "edge-1\r\n", "edge-1\n\n", "edge-1.example\n"]


@pytest.mark.parametrize("name", TRAILING)
def test_a_node_name_with_a_trailing_newline_is_refused(name: str) -> None:
    assert not valid_node_name(name)
    assert DNS_NAME.match(name) is None  # for callers that still use match()
    assert DNS_LABEL.match("edge\n") is None
    with pytest.raises(ConfigError, match="not a valid node name"):
        parse_config(AgentConfig, {"node": name, "server": "tls://t.example:8443",
                                   "token": TOKEN}, "agent.yaml")
    with pytest.raises(ConfigError, match="not a valid node name"):
        parse_config(ServerConfig, {"tunnel": {"url": "tcp://127.0.0.1:0", "insecure": True},
                                    "tokens": [{"node": name, "token": TOKEN}]}, "server.yaml")


@pytest.mark.parametrize("host", ["app.test\n", "*.app.test\n", "[::1]\n"])
def test_hosts_with_a_trailing_newline_are_refused(host: str) -> None:
    with pytest.raises(ValueError):
        check_rule_host(host)
    with pytest.raises(ConfigError):
        parse_config(ServerConfig, {
            "tunnel": {"url": "tcp://127.0.0.1:0", "insecure": True},
            "tokens": [{"node": "edge-1", "token": TOKEN}],
            "http": [{"listen": "127.0.0.1:0", "routes": [
                {"host": host, "node": "edge-1", "target": "127.0.0.1:80"}]}]}, "server.yaml")


@pytest.mark.parametrize("target", ["db.local\n:5432", "db.local\n\n:5432"])
def test_a_target_host_with_a_trailing_newline_is_refused(target: str) -> None:
    with pytest.raises(ConfigError, match="neither an IP address nor a DNS name"):
        parse_config(AgentConfig, {"node": "edge-1", "server": "tls://t.example:8443",
                                   "token": TOKEN, "allow": [target]}, "agent.yaml")


def test_valid_names_still_pass() -> None:
    assert valid_node_name("edge-1") and valid_node_name("a.b-c.d")
    assert check_rule_host("*.App.Test.") == "*.app.test"
