"""The config model: valid files load, every invalid field is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nodeagent.config import (
    AgentConfig,
    AllowRule,
    ConfigError,
    RoutesConfig,
    ServerConfig,
    load_config,
    parse_config,
    redacted,
)

TOKEN = "0123456789abcdef0123"


def agent(**extra: object) -> dict[str, object]:
    return {"node": "edge-1", "server": "tls://tunnel.example.com:8443", "token": TOKEN, **extra}


def test_agent_config_loads_with_defaults() -> None:
    cfg = parse_config(AgentConfig, agent(allow=["127.0.0.1:8080", "10.0.0.0/8:80-443",
                                                 "db.local:5432", "[::1]:22", "10.9.0.0/16:*"]),
                       "agent.yaml")
    assert cfg.node == "edge-1" and cfg.keepalive.interval == 15
    assert cfg.allows("127.0.0.1", 8080)
    assert not cfg.allows("127.0.0.1", 8081)
    assert cfg.allows("10.2.3.4", 443) and not cfg.allows("10.2.3.4", 444)
    assert cfg.allows("DB.local", 5432) and not cfg.allows("db.local", 5433)
    assert cfg.allows("::1", 22) and not cfg.allows("127.0.0.1", 22)
    assert cfg.allows("10.9.200.1", 1) and cfg.allows("10.9.200.1", 65535)
    assert not cfg.allows("127.0.0.1", 8080, "udp")


def test_udp_allow_rules_allow_udp_only_and_take_either_spelling() -> None:
    cfg = AgentConfig.model_validate(agent(allow=[
        "udp/10.96.0.10:53", "UDP/[fd00::10]:53", {"cidr": "10.1.0.0/16", "protocol": "UDP"},
        "tcp/10.2.0.1:80"]))
    assert cfg.allows("10.96.0.10", 53, "udp") and not cfg.allows("10.96.0.10", 53, "tcp")
    assert cfg.allows("fd00::10", 53, "udp")
    assert cfg.allows("10.1.2.3", 9999, "udp") and not cfg.allows("10.1.2.3", 9999, "tcp")
    assert cfg.allows("10.2.0.1", 80, "tcp") and not cfg.allows("10.2.0.1", 80, "udp")


@pytest.mark.parametrize("doc,message", [
    (agent(allow=["127.0.0.1:70000"]), "allow[0].ports[0]: port '70000' out of range"),
    (agent(allow=["10.0.0.1/8:80"]), "allow[0]: '10.0.0.1/8' is not a valid CIDR"),
    (agent(allow=["127.0.0.1:90-80"]), "allow[0].ports[0]: port range 90-80 is reversed"),
    (agent(node="Edge_1"), "node: 'Edge_1' is not a valid node name"),
    (agent(server="http://x"), "server: 'http://x': use tls://"),
    # Read as the dialer reads it: these once passed and raised ValueError at start.
    (agent(server="tls://s:abc"), "server: 'tls://s:abc': invalid port"),
    (agent(server="tls://:8443"), "server: 'tls://:8443': no host"),
    (agent(server="tls://s:0"), "server: 'tls://s:0': port 0 cannot be dialed"),
    (agent(direct_servers=["wss://s:99999/t"]), "direct_servers: 'wss://s:99999/t': invalid"),
    (agent(metrics_listen=9100),
     "metrics_listen: 9100 is a number; write host:port as text, e.g. ':9100'"),
    (agent(controller="http://c:abc"), "controller: 'http://c:abc': the port is not a number"),
    (agent(controller="c:8090"), "controller: 'c:8090': use http://host:port or https://"),
    (agent(token="short"), "token: token is shorter than 16 characters"),
    (agent(colour="blue"), "colour: unknown field (typo?)"),
    ({"node": "a", "server": "tls://s:1"}, "no credentials"),
    (agent(keepalive={"interval": -1}), "keepalive.interval: should be greater than 0"),
    (agent(allow=[{"cidr": 5, "ports": [80]}]), "allow[0].cidr: 5 is not a CIDR"),
    ({"server": "tls://s:1", "token": TOKEN}, "node: required field is missing"),
    (agent(intercept={"rules": [{"name": "dns", "protocol": "udp", "ports": [53],
                                 "destinations": ["10.0.0.0/8"]}]}),
     "intercept rule 'dns': UDP interception needs mode tproxy"),
    (agent(allow=["udp/10.0.0.0/8:99999"]), "allow[0].ports[0]: port '99999' out of range"),
    (agent(allow=[{"cidr": "10.0.0.0/8", "protocol": "sctp"}]), "allow[0].protocol"),
    (agent(intercept={"mode": "tproxy", "rules": [{
        "name": "dns", "protocol": "udp", "destinations": ["10.0.0.10/32"],
        "dns_zones": ["cloud.internal"]}]}), "dns_zones and dns_resolver go together"),
    (agent(intercept={"mode": "tproxy", "rules": [{
        "name": "dns", "destinations": ["10.0.0.10/32"], "dns_zones": ["cloud.internal"],
        "dns_resolver": "10.0.0.2:53"}]}), "dns_zones needs protocol udp"),
    (agent(intercept={"mode": "tproxy", "rules": [{
        "name": "dns", "protocol": "udp", "destinations": ["10.0.0.10/32"],
        "dns_zones": ["not a zone"], "dns_resolver": "10.0.0.2:53"}]}),
     "'not a zone' is not a DNS zone"),
    (agent(intercept={"mode": "tproxy", "rules": [{
        "name": "dns", "protocol": "udp", "destinations": ["10.0.0.10/32"],
        "dns_zones": ["cloud.internal"], "dns_resolver": "resolver.local:53"}]}),
     "dns_resolver must be an IP address"),
    (agent(intercept={"rules": [{"name": "a", "destinations": ["10.0.0.0/8", "10.1.0.0/16"]}]}),
     "intercept: intercept rule 'a': destinations: 10.1.0.0/16 overlaps 10.0.0.0/8"),
    (agent(intercept={"rules": [{"name": "p", "destinations": ["10.0.0.0/8"],
                                 "ports": [0]}]}), "intercept rule 'p'"),
])
def test_agent_config_errors_name_the_field(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(AgentConfig, doc, "agent.yaml")
    assert message in str(info.value)
    assert str(info.value).startswith("agent.yaml: ")


def server(**extra: object) -> dict[str, object]:
    return {"tunnel": {"url": "tcp://127.0.0.1:0", "insecure": True},
            "tokens": [{"node": "*", "token": TOKEN}], **extra}


def test_server_config_routes() -> None:
    cfg = parse_config(ServerConfig, server(
        tcp=[{"listen": ":2222", "node": "edge-1", "target": "127.0.0.1:22"}],
        http=[{"listen": "127.0.0.1:8080", "routes": [
            {"host": "App.Example.com", "path": "/api", "node": "edge-1",
             "target": "127.0.0.1:9000"},
            {"host": "*.example.com", "node": "edge-2", "target": "localhost:80"}]}]),
        "server.yaml")
    assert cfg.tcp[0].listen.host == "0.0.0.0" and cfg.tcp[0].listen.port == 2222
    assert cfg.http[0].routes[0].host == "app.example.com"
    assert cfg.routes().http == cfg.http


@pytest.mark.parametrize("doc,message", [
    ({"tunnel": "tls://0.0.0.0:8443", "tokens": [{"node": "*", "token": TOKEN}]},
     "needs a tls section"),
    ({"tunnel": "tcp://0.0.0.0:8443"}, "no way to authenticate agents"),
    (server(tokens=[{"node": "*", "token": TOKEN, "token_file": "/x"}]),
     "tokens[0]: give exactly one of token or token_file"),
    (server(tcp=[{"listen": ":2222", "node": "n", "target": "h:1"},
                 {"listen": ":2222", "node": "n", "target": "h:2"}]),
     "tcp[1] listens on 0.0.0.0:2222, already used by tcp[0]"),
    (server(http=[{"listen": ":80", "routes": [{"path": "api", "target": "h:1"}]}]),
     "http[0].routes[0].path: path 'api' must start with /"),
    (server(http=[{"listen": ":80", "routes": [{"host": "a b", "target": "h:1"}]}]),
     "is not a host name"),
    (server(tunnel={"url": "tcp://0.0.0.0:99999", "insecure": True}),
     "tunnel.url: 'tcp://0.0.0.0:99999': invalid port"),
    (server(tunnel={"url": "tcp://0.0.0.0", "insecure": True}), "tcp:// needs a port"),
    (server(tcp=[{"listen": ":2222", "node": "edge-1", "target": 22}]),
     "tcp[0].target: 22 is a number; write host:port as text, e.g. '127.0.0.1:22'"),
    (server(controller="https://c:0"), "controller: 'https://c:0': the port is not a number"),
    # One line each: the IPv4 | IPv6 union once gave a line per member in pydantic's words.
    (server(proxy_protocol_from=["10.0.0.0/33"]),
     "server.yaml: proxy_protocol_from[0]: '10.0.0.0/33' is not a CIDR (e.g. 10.0.0.0/8, "
     "fd00::/64)"),
    (server(node_cidrs={"edge-1": ["10.0.0.1/8"]}),
     "server.yaml: node_cidrs.edge-1[0]: '10.0.0.1/8' has host bits set; the network is "
     "10.0.0.0/8"),
])
def test_server_config_errors(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(ServerConfig, doc, "server.yaml")
    assert message in str(info.value)
    assert "lax-or-strict" not in str(info.value)


def test_a_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_bytes(b"\xff\xfenode: edge-1\n")  # UTF-16, as some editors save "Unicode"
    with pytest.raises(ConfigError) as info:
        load_config(AgentConfig, path)
    assert str(info.value) == f"{path}: not UTF-8 text (byte 0); save it as UTF-8"


def test_yaml_errors_give_line_numbers(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("node: edge-1\nserver: [unclosed\n")
    with pytest.raises(ConfigError, match=r"not valid YAML \(line 3"):
        load_config(AgentConfig, path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(AgentConfig, path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(AgentConfig, tmp_path / "missing.yaml")


def test_token_file_is_read_and_checked(tmp_path: Path) -> None:
    good = tmp_path / "token"
    good.write_text(TOKEN + "\n")
    cfg = parse_config(AgentConfig, {"node": "e", "server": "tls://s:1",
                                     "token_file": str(good)}, "a")
    assert cfg.read_token() == TOKEN
    bad = tmp_path / "short"
    bad.write_text("abc")
    cfg = parse_config(AgentConfig, {"node": "e", "server": "tls://s:1",
                                     "token_file": str(bad)}, "a")
    with pytest.raises(ConfigError, match="shorter than 16"):
        cfg.read_token()


def test_allow_rule_structured_form() -> None:
    rule = AllowRule.model_validate({"cidr": "192.168.0.0/16", "ports": ["80", 443],
                                     "protocol": "udp"})
    assert rule.allows("192.168.1.1", 443, "udp") and not rule.allows("192.168.1.1", 443, "tcp")


EXAMPLES = Path(__file__).parents[2] / "examples"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_examples_are_valid(path: Path) -> None:
    """The README points users at examples/; every file there must stay valid as the
    model changes (a new example is covered by being there)."""
    model = {"server": ServerConfig, "agent": AgentConfig}[path.stem.split("-")[0]]
    config = load_config(model, path)
    assert config.version == 0


def test_the_examples_are_there() -> None:
    assert {p.name for p in EXAMPLES.glob("*.yaml")} >= {"server.yaml", "agent.yaml"}


# Any document, however wrong, gives a ConfigError (one message naming fields) or a valid
# config: never another exception, which the CLI would print as a traceback.
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40),
                     st.floats(allow_nan=True), st.text(max_size=30),
                     st.sampled_from(["10.0.0.0/8", "10.1.0.0/16", "127.0.0.1:80", "*",
                                      "fd00::/64", "tls://s:1", "udp", "tcp", "tproxy",
                                      "0-70000", "eth0", "[::1]:5", "a" * 20]))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)),
    max_leaves=12)


def _docs(model: type, extra_keys: list[str]) -> st.SearchStrategy[dict[str, object]]:
    keys = st.sampled_from(sorted(model.model_fields) + extra_keys)  # type: ignore[attr-defined]
    return st.dictionaries(keys, _values, max_size=8)


_INTERCEPT = st.fixed_dictionaries({"rules": st.lists(st.dictionaries(
    st.sampled_from(["name", "protocol", "destinations", "ports", "source_interfaces",
                     "source_cidrs", "exclude", "via", "host_traffic"]), _values,
    max_size=6), max_size=3)}, optional={"mode": _values, "exclude": _values,
                                         "proxy_port": _values})


@pytest.mark.filterwarnings("error")
@settings(max_examples=300, deadline=None)
@given(doc=_docs(AgentConfig, ["nonsense"]), intercept=st.none() | _INTERCEPT)
def test_any_agent_document_is_valid_or_a_config_error(
        doc: dict[str, object], intercept: dict[str, object] | None) -> None:
    if intercept is not None:
        doc = {**doc, "intercept": intercept}
    try:
        parse_config(AgentConfig, doc, "agent.yaml")
    except ConfigError as exc:
        assert str(exc).startswith("agent.yaml")


@pytest.mark.filterwarnings("error")
@settings(max_examples=300, deadline=None)
@given(doc=_docs(ServerConfig, ["nonsense"]))
def test_any_server_document_is_valid_or_a_config_error(doc: dict[str, object]) -> None:
    try:
        parse_config(ServerConfig, doc, "server.yaml")
    except ConfigError as exc:
        assert str(exc).startswith("server.yaml")


def test_tokens_in_clear_need_an_explicit_insecure() -> None:
    with pytest.raises(ConfigError, match="tokens would cross the network in clear"):
        parse_config(ServerConfig, {"tunnel": "tcp://127.0.0.1:0",
                                    "tokens": [{"node": "edge-1", "token": TOKEN}]},
                     "server.yaml")
    agent = {"node": "edge-1", "server": "ws://cloud:80/t", "token": TOKEN}
    with pytest.raises(ConfigError, match="the token would cross the network in clear"):
        parse_config(AgentConfig, agent, "agent.yaml")
    assert parse_config(AgentConfig, {**agent, "insecure": True}, "agent.yaml").insecure


def test_redacted_hides_every_secret_value_and_keeps_the_shape() -> None:
    routes = RoutesConfig(ingress={"tls": [{"name": "ns/web", "hosts": ["a.test"],
                                            "cert_pem": "CERT", "key_pem": "PRIVATE KEY"}]})
    doc = redacted(routes.model_dump(mode="json"))
    assert doc["ingress"]["tls"][0] == {"name": "ns/web", "hosts": ["a.test"],
                                        "cert_pem": "CERT", "key_pem": "[redacted]"}
    server = parse_config(ServerConfig, server_doc_with_token(), "server.yaml")
    text = json.dumps(redacted(server.model_dump(mode="json")))
    assert TOKEN not in text and "[redacted]" in text


def server_doc_with_token() -> dict[str, object]:
    return {"tunnel": {"url": "tcp://127.0.0.1:0", "insecure": True},
            "tokens": [{"node": "edge-1", "token": TOKEN}]}


def test_protected_addresses_need_a_rule_inside_their_range() -> None:
    """The egress floor: loopback, link-local, "this host" and the config's `protected`
    ranges are refused unless a rule's CIDR lies inside every protected range holding the
    address; a wider rule covering them does not count."""
    wide = RoutesConfig(egress=("0.0.0.0/0:*", "::/0:*"),  # type: ignore[arg-type]
                        protected=("10.96.0.0/12", "172.18.0.2/32"))  # type: ignore[arg-type]
    for host in ("169.254.169.254", "127.0.0.1", "127.9.9.9", "0.0.0.0", "::1", "fe80::1",
                 "::ffff:169.254.169.254", "::ffff:127.0.0.1", "10.96.0.1", "172.18.0.2"):
        assert wide.check_egress("n1", host, 80) == "protected", host
    assert wide.check_egress("n1", "203.0.113.5", 80) is None
    assert wide.check_egress("n1", "2001:db8::1", 80) is None
    assert RoutesConfig().check_egress("n1", "203.0.113.5", 80) == "not_allowed"
    named = RoutesConfig(egress=("169.254.169.254/32:80", "10.96.0.0/12:443"),  # type: ignore[arg-type]
                         protected=("10.96.0.0/12", "10.96.0.1/32"))  # type: ignore[arg-type]
    assert named.check_egress("n1", "169.254.169.254", 80) is None
    assert named.check_egress("n1", "169.254.169.254", 81) == "not_allowed"
    assert named.check_egress("n1", "169.254.169.253", 80) == "not_allowed"
    assert named.check_egress("n1", "10.96.5.5", 443) is None  # the Service range, named
    # The apiserver's ClusterIP sits in the named Service range, but is protected on its
    # own: the Service range's rule is wider than 10.96.0.1/32.
    assert named.check_egress("n1", "10.96.0.1", 443) == "protected"


def test_scoped_egress_applies_to_the_scopes_nodes_only() -> None:
    routes = RoutesConfig(egress=("10.1.0.0/16:80",),  # type: ignore[arg-type]
                          scopes=[{"name": "edge", "nodes": ["a"], "egress": ["10.2.0.0/16:*"]},
                                  {"name": "all", "nodes": ["*"], "egress": ["10.3.0.0/16:*"]}])
    assert routes.egress_allows("10.2.0.1", 22, node="a")
    assert not routes.egress_allows("10.2.0.1", 22, node="b")
    for node in ("a", "b"):
        assert routes.egress_allows("10.1.0.1", 80, node=node)
        assert routes.egress_allows("10.3.0.1", 80, node=node)
    # model_copy (how versions are stamped) keeps the index.
    assert routes.model_copy(update={"version": 3}).egress_allows("10.2.0.1", 22, node="a")


def test_http_limits_have_safe_defaults_and_can_be_relaxed() -> None:
    default = parse_config(ServerConfig, server_doc_with_token(), "server.yaml")
    assert default.http_limits.max_connections_per_client == 256
    relaxed = parse_config(ServerConfig, {**server_doc_with_token(), "http_limits": {
        "max_connections_per_client": None, "min_body_rate": None}}, "server.yaml")
    assert relaxed.http_limits.max_connections_per_client is None
    with pytest.raises(ConfigError, match=r"http_limits\.max_connections"):
        parse_config(ServerConfig, {**server_doc_with_token(), "http_limits": {
            "max_connections": 0}}, "server.yaml")
