"""LoadBalancer Services end to end with real processes: the fake API server, two
controllers, a server and agents on two nodes (edge-1 at 127.0.0.1, edge-2 at
127.0.0.2), each node's "pods" being small TCP, UDP and DNS (dnslib) services that say
which node answered. The Services go in through the API; their address comes back in
their status and their ports carry TCP and UDP through the nodes' tunnels
(docs/loadbalancer.md). Standalone, the same ports come from the server's file."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeagent.controller.clustertunnel import CLUSTER_TUNNELS
from nodeagent.kube.resources import ENDPOINTSLICES, EVENTS, NODES, SERVICES
from nodeagent.ops.debug import fetch_debug
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import TOKEN, Certs, free_port
from nodeagent.testing.udp import dns_query, exchange, run_dns_server
from tests.e2e.test_kubernetes import (  # noqa: F401  (controllers: a fixture)
    NS,
    Api,
    add_token,
    controllers,
    pod,
    seed_identities,
    start_cluster_agent,
    start_cluster_server,
    wait_for,
    web_endpoint,
)

pytestmark = pytest.mark.needs("root")  # agents mark their sockets (SO_MARK)

NODE_IPS = {"edge-1": "127.0.0.1", "edge-2": "127.0.0.2"}
PUBLIC = "203.0.113.7"
CLASS = "nodeagent.io/tunnel"
PAYLOAD = b"ping-" * 4


@contextlib.contextmanager
def named_tcp_echo(host: str, name: str) -> Iterator[int]:
    """A TCP service that answers each connection's bytes with `name:` before them."""
    server = socket.create_server((host, 0))

    def serve(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(65536):
                conn.sendall(f"{name}:".encode() + data)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


@contextlib.contextmanager
def named_udp_echo(host: str, name: str) -> Iterator[int]:
    """A UDP service that answers each datagram with `name:` and the datagram."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, 0))

    def serve() -> None:
        while True:
            try:
                data, peer = sock.recvfrom(65535)
                sock.sendto(f"{name}:".encode() + data, peer)
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def tcp_say(port: int, payload: bytes = b"hi") -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    return got.decode()


def tcp_refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


def answers_from_both(ask: Callable[[], str | None], nodes: set[str], what: str) -> set[str]:
    """Ask until every node in `nodes` answered once (each ask is a new connection or
    flow: the next backend in turn)."""
    seen: set[str] = set()

    def check() -> bool:
        answer = ask()
        if answer:
            seen.add(answer)
        return seen >= nodes

    wait_for(check, what, timeout=20)
    return seen


@pytest.fixture
def two_nodes(controllers: dict[str, Any], tmp_path: Path,  # noqa: F811
              certs: Certs) -> Iterator[dict[str, Any]]:
    """A server (its LoadBalancer ports on 127.0.0.1) and the agents of edge-1 and
    edge-2, each node running a named TCP echo, a named UDP echo and a DNS server."""
    api: Api = controllers["api"]
    procs: list[NodeagentProcess] = controllers["procs"]
    seed_identities(api, tmp_path, certs)
    api.create(NODES, {"metadata": {"name": "edge-2"}})
    uid = pod(api, "nodeagent-agent-x2", "edge-2", "nodeagent-agent")
    add_token(api, "e2e-agent-token-edge-2-0123456789", namespace="nodeagent",
              service_account="nodeagent-agent", pod_name="nodeagent-agent-x2", pod_uid=uid,
              node_name="edge-2", node_uid="n2", audiences=["nodeagent"])
    (tmp_path / "agent-token-2").write_text("e2e-agent-token-edge-2-0123456789")
    for name, ip in NODE_IPS.items():
        api.replace_status(NODES, name, None, {"addresses": [
            {"type": "InternalIP", "address": ip}]})
    tunnel_port = free_port()
    controller_url = f"https://127.0.0.1:{controllers['ports']['c2']}"
    server = start_cluster_server(tmp_path, controller_url, tunnel_port, certs.server_cert,
                                  certs.server_key, "--load-balancer-host", "127.0.0.1")
    procs.append(server)
    server.wait_ready()
    agents = {}
    for name, token in (("edge-1", "agent-token"), ("edge-2", "agent-token-2")):
        agent = start_cluster_agent(tmp_path, controller_url, tunnel_port, node=name,
                                    token=token, name=name, sock=f"{name}.sock")
        procs.append(agent)
        agents[name] = agent
    for agent in agents.values():
        agent.wait_ready(timeout=30)
    server.wait_for(lambda s: {a["node"] for a in s["agents"]} == set(NODE_IPS),
                    what="both agents connected", timeout=30)
    with contextlib.ExitStack() as stack:
        tcp = {n: stack.enter_context(named_tcp_echo(ip, n)) for n, ip in NODE_IPS.items()}
        udp = {n: stack.enter_context(named_udp_echo(ip, n)) for n, ip in NODE_IPS.items()}
        dns = {n: stack.enter_context(run_dns_server(host=ip, address=f"10.0.0.{i + 1}"))
               for i, (n, ip) in enumerate(NODE_IPS.items())}
        yield {"api": api, "server": server, "tcp": tcp, "udp": udp, "dns": dns,
               "fake": controllers["fake"]}


def backend_slices(api: Api, service: str, ports: dict[str, dict[str, int]]) -> None:
    """One EndpointSlice per node for `service`: its pod's address and target ports
    ({node: {port name: number}}, the names ending in -udp are UDP)."""
    for node, named in ports.items():
        endpoint = web_endpoint(api, f"{service}-{node}", NODE_IPS[node], node)
        api.create(ENDPOINTSLICES, {
            "metadata": {"name": f"{service}-{node}", "namespace": NS,
                         "labels": {"kubernetes.io/service-name": service}},
            "addressType": "IPv4",
            "ports": [{"name": n, "port": p, "protocol": "UDP" if n.endswith("udp") else "TCP"}
                      for n, p in named.items()],
            "endpoints": [endpoint]})


def lb_service(name: str, ports: list[dict[str, Any]], cls: str | None = CLASS
               ) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": "LoadBalancer", "ports": ports}
    if cls:
        spec["loadBalancerClass"] = cls
    return {"metadata": {"name": name, "namespace": NS}, "spec": spec}


def condition(api: Api, name: str) -> dict[str, Any]:
    status = api.get(SERVICES, name, NS).get("status") or {}
    return next((c for c in status.get("conditions") or []
                 if c.get("type") == "LoadBalancerPortsError"), {})


def test_a_load_balancer_service_carries_tcp_udp_and_dns_to_pods_on_two_nodes(
        two_nodes: dict[str, Any]) -> None:
    api: Api = two_nodes["api"]
    tcp_port, udp_port, dns_port = free_port(), free_port(socket.SOCK_DGRAM), \
        free_port(socket.SOCK_DGRAM)
    api.create(CLUSTER_TUNNELS, {"metadata": {"name": "edge"}, "spec": {
        "loadBalancers": {"addresses": [PUBLIC]}}})
    api.create(SERVICES, lb_service("echo", [
        {"name": "tcp", "port": tcp_port, "protocol": "TCP"},
        {"name": "echo-udp", "port": udp_port, "protocol": "UDP"}]))
    backend_slices(api, "echo", {n: {"tcp": two_nodes["tcp"][n],
                                     "echo-udp": two_nodes["udp"][n]} for n in NODE_IPS})
    api.create(SERVICES, lb_service("dns", [{"name": "dns-udp", "port": dns_port,
                                             "protocol": "UDP"}]))
    backend_slices(api, "dns", {n: {"dns-udp": two_nodes["dns"][n].port} for n in NODE_IPS})

    # The servers' address, with each port, in the Service's status.
    wait_for(lambda: (api.get(SERVICES, "echo", NS).get("status") or {}).get(
        "loadBalancer", {}).get("ingress") == [{"ip": PUBLIC, "ipMode": "Proxy", "ports": [
            {"port": tcp_port, "protocol": "TCP"}, {"port": udp_port, "protocol": "UDP"}]}],
        "the Service's status shows the servers' address", timeout=20)
    assert condition(api, "echo")["status"] == "False"

    def tcp_node() -> str | None:
        answer = tcp_say(tcp_port, b"ping")
        return answer.split(":")[0] if answer.endswith(":ping") else None

    assert answers_from_both(tcp_node, set(NODE_IPS), "TCP from both nodes") == set(NODE_IPS)

    def udp_node() -> str | None:
        # A new socket: a new flow. The answer's "edge-N:" prefix must stay within the
        # anti-amplification allowance (3x what the client sent).
        answer = exchange(udp_port, PAYLOAD, timeout=1)
        return answer.decode().split(":")[0] if answer and answer.endswith(PAYLOAD) \
            else None

    assert answers_from_both(udp_node, set(NODE_IPS), "UDP from both nodes") == set(NODE_IPS)

    def dns_answer() -> str | None:
        found = dns_query(dns_port, "web.svc.cloud.internal.", timeout=1, tries=1)
        return found[0] if found else None

    assert answers_from_both(dns_answer, {"10.0.0.1", "10.0.0.2"},
                             "DNS from both nodes") == {"10.0.0.1", "10.0.0.2"}
    dig = subprocess.run(["dig", "@127.0.0.1", "-p", str(dns_port), "+short", "+tries=3",
                          "+time=2", "web.svc.cloud.internal", "A"],
                         capture_output=True, text=True, timeout=30)
    assert dig.stdout.strip() in ("10.0.0.1", "10.0.0.2"), dig.stdout + dig.stderr

    # The debug view names the Service on each port, with both nodes' backends.
    view = fetch_debug(two_nodes["server"].socket, "/loadbalancers")
    rows = {(p["service"], p["protocol"], p["port"]): p for p in view["ports"]}
    echo_tcp = rows[(f"{NS}/echo", "tcp", tcp_port)]
    assert echo_tcp["state"] == "listening" and echo_tcp["accepted"] >= 2
    assert {b.split("/")[0] for b in echo_tcp["backends"]} == set(NODE_IPS)
    metrics = fetch_debug(two_nodes["server"].socket, "/metrics")
    assert 'nodeagent_loadbalancer_ports{protocol="udp",state="listening"} 2.0' in metrics


def test_conflicts_classless_services_and_deletion(two_nodes: dict[str, Any]) -> None:
    api: Api = two_nodes["api"]
    tcp_port, other_port = free_port(), free_port()
    api.create(SERVICES, lb_service("first", [{"name": "tcp", "port": tcp_port}]))
    backend_slices(api, "first", {"edge-1": {"tcp": two_nodes["tcp"]["edge-1"]}})
    wait_for(lambda: tcp_say(tcp_port) == "edge-1:hi", "first Service served")
    # A newer Service asks for the same TCP port: it gets an Event and a condition, the
    # port stays the older one's.
    api.create(SERVICES, lb_service("second", [{"name": "tcp", "port": tcp_port}]))
    backend_slices(api, "second", {"edge-2": {"tcp": two_nodes["tcp"]["edge-2"]}})
    wait_for(lambda: any(e.get("reason") == "PortConflict" and e["involvedObject"]["name"]
                         == "second" for e in api.list(EVENTS, NS)),
             "an Event on the losing Service", timeout=20)
    wait_for(lambda: condition(api, "second").get("reason") == "PortConflict",
             "the losing Service's condition", timeout=20)
    second = condition(api, "second")
    assert second["status"] == "True" and f"{NS}/first" in second["message"]
    ports = api.get(SERVICES, "second", NS)["status"]["loadBalancer"].get("ingress") or []
    assert ports == []  # no address known (no ClusterTunnel, no server Service address)
    assert all(tcp_say(tcp_port) == "edge-1:hi" for _ in range(4))

    # A class-less LoadBalancer Service is left to the cluster's default implementation
    # until a ClusterTunnel takes them.
    api.create(SERVICES, lb_service("plain", [{"name": "tcp", "port": other_port}],
                                    cls=None))
    backend_slices(api, "plain", {"edge-2": {"tcp": two_nodes["tcp"]["edge-2"]}})
    wait_for(lambda: condition(api, "second").get("reason") == "PortConflict", "settled")
    view = fetch_debug(two_nodes["server"].socket, "/loadbalancers")
    assert other_port not in {p["port"] for p in view["ports"]}
    assert tcp_refused(other_port)
    assert not (api.get(SERVICES, "plain", NS).get("status") or {}).get("conditions")
    api.create(CLUSTER_TUNNELS, {"metadata": {"name": "edge"}, "spec": {
        "loadBalancers": {"classless": True}}})
    wait_for(lambda: not tcp_refused(other_port) and tcp_say(other_port) == "edge-2:hi",
             "class-less Service served once a ClusterTunnel takes them", timeout=20)
    wait_for(lambda: condition(api, "plain").get("reason") == "NoPublicAddress",
             "its condition says no address is known yet")
    # Turned off again: its port closes and what nodeagent wrote leaves its status.
    tunnel = api.get(CLUSTER_TUNNELS, "edge")
    api.replace(CLUSTER_TUNNELS, {"metadata": tunnel["metadata"], "spec": {
        "loadBalancers": {"classless": False}}})
    wait_for(lambda: tcp_refused(other_port), "class-less port closed", timeout=20)
    wait_for(lambda: not condition(api, "plain"), "its condition removed", timeout=20)

    # The older Service goes: its port closes and the next in line gets it.
    api.delete(SERVICES, "first", NS)
    wait_for(lambda: tcp_say(tcp_port) == "edge-2:hi", "second Service took the port",
             timeout=20)
    wait_for(lambda: condition(api, "second").get("status") == "False",
             "its conflict resolved", timeout=20)
    api.delete(SERVICES, "second", NS)
    wait_for(lambda: tcp_refused(tcp_port), "port closed with the last Service", timeout=20)


@pytest.fixture
def standalone(tmp_path: Path, certs: Certs) -> Iterator[dict[str, Any]]:
    """A server from a file with one balanced TCP and one UDP port over two nodes."""
    tunnel = f"tls://127.0.0.1:{free_port()}"
    with contextlib.ExitStack() as stack:
        tcp = {n: stack.enter_context(named_tcp_echo(ip, n)) for n, ip in NODE_IPS.items()}
        udp = {n: stack.enter_context(named_udp_echo(ip, n)) for n, ip in NODE_IPS.items()}
        ports = {"tcp": free_port(), "udp": free_port(socket.SOCK_DGRAM)}
        scfg: dict[str, Any] = {
            "server_id": "cloud-test", "tunnel": tunnel,
            "tls": {"cert_file": str(certs.server_cert), "key_file": str(certs.server_key)},
            "tokens": [{"node": n, "token": TOKEN} for n in NODE_IPS],
            "load_balancer_host": "127.0.0.1",
            "load_balancers": [{"name": "apps/echo", "ports": [
                {"protocol": "tcp", "port": ports["tcp"], "backends": [
                    {"node": n, "target": f"{ip}:{tcp[n]}"} for n, ip in NODE_IPS.items()]},
                {"protocol": "udp", "port": ports["udp"], "backends": [
                    {"node": n, "target": f"{ip}:{udp[n]}"} for n, ip in NODE_IPS.items()]},
            ]}],
            "debug_socket": str(tmp_path / "server.sock"),
        }
        server = NodeagentProcess("server", scfg, tmp_path, "server").start()
        agents = [NodeagentProcess("agent", {
            "node": n, "server": tunnel, "token": TOKEN, "tls": {"ca_file": str(certs.ca)},
            "allow": [f"{ip}:{tcp[n]}", f"udp/{ip}:{udp[n]}"],
            "debug_socket": str(tmp_path / f"{n}.sock")}, tmp_path, n) for n, ip in
            NODE_IPS.items()]
        try:
            server.wait_ready()
            for agent in agents:
                agent.start().wait_ready()
            server.wait_for(lambda s: {a["node"] for a in s["agents"]} == set(NODE_IPS),
                            what="both agents connected")
            yield {"server": server, "ports": ports}
        finally:
            for proc in (server, *agents):
                proc.kill()
            for proc in (server, *agents):
                assert "Traceback" not in proc.logs(), proc.logs()


def test_standalone_balanced_ports_follow_a_reload(standalone: dict[str, Any]) -> None:
    server: NodeagentProcess = standalone["server"]
    ports = standalone["ports"]

    def tcp_node() -> str | None:
        return tcp_say(ports["tcp"]).split(":")[0]

    def udp_node() -> str | None:
        answer = exchange(ports["udp"], PAYLOAD, timeout=1)
        return answer.decode().split(":")[0] if answer else None

    answers_from_both(tcp_node, set(NODE_IPS), "TCP from both nodes")
    answers_from_both(udp_node, set(NODE_IPS), "UDP from both nodes")
    # A reload that leaves edge-2 only, then no port at all: applied without a restart.
    cfg = dict(server.config)
    only = [dict(p, backends=[b for b in p["backends"] if b["node"] == "edge-2"])
            for p in cfg["load_balancers"][0]["ports"]]
    server.config = dict(cfg, load_balancers=[{"name": "apps/echo", "ports": only}])
    server.write_config()
    server.signal(signal.SIGHUP)
    wait_for(lambda: all(tcp_node() == "edge-2" for _ in range(3)), "edge-2 only")
    server.config = dict(cfg, load_balancers=[])
    server.write_config()
    server.signal(signal.SIGHUP)
    wait_for(lambda: tcp_refused(ports["tcp"]), "port closed after the reload")
    assert fetch_debug(server.socket, "/loadbalancers")["ports"] == []
