"""The agent's `proxy` field and the proxy environment: which rules the agent dials with,
and errors that never show a proxy password."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from nodeagent.agent.main import run_agent
from nodeagent.config import AgentConfig, ConfigError, parse_config, redacted
from tunnel.proxy import DIRECT
from tunnel.transports import Endpoint

TOKEN = "0123456789abcdef0123"
SECRET = "pr0xy-secret"
SERVER = Endpoint("tls", "tunnel.example.com", 8443)


def agent(**extra: object) -> dict[str, object]:
    return {"node": "edge-1", "server": "tls://tunnel.example.com:8443", "token": TOKEN, **extra}


def test_explicit_proxy_field() -> None:
    cfg = parse_config(AgentConfig, agent(proxy=f"http://alice:{SECRET}@proxy.corp:3128"),
                       "agent.yaml")
    rules = cfg.proxy_rules({"HTTPS_PROXY": "http://other:1"})
    proxy = rules.for_endpoint(SERVER)
    assert proxy is not None and (proxy.host, proxy.password) == ("proxy.corp", SECRET)
    assert rules.describe() == "proxy http://alice:[redacted]@proxy.corp:3128"


def test_direct_ignores_the_environment() -> None:
    cfg = parse_config(AgentConfig, agent(proxy="direct"), "agent.yaml")
    assert cfg.proxy_rules({"HTTPS_PROXY": "http://p:3128"}) is DIRECT


def test_unset_reads_the_environment() -> None:
    cfg = parse_config(AgentConfig, agent(), "agent.yaml")
    rules = cfg.proxy_rules({"https_proxy": "socks5://p:1080", "NO_PROXY": ".internal"})
    assert str(rules.for_endpoint(SERVER)) == "socks5://p:1080"
    assert rules.for_endpoint(Endpoint("tls", "tunnel.internal", 443)) is None
    assert cfg.proxy_rules({}).for_endpoint(SERVER) is None


def test_bad_proxy_field_is_one_line_without_the_password() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(AgentConfig, agent(proxy=f"ftp://alice:{SECRET}@p:21"), "agent.yaml")
    assert str(info.value) == ("agent.yaml: proxy: unsupported proxy scheme 'ftp'; use "
                               "http://, socks5:// or socks5h://")


def test_bad_proxy_variable_is_a_config_error() -> None:
    cfg = parse_config(AgentConfig, agent(), "agent.yaml")
    with pytest.raises(ConfigError, match=r"^environment: HTTPS_PROXY: TLS to the proxy") as info:
        cfg.proxy_rules({"HTTPS_PROXY": f"https://alice:{SECRET}@p:3128"})
    assert SECRET not in str(info.value)


def test_check_names_the_proxy_redacted(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(agent(server="wss://tunnel.example.com/t",
                                         tls={"insecure_skip_verify": True})))
    monkeypatch.setenv("HTTPS_PROXY", f"http://alice:{SECRET}@proxy.corp:3128")
    assert run_agent(path, check=True) == 0
    out = capsys.readouterr().out
    assert "HTTPS_PROXY http://alice:[redacted]@proxy.corp:3128" in out
    assert SECRET not in out


def test_a_config_dump_keeps_the_proxy_but_not_its_password() -> None:
    cfg = parse_config(AgentConfig, agent(proxy=f"http://alice:{SECRET}@proxy.corp:3128"),
                       "agent.yaml")
    dump = redacted(cfg.model_dump(mode="json"))
    assert dump["proxy"] == "http://alice:[redacted]@proxy.corp:3128"
    assert dump["token"] == "[redacted]"
    assert SECRET not in str(dump)
    assert redacted({"proxy": "socks5://p:1080"}) == {"proxy": "socks5://p:1080"}
    assert redacted({"proxy": None}) == {"proxy": None}
