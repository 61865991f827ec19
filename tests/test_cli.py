"""CLI usage errors: one line a human can act on, exit code 2, nothing started."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from nodeagent import cli
from nodeagent.ops.debugcli import NODE_VIEWS
from nodeagent.trust import pki


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "nodeagent", *args], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.parametrize(("args", "message"), [
    (["agent"], "nodeagent agent: error: give --config FILE (standalone) or --controller "
                "URL with its flags\nrun 'nodeagent agent --help' for usage"),
    (["server"], "give --config FILE (standalone) or --controller URL"),
    (["agent", "--config", "a.yaml", "--controller", "http://c:8090"], "not both"),
    # Controller-mode flags beside --config were once ignored without a word.
    (["agent", "--config", "a.yaml", "--metrics-listen", ":9100"],
     "not both (--metrics-listen: with --config, set that in the file)"),
    (["server", "--config", "s.yaml", "--handshake-rate", "5", "--debug-socket", "/x"],
     "not both (--handshake-rate, --debug-socket: with --config, set that in the file)"),
    (["agent", "--controller", "http://c:8090"],
     "controller mode needs --node (or NODE_NAME), --server, --token-file, --ca-file"),
    (["agent", "--node", "edge-1", "--server", "tls://s:1", "--token-file", "/nonexistent",
      "--ca-file", "/x/ca.crt", "--controller", "ftp://c"],
     "--controller 'ftp://c': use http://host:port"),
    (["agent", "--node", "edge-1", "--server", "tls://s:1", "--token-file", "/nonexistent",
      "--ca-file", "/x/ca.crt", "--controller", "http://c:abc"],
     "--controller 'http://c:abc': the port is not a number in 1-65535"),
    (["server", "--controller", "http://c:99999", "--token-file", "/etc/hostname",
      "--ca-file", "/x/ca.crt", "--tls-cert", "/x.crt", "--tls-key", "/x.key"],
     "--controller 'http://c:99999': the port is not a number in 1-65535"),
    (["server", "--controller", "http://c:8090", "--token-file", "/nonexistent/t",
      "--ca-file", "/x/ca.crt",
      "--tunnel-listen", "tls://127.0.0.1:0", "--tls-cert", "/x.crt", "--tls-key", "/x.key"],
     "/nonexistent/t"),
    (["server", "--controller", "http://c:8090", "--token-file", "/etc/hostname"],
     "controller mode needs --ca-file, --tls-cert, --tls-key"),
    (["server", "--controller", "http://c:8090", "--token-file", "/etc/hostname",
      "--ca-file", "/x/ca.crt", "--tls-cert", "/x.crt", "--tls-key", "/x.key",
      "--connect-listen", "127.0.0.1:8132"],
     "--connect-listen needs --connect-client-ca"),
    (["server", "--controller", "http://c:8090", "--token-file", "/etc/hostname",
      "--ca-file", "/x/ca.crt", "--tls-cert", "/x.crt", "--tls-key", "/x.key",
      "--connect-uds", "/run/x.sock", "--connect-uds-mode", "0666"],
     "flags: connect.uds_mode: uds_mode 0o666 lets every local user in"),
    (["server", "--controller", "http://c:8090", "--token-file", "/etc/hostname",
      "--ca-file", "/x/ca.crt", "--tls-cert", "/x.crt", "--tls-key", "/x.key",
      "--workers", "0"], "--workers: 0 is not in 1-16"),
    (["server", "--config", "s.yaml", "--drain-seconds", "-1"],
     "argument --drain-seconds: -1: give 0 to 3600 seconds"),
    (["server", "--config", "s.yaml", "--shutdown-delay", "soon"],
     "argument --shutdown-delay: not a number of seconds: 'soon'"),
    (["controller", "--listen", "nowhere"], "--listen 'nowhere'"),
    (["controller", "--listen", "0.0.0.0:99999"],
     "--listen '0.0.0.0:99999': port '99999' out of range"),
    (["controller", "--kubeconfig", "/nonexistent/kubeconfig"],
     "Kubernetes credentials: cannot load kubeconfig /nonexistent/kubeconfig"),
    (["controller", "--heartbeat-seconds", "0.1"], "--heartbeat-seconds 0.1: give 1-600"),
    (["controller", "--heartbeat-seconds", "often"], "invalid float value: 'often'"),
    (["frobnicate"], "invalid choice"),
    (["debug", "streams", "--watch", "soon"], "--watch: not a number of seconds: 'soon'"),
    (["debug", "streams", "--watch", "0"], "--watch takes 0.1 to 3600 seconds"),
    (["debug", "sockets"], "invalid choice: 'sockets'"),
])
def test_usage_errors_exit_2_with_one_clear_line(args: list[str], message: str,
                                                 tmp_path: Path) -> None:
    result = run(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    # The error and a hint ('invalid config:' and the problem, or the problem and
    # 'run ... --help'): no validator's dump, no exception group.
    assert len(result.stderr.splitlines()) <= 2, result.stderr


def test_help_teaches_both_modes() -> None:
    for role, words in (("agent", ["standalone mode", "controller mode", "--node"]),
                        ("server", ["--ingress-https", "controller mode"]),
                        ("controller", ["Lease", "--lease-seconds"])):
        result = run(role, "--help")
        assert result.returncode == 0
        for word in words:
            assert word in result.stdout, (role, word)


def test_debug_help_maps_questions_to_views() -> None:
    result = run("debug", "--help")
    assert result.returncode == 0
    for word in ("tunnels", "streams", "--node", "--watch", "--json",
                 "is node X connected", "why did that request fail"):
        assert word in result.stdout, word


def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_flag_of_every_command_says_what_it_does() -> None:
    for parser in _parsers(cli.build_parser()):
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(
                    action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            assert action.help, (parser.prog, action.option_strings or action.dest)


def test_debug_help_names_every_view_and_those_node_filters() -> None:
    debug = next(p for p in _parsers(cli.build_parser()) if p.prog == "nodeagent debug")
    view = next(action for action in debug._actions if action.dest == "what")
    assert view.help is not None
    for name in cli.DEBUG_VIEWS:
        assert name in view.help, name
    node = next(action for action in debug._actions if action.dest == "node")
    assert node.help is not None
    for name in NODE_VIEWS:
        assert name in node.help, name


@pytest.mark.parametrize(("argv", "level", "fmt"), [
    (["server", "--config", "s.yaml"], "info", "text"),
    (["--log-level", "debug", "server", "--config", "s.yaml"], "debug", "text"),
    (["agent", "--config", "a.yaml", "--log-level", "error", "--log-format", "json"],
     "error", "json"),
    (["--log-format", "json", "controller", "--log-level", "warning"], "warning", "json"),
])
def test_log_flags_go_before_or_after_the_role(argv: list[str], level: str,
                                               fmt: str) -> None:
    args = cli.build_parser().parse_args(argv)
    assert (args.log_level, args.log_format) == (level, fmt)


def test_debug_watch_takes_its_default_before_the_view() -> None:
    parser = cli.build_parser()
    args = parser.parse_args(cli._watch_before_view(["debug", "--watch", "streams"]))
    assert args.what == "streams" and args.watch == 2.0
    args = parser.parse_args(cli._watch_before_view(["debug", "tunnels", "--watch"]))
    assert args.what == "tunnels" and args.watch == 2.0
    args = parser.parse_args(cli._watch_before_view(
        ["debug", "streams", "--node", "edge-1", "--watch", "0.5"]))
    assert (args.what, args.node, args.watch) == ("streams", "edge-1", 0.5)


TOKEN = "cli-token-0123456789abcdef"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA, a server certificate and key, a node certificate and key, a stranger's key,
    a file of junk and a directory, to point config fields at."""
    d = tmp_path_factory.mktemp("tls")
    ca = pki.create_ca("cli CA")
    ca.write(d / "ca.crt", d / "ca.key")
    pki.issue_server_certificate(ca, ["localhost"]).write(d / "server.crt", d / "server.key")
    pki.issue_client_certificate(ca, "edge-1").write(d / "edge.crt", d / "edge.key")
    pki.write_private_key(d / "stranger.key", pki.generate_key())
    (d / "junk").write_text("not PEM at all\n")
    (d / "short-token").write_text("short\n")
    (d / "adir").mkdir()
    return d


