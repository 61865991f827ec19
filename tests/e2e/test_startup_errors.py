"""A valid config this host cannot honour ends the process with one line naming the setting
and the address and saying what to do, exit code 3, no traceback: each of the nine
listeners on an address another process holds, a privileged port without the capability,
an agent without CAP_NET_ADMIN, and a server with workers (which stops rather than
restarting them). Real processes: a port (or debug socket) held by
another process first, then `nodeagent server|agent` started on it."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import (
    Certs,
    Upstream,
    agent_config,
    free_port,
    make_certs,
    server_config,
)

pytestmark = pytest.mark.needs("root")  # the agent's SO_MARK, and setpriv

UPSTREAM = Upstream(http_port=9, echo_port=9)  # nothing is dialed: the start fails first


@pytest.fixture
def certs(tmp_path: Path) -> Certs:
    return make_certs(tmp_path)


@pytest.fixture
def held() -> Iterator[Callable[[str], str]]:
    """Holds an address the way another process would: `held("tcp")` a listening TCP
    port on 127.0.0.1 ("127.0.0.1:PORT"), `held(path)` a live Unix socket there."""
    socks: list[socket.socket] = []

    def hold(what: str) -> str:
        if what == "tcp":
            sock = socket.create_server(("127.0.0.1", 0))
            socks.append(sock)
            return f"127.0.0.1:{sock.getsockname()[1]}"
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(what)
        sock.listen()
        socks.append(sock)
        return what

    yield hold
    for sock in socks:
        sock.close()


def ends_with_one_line(proc: NodeagentProcess, expected: str, timeout: float = 30) -> str:
    """The process exits 3 by itself, its last line is `expected` (which names the setting
    and the address), and there is no traceback."""
    assert proc.proc is not None
    try:
        code = proc.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"{proc.name} did not exit:\n{proc.logs()}") from None
    logs = proc.logs()
    assert code == 3, logs
    assert "Traceback" not in logs and "ExceptionGroup" not in logs, logs
    last = logs.strip().splitlines()[-1]
    assert last == expected, logs
    return last


IN_USE = ("address already in use: another process listens there (`ss -ltnp 'sport = "
          ":{port}'` shows which); stop it or choose another port")


def server_cases(tmp: Path, certs: Certs, address: str) -> dict[str, dict[str, Any]]:
    """The server's seven listeners, each on `address`: the config that puts it there."""
    base = server_config(tmp, certs, UPSTREAM)
    base["tcp"] = base["tcp"][:1]
    return {
        "tunnel": {"tunnel": f"tls://{address}"},
        "tcp[0].listen": {"tcp": [{**base["tcp"][0], "listen": address}]},
        "http[0].listen": {"http": [{**base["http"][0], "listen": address}]},
        "metrics_listen": {"metrics_listen": address},
        "ingress_http": {"ingress_http": address},
        "connect.listen": {"connect": {"listen": address,
                                       "tls": {"client_ca_file": str(certs.ca)}}},
        "debug_socket": {"debug_socket": address},
    }


@pytest.mark.parametrize("setting", ["tunnel", "tcp[0].listen", "http[0].listen",
                                     "metrics_listen", "ingress_http", "connect.listen",
                                     "debug_socket"])
def test_a_server_listener_on_an_address_in_use(tmp_path: Path, certs: Certs,
                                                held: Callable[[str], str],
                                                setting: str) -> None:
    address = held(str(tmp_path / "taken.sock") if setting == "debug_socket" else "tcp")
    config = server_config(tmp_path, certs, UPSTREAM)
    config["tcp"] = config["tcp"][:1]
    config.update(server_cases(tmp_path, certs, address)[setting])
    server = NodeagentProcess("server", config, tmp_path, "server").start()
    if setting == "debug_socket":
        why = ("another process is serving it (a second agent or server on this host?): "
               "stop it, or choose another path")
    else:
        why = IN_USE.format(port=address.rpartition(":")[2])
    ends_with_one_line(server, f"nodeagent server: {server.config_path}: {setting}: "
                               f"cannot listen on {address}: {why}")


@pytest.mark.parametrize("setting", ["metrics_listen", "debug_socket"])
def test_an_agent_listener_on_an_address_in_use(tmp_path: Path, certs: Certs,
                                                held: Callable[[str], str],
                                                setting: str) -> None:
    address = held(str(tmp_path / "taken.sock") if setting == "debug_socket" else "tcp")
    config = agent_config(tmp_path, certs, UPSTREAM, f"tls://127.0.0.1:{free_port()}",
                          **{setting: address})
    agent = NodeagentProcess("agent", config, tmp_path, "agent").start()
    if setting == "debug_socket":
        why = ("another process is serving it (a second agent or server on this host?): "
               "stop it, or choose another path")
    else:
        why = IN_USE.format(port=address.rpartition(":")[2])
    ends_with_one_line(agent, f"nodeagent agent: {agent.config_path}: {setting}: "
                              f"cannot listen on {address}: {why}")


