"""Loading a config file as a user meets it: relative paths taken from the file's
directory (so `--check` works from anywhere), every problem of a file reported at once,
pydantic's Python words translated into YAML's, and one rule for tokens inline or in a
file (whitespace and a UTF-8 byte-order mark dropped, non-ASCII refused)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeagent.config import (
    AgentConfig,
    ConfigError,
    ServerConfig,
    TokenEntry,
    load_config,
    parse_config,
)
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    agent_config,
    echo_through,
    listen_port,
    make_certs,
    run_upstream,
    server_config,
)

TOKEN = "0123456789abcdef0123"


def check(role: str, config: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nodeagent", role, "--config", str(config),
                           "--check"], cwd=cwd, capture_output=True, text=True, timeout=60)


def write(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture
def conf(tmp_path: Path) -> Path:
    """A directory with certificates and a token file, as `nodeagent certs` leaves it."""
    d = tmp_path / "conf"
    d.mkdir()
    make_certs(d)
    (d / "edge-1.token").write_text(TOKEN + "\n")
    return d


SERVER = {"tunnel": "tls://127.0.0.1:8443",
          "tls": {"cert_file": "server.crt", "key_file": "server.key"},
          "tokens": [{"node": "edge-1", "token_file": "edge-1.token"}],
          "debug_socket": "server.sock"}
AGENT = {"node": "edge-1", "server": "tls://localhost:8443", "token_file": "edge-1.token",
         "tls": {"ca_file": "ca.crt"}, "allow": ["127.0.0.1:22"]}


def test_relative_paths_are_relative_to_the_file(conf: Path, tmp_path: Path) -> None:
    server = write(conf / "server.yaml", SERVER)
    agent = write(conf / "agent.yaml", AGENT)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for role, path in (("server", server), ("agent", agent)):
        done = check(role, path, cwd=elsewhere)
        assert done.returncode == 0, done.stderr
        assert ": valid." in done.stdout
    # Given relative to the working directory, the file still finds its neighbours.
    assert check("server", Path("conf/server.yaml"), cwd=tmp_path).returncode == 0
    loaded = load_config(ServerConfig, Path(conf / "server.yaml"))
    assert loaded.tls is not None and loaded.tls.cert_file == conf / "server.crt"
    assert loaded.tokens[0].token_file == conf / "edge-1.token"
    assert loaded.debug_socket == conf / "server.sock"
    # Absolute paths stay; a document that is no file (flags) has no base.
    absolute = load_config(AgentConfig, write(conf / "abs.yaml",
                                              {**AGENT, "token_file": "/etc/t"}))
    assert absolute.token_file == Path("/etc/t")
    assert parse_config(AgentConfig, AGENT, "flags").token_file == Path("edge-1.token")


def test_every_problem_of_a_file_at_once(conf: Path, tmp_path: Path) -> None:
    # Fields: each bad one.
    bad_fields = write(conf / "fields.yaml", {
        **SERVER, "tcp": [{"listen": "0.0.0.0:99999", "node": "edge-1",
                           "target": "127.0.0.1:22"}],
        "http": "0.0.0.0:8080", "replicas": "lots"})
    done = check("server", bad_fields, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines()[1:] == [
        f"{bad_fields}: tcp[0].listen: port '99999' out of range 0-65535",
        f"{bad_fields}: http: should be a list, not text",
        f"{bad_fields}: replicas: should be a whole number, not text"], done.stderr
    # Across fields: each broken rule, not only the first.
    across = dict(SERVER, tunnel="tls://0.0.0.0:8443", replicas=2, tls=None, tokens=[],
                  tcp=[{"listen": "0.0.0.0:2222", "node": "a", "target": "127.0.0.1:22"},
                       {"listen": "0.0.0.0:2222", "node": "b", "target": "127.0.0.1:22"}])
    with pytest.raises(ConfigError) as info:
        parse_config(ServerConfig, across, "s.yaml")
    lines = str(info.value).splitlines()
    assert [line.split(": ", 2)[2][:20] for line in lines] == [
        "tcp[1] listens on 0.", "tunnel tls://0.0.0.0", "no way to authentica",
        "replicas > 1 needs a"], lines
    # The files it names: each missing one.
    missing = write(conf / "missing.yaml", {
        **SERVER, "tls": {"cert_file": "nope.crt", "key_file": "server.key"},
        "tokens": [{"node": "edge-1", "token_file": "nope.token"},
                   {"node": "edge-2", "token_file": "gone.token"}]})
    done = check("server", missing, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines()[1:] == [
        f"{missing}: tls.cert_file: {conf}/nope.crt: no such file",
        f"{missing}: tokens[0].token_file: cannot read {conf}/nope.token: No such file or "
        "directory",
        f"{missing}: tokens[1].token_file: cannot read {conf}/gone.token: No such file or "
        "directory"], done.stderr
    agent = write(conf / "agent-missing.yaml", {**AGENT, "tls": {"ca_file": "nope.crt"},
                                                 "token_file": "nope.token"})
    done = check("agent", agent, cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 3, done.stderr
    assert "tls.ca_file" in done.stderr and "token_file" in done.stderr


@pytest.mark.parametrize(("doc", "message"), [
    ({"allow": "127.0.0.1:22"}, "allow: should be a list, not text"),
    ({"allow": ["127.0.0.1:22"], "keepalive": "often"},
     "keepalive: should be a mapping (key: value), not text"),
    ({"allow": ["127.0.0.1:22"], "keepalive": {"interval": "x"}},
     "keepalive.interval: should be a number, not text"),
    ({"allow": ["127.0.0.1:22"], "insecure": "maybe"},
     "insecure: should be true or false, not text"),
    ({"allow": ["127.0.0.1:22"], "socket_mark": 1.5},
     "socket_mark: should be a whole number"),
    ({"allow": ["127.0.0.1:22"], "keepalive": {"interval": 0}},
     "keepalive.interval: should be greater than 0"),
])
def test_errors_speak_yaml_not_python(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(AgentConfig, {**AGENT, **doc}, "agent.yaml")
    text = str(info.value)
    assert f"agent.yaml: {message}" in text, text
    for python in ("tuple", "dict", "Input should", "valid integer", "float"):
        assert python not in text, text


@pytest.mark.parametrize("written", [
    TOKEN, f"{TOKEN}\n", f"  {TOKEN}\r\n", f"\ufeff{TOKEN}\n", f"\ufeff{TOKEN}\r\n",
])
def test_a_token_reads_the_same_inline_and_from_a_file(tmp_path: Path, written: str) -> None:
    path = tmp_path / "t"
    path.write_text(written, encoding="utf-8")
    from_file = TokenEntry(node="edge-1", token_file=path).read()
    inline = TokenEntry(node="edge-1", token=written).read()
    agent = parse_config(AgentConfig, {**AGENT, "token_file": None, "token": written}, "a")
    assert from_file == inline == agent.read_token() == TOKEN


@pytest.mark.parametrize(("written", "message"), [
    ("short\n", "token is shorter than 16 characters"),
    ("\ufeff  short  ", "token is shorter than 16 characters"),
    ("0123456789abcdéf0123", "not printable ASCII (U+00E9)"),
    ("0123456789 abcdef0123", "not printable ASCII (U+0020)"),
])
def test_a_bad_token_is_refused_alike_inline_and_in_a_file(tmp_path: Path, written: str,
                                                          message: str) -> None:
    path = tmp_path / "t"
    path.write_text(written, encoding="utf-8")
    with pytest.raises(ConfigError) as from_file:
        TokenEntry(node="edge-1", token_file=path).read()
    with pytest.raises(ConfigError) as inline:
        parse_config(ServerConfig, {**SERVER, "tokens": [{"node": "e", "token": written}]},
                     "s.yaml")
    for exc in (from_file.value, inline.value):
        assert message in str(exc), exc
        assert "abcd" not in str(exc)  # never the token itself


def test_a_token_file_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "t"
    path.write_bytes(b"\xff\xfe" + TOKEN.encode("utf-16-le"))  # Notepad's "Unicode"
    with pytest.raises(ConfigError, match="not UTF-8 text; a token is printable ASCII"):
        TokenEntry(node="edge-1", token_file=path).read()


@pytest.mark.needs("root")  # the agent marks its tunnel socket (SO_MARK)
def test_a_bom_token_file_meets_an_inline_token_with_spaces(tmp_path: Path) -> None:
    """Real processes: the server's inline token has spaces around it, the agent's token
    file a byte-order mark and CRLF; the agent registers and traffic flows."""
    certs = make_certs(tmp_path)
    (tmp_path / "edge-1.token").write_text(f"\ufeff{TOKEN}\r\n", encoding="utf-8")
    with run_upstream() as upstream:
        scfg = server_config(tmp_path, certs, upstream)
        scfg["tokens"] = [{"node": "edge-1", "token": f"  {TOKEN} "}]
        acfg = agent_config(tmp_path, certs, upstream, scfg["tunnel"])
        del acfg["token"]
        acfg["token_file"] = "edge-1.token"  # relative to agent.yaml in tmp_path
        server = NodeagentProcess("server", scfg, tmp_path, "server").start()
        agent = NodeagentProcess("agent", acfg, tmp_path, "agent")
        try:
            server.wait_ready()
            agent.start().wait_ready()
            server.wait_for(lambda s: any(a["node"] == "edge-1" for a in s["agents"]),
                            what="edge-1 connected")
            assert echo_through(listen_port(server, 0), b"x" * 5000) == b"x" * 5000
        finally:
            agent.kill()
            server.kill()