def check(role: str, tmp_path: Path, doc: dict[str, object],
          capsys: pytest.CaptureFixture[str]) -> subprocess.CompletedProcess[str]:
    """`nodeagent ROLE --config FILE --check`, in this process (the same parser and error
    printing as the command; no interpreter start-up per case)."""
    path = tmp_path / f"{role}.yaml"
    path.write_text(yaml.safe_dump(doc))
    capsys.readouterr()
    code = cli.main([role, "--config", str(path), "--check"])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess([role], code, out, err)


def server_doc(d: Path, **tls: str) -> dict[str, object]:
    return {"tunnel": "tls://127.0.0.1:0", "tokens": [{"node": "*", "token": TOKEN}],
            "tls": {"cert_file": str(d / "server.crt"), "key_file": str(d / "server.key"),
                    **{k: str(d / v) for k, v in tls.items()}}}


@pytest.mark.parametrize(("tls", "message"), [
    ({"cert_file": "missing.crt"}, "tls.cert_file: {d}/missing.crt: no such file"),
    ({"cert_file": "adir"}, "tls.cert_file: {d}/adir: is a directory, not a file"),
    ({"cert_file": "server.key"},
     "tls.cert_file: {d}/server.key: not a PEM certificate (it holds a private key)"),
    ({"key_file": "junk"}, "tls.key_file: {d}/junk: not a PEM private key"),
    ({"key_file": "server.crt"},
     "tls.key_file: {d}/server.crt: not a PEM private key (it holds a certificate)"),
    ({"key_file": "stranger.key"}, "tls.cert_file, tls.key_file: {d}/server.crt and "
                                   "{d}/stranger.key: certificate and key do not match"),
    ({"client_ca_file": "junk"}, "tls.client_ca_file: {d}/junk: not a PEM certificate"),
])
def test_server_check_names_the_file_the_field_and_the_problem(
        tls_files: Path, tmp_path: Path, tls: dict[str, str], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    result = check("server", tmp_path, server_doc(tls_files, **tls), capsys)
    assert result.returncode == 2, result.stderr
    assert f"{tmp_path}/server.yaml: {message.format(d=tls_files)}\n" in result.stderr
    assert "Traceback" not in result.stderr and "PEM lib" not in result.stderr


def test_server_check_names_an_unusable_connect_ca(
        tls_files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = {**server_doc(tls_files), "connect": {
        "listen": "127.0.0.1:0", "tls": {"client_ca_file": str(tls_files / "junk")}}}
    result = check("server", tmp_path, doc, capsys)
    assert result.returncode == 2, result.stderr
    assert f"connect.tls.client_ca_file: {tls_files}/junk: not a PEM certificate" in \
        result.stderr
    assert "Traceback" not in result.stderr


def test_server_check_names_an_unreadable_token_file(
        tls_files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = {**server_doc(tls_files), "tokens": [{"node": "a", "token": TOKEN},
                                               {"node": "*", "token_file": "/nonexistent/t"}]}
    result = check("server", tmp_path, doc, capsys)
    assert result.returncode == 2, result.stderr
    assert (f"{tmp_path}/server.yaml: tokens[1].token_file: cannot read /nonexistent/t: "
            "No such file or directory") in result.stderr


def agent_doc(d: Path, **fields: object) -> dict[str, object]:
    return {"node": "edge-1", "server": "tls://127.0.0.1:1", "token": TOKEN,
            "tls": {"ca_file": str(d / "ca.crt")}, **fields}


@pytest.mark.parametrize(("fields", "message"), [
    ({"tls": {"ca_file": "{d}/missing.crt"}}, "tls.ca_file: {d}/missing.crt: no such file"),
    ({"tls": {"ca_file": "{d}/ca.key"}},
     "tls.ca_file: {d}/ca.key: not a PEM certificate (it holds a private key)"),
    ({"tls": {"ca_file": "{d}/ca.crt", "cert_file": "{d}/junk", "key_file": "{d}/edge.key"}},
     "tls.cert_file: {d}/junk: not a PEM certificate"),
    ({"tls": {"ca_file": "{d}/ca.crt", "cert_file": "{d}/edge.crt", "key_file": "{d}/junk"}},
     "tls.key_file: {d}/junk: not a PEM private key"),
    ({"tls": {"ca_file": "{d}/ca.crt", "cert_file": "{d}/edge.crt",
              "key_file": "{d}/server.key"}},
     "tls.cert_file, tls.key_file: {d}/edge.crt and {d}/server.key: certificate and key do "
     "not match"),
    ({"token": None, "token_file": "{d}/short-token"},
     "token_file: {d}/short-token: token is shorter than 16 characters"),
])
def test_agent_check_names_the_file_the_field_and_the_problem(
        tls_files: Path, tmp_path: Path, fields: dict[str, object], message: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    filled = yaml.safe_load(yaml.safe_dump(fields).replace("{d}", str(tls_files)))
    doc = {k: v for k, v in agent_doc(tls_files, **filled).items() if v is not None}
    result = check("agent", tmp_path, doc, capsys)
    assert result.returncode == 2, result.stderr
    assert f"{tmp_path}/agent.yaml: {message.format(d=tls_files)}\n" in result.stderr
    assert "Traceback" not in result.stderr and "PEM lib" not in result.stderr


def test_check_accepts_good_files(tls_files: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    server = check("server", tmp_path, server_doc(tls_files, client_ca_file="ca.crt"), capsys)
    assert server.returncode == 0 and "valid" in server.stdout, server.stderr
    agent = check("agent", tmp_path, agent_doc(tls_files, tls={
        "ca_file": str(tls_files / "ca.crt"), "cert_file": str(tls_files / "edge.crt"),
        "key_file": str(tls_files / "edge.key")}), capsys)
    assert agent.returncode == 0 and "valid" in agent.stdout, agent.stderr


def test_the_command_prints_the_one_line(tls_files: Path, tmp_path: Path) -> None:
    """The real process: exit 2 and the line, nothing from ssl, no traceback."""
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump(server_doc(tls_files, key_file="junk")))
    result = run("server", "--config", str(path), "--check")
    assert result.returncode == 2
    assert result.stderr == (f"nodeagent server: invalid config:\n{path}: tls.key_file: "
                             f"{tls_files}/junk: not a PEM private key\n")


def test_controller_mode_flags_set_the_servers_handshake_admission(tmp_path: Path) -> None:
    """--handshake-rate/--handshake-burst reach the server's tunnel settings; a bad value
    is a config error naming the field, not a traceback."""
    from nodeagent.cli import build_parser
    from nodeagent.config import ConfigError
    from nodeagent.server.main import server_config_from_flags

    base = ["server", "--controller", "https://c:8090", "--token-file", str(tmp_path / "t"),
            "--ca-file", str(tmp_path / "ca"), "--tls-cert", str(tmp_path / "c"),
            "--tls-key", str(tmp_path / "k"), "--tunnel-listen", "tls://0.0.0.0:9443"]
    default = server_config_from_flags(build_parser().parse_args(base))
    assert (default.tunnel.handshake_rate, default.tunnel.handshake_burst) == (200, 200)
    config = server_config_from_flags(build_parser().parse_args(
        [*base, "--handshake-rate", "50", "--handshake-burst", "10"]))
    assert (config.tunnel.handshake_rate, config.tunnel.handshake_burst) == (50, 10)
    assert config.tunnel.url == "tls://0.0.0.0:9443"
    with pytest.raises(ConfigError, match="handshake_rate"):
        server_config_from_flags(build_parser().parse_args([*base, "--handshake-rate", "0"]))


def test_a_startup_failure_is_found_inside_the_nurseries_groups() -> None:
    """What a role's trio.run raises when a listener cannot bind: the failure inside
    nested exception groups, beside the cancellations it caused; anything else there is
    a bug and is not hidden."""
    import argparse

    import trio

    from nodeagent.config import StartupFailed

    failed = StartupFailed("metrics_listen", "cannot listen on 0.0.0.0:9090: in use")
    cancelled = trio.Cancelled._create()  # type: ignore[attr-defined]
    nested = BaseExceptionGroup("outer", [cancelled, BaseExceptionGroup("inner", [failed])])
    assert cli._startup_failure(nested) is failed
    assert cli._startup_failure(BaseExceptionGroup("x", [failed, ValueError()])) is None
    flags = argparse.Namespace(config=None)
    assert cli._setting(flags, failed) == "--metrics-listen: cannot listen on 0.0.0.0:9090: in use"
    from_file = argparse.Namespace(config=Path("server.yaml"))
    assert cli._setting(from_file, failed) == str(failed)
    assert cli._source(from_file) == "server.yaml" and cli._source(flags) == "flags"


@pytest.mark.parametrize("role", ["server", "agent"])
def test_the_shipped_examples_pass_check_with_their_files_in_place(
        role: str, tls_files: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`nodeagent ROLE --config examples/ROLE.yaml --check` once the files it names exist
    (it reads them: certificates, keys, tokens), as a newcomer's first run after
    `nodeagent certs`; /etc/nodeagent/ is moved under tmp_path."""
    (tmp_path / "tls").mkdir()
    for name in ("ca.crt", "server.crt", "server.key"):
        (tmp_path / "tls" / name).write_bytes((tls_files / name).read_bytes())
    (tmp_path / "tokens").mkdir()
    (tmp_path / "tokens" / "edge-1").write_text(TOKEN + "\n")
    example = Path(__file__).parents[1] / "examples" / f"{role}.yaml"
    path = tmp_path / f"{role}.yaml"
    path.write_text(example.read_text().replace("/etc/nodeagent/", f"{tmp_path}/"))
    capsys.readouterr()
    code = cli.main([role, "--config", str(path), "--check"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith(f"{path}: valid.")


def test_check_in_controller_mode_validates_the_flags_and_starts_nothing(
        tls_files: Path, tmp_path: Path) -> None:
    """--check with the controller-mode flags once started the role for real."""
    token = tmp_path / "token"
    token.write_text("a-projected-serviceaccount-token\n")
    d = tls_files
    server = run("server", "--controller", "https://c.invalid:8090", "--token-file", str(token),
                 "--ca-file", str(d / "ca.crt"), "--tls-cert", str(d / "server.crt"),
                 "--tls-key", str(d / "server.key"), "--check")
    assert server.returncode == 0, server.stderr
    assert server.stdout.startswith("flags: valid. tunnel wss://0.0.0.0:8443/tunnel")
    agent = run("agent", "--node", "edge-1", "--server", "wss://s.invalid:8443/tunnel",
                "--token-file", str(token), "--ca-file", str(d / "ca.crt"),
                "--controller", "https://c.invalid:8090", "--check")
    assert agent.returncode == 0, agent.stderr
    assert agent.stdout.startswith("flags: valid. node edge-1, server wss://s.invalid")
    # And what the flags name is read, as with a file.
    bad = run("server", "--controller", "https://c.invalid:8090", "--token-file", str(token),
              "--ca-file", str(d / "ca.crt"), "--tls-cert", str(d / "server.crt"),
              "--tls-key", str(d / "stranger.key"), "--check")
    assert bad.returncode == 2
    assert "certificate and key do not match" in bad.stderr


def test_the_readme_quickstart_runs_as_written(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The README's standalone quickstart: its `nodeagent certs` commands, then its
    server.yaml and agent.yaml (the first two YAML blocks) pass --check beside them."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    quickstart = readme.split("## Standalone quickstart", 1)[1]
    for line in re.findall(r"^\s*(nodeagent certs [^#\n]+)", quickstart, re.M)[:3]:
        assert cli.main([*line.split()[1:], "--dir", str(tmp_path)]) == 0, line
    server_yaml, agent_yaml = (textwrap.dedent(block) for block in
                               re.findall(r"```yaml\n(.*?)```", quickstart, re.S)[:2])
    for role, text in (("server", server_yaml), ("agent", agent_yaml)):
        path = tmp_path / f"{role}.yaml"
        path.write_text(text)
        capsys.readouterr()
        code = cli.main([role, "--config", str(path), "--check"])
        out, err = capsys.readouterr()
        assert code == 0, (role, err)
        assert out.startswith(f"{path}: valid.")