def run_without(capabilities: str, role: str, proc: NodeagentProcess) -> NodeagentProcess:
    """`proc` started as root without `capabilities` (setpriv drops them from the bounding
    set, so the exec'd process never has them)."""
    proc.write_config()
    with proc.log_path.open("ab") as log:
        proc.proc = subprocess.Popen(
            ["setpriv", "--bounding-set", capabilities, *_python(), "-m", "nodeagent", role,
             "--config", str(proc.config_path)], stdout=log, stderr=subprocess.STDOUT)
    return proc


def _python() -> list[str]:
    import sys

    return [sys.executable]


@pytest.mark.needs("setpriv")
def test_a_privileged_port_without_the_capability(tmp_path: Path, certs: Certs) -> None:
    config = server_config(tmp_path, certs, UPSTREAM)
    config["tcp"] = config["tcp"][:1]
    config["http"][0]["listen"] = "127.0.0.1:81"
    server = run_without("-net_bind_service", "server",
                         NodeagentProcess("server", config, tmp_path, "server"))
    ends_with_one_line(server, f"nodeagent server: {server.config_path}: http[0].listen: "
                               "cannot listen on 127.0.0.1:81: permission denied: port 81 "
                               "is below 1024, which needs root or CAP_NET_BIND_SERVICE; "
                               "grant it, or choose a port above 1023")


@pytest.mark.needs("setpriv")
def test_an_agent_without_net_admin(tmp_path: Path, certs: Certs) -> None:
    config = agent_config(tmp_path, certs, UPSTREAM, f"tls://127.0.0.1:{free_port()}")
    # SO_MARK takes CAP_NET_ADMIN (or CAP_NET_RAW, since Linux 5.17): drop both.
    agent = run_without("-net_admin,-net_raw", "agent",
                        NodeagentProcess("agent", config, tmp_path, "agent"))
    ends_with_one_line(agent, f"nodeagent agent: {agent.config_path}: socket_mark: cannot "
                              "mark the agent's sockets with 0x100000 (SO_MARK needs "
                              "CAP_NET_ADMIN): run the agent as root or with CAP_NET_ADMIN, "
                              "as the DaemonSet does (capabilities: add: [NET_ADMIN])")


def test_workers_stop_instead_of_restarting(tmp_path: Path, certs: Certs,
                                            held: Callable[[str], str]) -> None:
    """With --workers, each worker says it once and the server stops (a restart would
    only say it again), with the workers' exit code."""
    address = held("tcp")
    config = server_config(tmp_path, certs, UPSTREAM, tunnel_port=free_port())
    config["tcp"] = config["tcp"][:1]
    config["tcp"][0]["listen"] = f"127.0.0.1:{free_port()}"
    config["http"][0]["listen"] = address
    server = NodeagentProcess("server", config, tmp_path, "server",
                              extra_args=("--workers", "2")).start()
    assert server.proc is not None
    assert server.proc.wait(60) == 3, server.logs()
    logs = server.logs()
    assert "Traceback" not in logs and "restarting" not in logs, logs
    assert f"http[0].listen: cannot listen on {address}: address already in use" in logs


@pytest.mark.parametrize("flag", ["--listen", "--metrics-listen"])
def test_a_controller_listener_on_an_address_in_use(tmp_path: Path, held: Callable[[str], str],
                                                    flag: str) -> None:
    """The controller's config stream and health listeners: flags, named as flags."""
    from nodeagent.testing.fakekube.localcluster import FakeApiServer

    address = held("tcp")
    fake = FakeApiServer(tmp_path / "kubeconfig", "admin-token-0123456789")
    try:
        other = "--metrics-listen" if flag == "--listen" else "--listen"
        controller = NodeagentProcess(
            "controller", {"debug_socket": str(tmp_path / "unused.sock")}, tmp_path,
            "controller", args=["--kubeconfig", str(fake.kubeconfig), "--identity", "c-1",
                                flag, address, other, f"127.0.0.1:{free_port()}"]).start()
        ends_with_one_line(controller, f"nodeagent controller: flags: {flag}: cannot listen "
                                       f"on {address}: "
                                       + IN_USE.format(port=address.rpartition(":")[2]),
                           timeout=60)
    finally:
        fake.close()
