"""Scale to zero end to end, with real processes: the fake API server running its simulated
workload controller (`--workloads`: pods and EndpointSlices follow a Deployment's replicas
after a start delay), two controllers (c1 leads), two server replicas watching the
standby c2, an agent per server on edge-1, and the sample upstream as the workload's pod.

A Service opts in with `nodeagent.io/idle-after`; the leader scales its Deployment to 0
when idle; a request is held by the server, which asks the controller to wake it, and is
forwarded once the endpoints arrive through the config stream."""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nodeagent.controller.wakeroutes import REPLICAS_BEFORE_SLEEP, STATE
from nodeagent.kube.resources import (
    DEPLOYMENTS,
    ENDPOINTSLICES,
    INGRESSCLASSES,
    INGRESSES,
    NODES,
    SERVICES,
)
from nodeagent.ops.debug import fetch_debug
from nodeagent.testing.fakekube.workloads import CRASH, START_DELAY, WRITTEN_AT
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import Certs, Upstream, free_port
from tests.e2e.test_kubernetes import (
    ADMIN,
    NS,
    ROOT,
    Api,
    add_token,
    ingress,
    pod,
    seed_identities,
    wait_for,
)

pytestmark = pytest.mark.needs("root")  # the agent marks its tunnel socket (SO_MARK)

SERVER2_TOKEN = "e2e-server2-token-0123456789"
IDLE = "2s"


def deployment(port: int, replicas: int = 2, annotations: dict[str, str] | None = None
               ) -> dict[str, Any]:
    return {"metadata": {"name": "web", "namespace": NS, "annotations": annotations or {}},
            "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "web"}},
                     "template": {"metadata": {"labels": {"app": "web"}}, "spec": {
                         "nodeName": "edge-1", "containers": [{
                             "name": "web", "image": "web",
                             "ports": [{"name": "http", "containerPort": port}]}]}}}}


def sleepy_service(**annotations: str) -> dict[str, Any]:
    return {"metadata": {"name": "web", "namespace": NS, "annotations": {
        "nodeagent.io/idle-after": IDLE, "nodeagent.io/wake-timeout": "20s", **annotations}},
        "spec": {"selector": {"app": "web"},
                 "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}}


def start_controller(name: str, port: int, kubeconfig: Path, tmp_path: Path
                     ) -> NodeagentProcess:
    return NodeagentProcess("controller", {"debug_socket": ""}, tmp_path, name, args=[
        "--kubeconfig", str(kubeconfig), "--namespace", "nodeagent",
        "--listen", f"127.0.0.1:{port}", "--identity", name, "--lease-seconds", "3",
        "--tls-name", "127.0.0.1", "--min-awake-seconds", "1",
        "--activity-interval-seconds", "0.3"]).start()


@pytest.fixture
def sleepy(tmp_path: Path, certs: Certs, upstream: Upstream) -> Iterator[dict[str, Any]]:
    kubeconfig = tmp_path / "kubeconfig"
    fake = subprocess.Popen(
        [sys.executable, "-m", "nodeagent.testing.fakekube", "--port", "0", "--token", ADMIN,
         "--kubeconfig", str(kubeconfig), "--bookmark-interval", "0.5",
         "--namespace", "nodeagent", "--namespace", NS, "--workloads",
         "--workload-start-delay", "1.0", "--workload-node", "edge-1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    procs: list[NodeagentProcess] = []
    api: Api | None = None
    try:
        assert fake.stdout is not None
        api = Api(json.loads(fake.stdout.readline())["url"])
        api.create(INGRESSCLASSES, {"metadata": {"name": "nodeagent"},
                                    "spec": {"controller": "nodeagent.io/ingress-controller"}})
        ports = {name: free_port() for name in ("c1", "c2", "t1", "h1", "t2", "h2")}
        controllers = {}
        for name in ("c1", "c2"):
            proc = controllers[name] = start_controller(name, ports[name], kubeconfig,
                                                        tmp_path)
            procs.append(proc)
            proc.wait_for_log("controller ready", timeout=20)
            if name == "c1":
                proc.wait_for_log("leading", timeout=10)
        seed_identities(api, tmp_path, certs)
        uid = pod(api, "s2", "cloud-1", "nodeagent-server")
        add_token(api, SERVER2_TOKEN, namespace="nodeagent",
                  service_account="nodeagent-server", pod_name="s2", pod_uid=uid,
                  audiences=["nodeagent"])
        (tmp_path / "server2-token").write_text(SERVER2_TOKEN)
        api.replace_status(NODES, "edge-1", None, {"addresses": [
            {"type": "InternalIP", "address": "127.0.0.1"}]})
        api.create(SERVICES, sleepy_service())
        api.create(DEPLOYMENTS, deployment(upstream.http_port))
        api.create(INGRESSES, ingress("a", "a.test", "/"))
        controller_url = f"https://127.0.0.1:{ports['c2']}"
        servers = []
        for name, token in (("s1", "server-token"), ("s2", "server2-token")):
            n = name[1]
            server = NodeagentProcess("server", {"debug_socket": str(tmp_path / f"{name}.sock")},
                                      tmp_path, name, args=[
                "--controller", controller_url, "--token-file", str(tmp_path / token),
                "--ca-file", str(tmp_path / "cluster-ca.crt"),
                "--tunnel-listen", f"tls://127.0.0.1:{ports['t' + n]}",
                "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
                "--ingress-http", f"127.0.0.1:{ports['h' + n]}", "--server-id", name,
                # Each server's LoadBalancer ports on an address of its own.
                "--load-balancer-host", f"127.0.0.{n}",
                "--debug-socket", str(tmp_path / f"{name}.sock")]).start()
            procs.append(server)
            servers.append(server)
        for server in servers:
            server.wait_ready()
        for n, server in (("1", servers[0]), ("2", servers[1])):
            agent = NodeagentProcess("agent", {"debug_socket": str(tmp_path / f"a{n}.sock")},
                                     tmp_path, f"agent{n}", args=[
                "--node", "edge-1", "--server", f"tls://127.0.0.1:{ports['t' + n]}",
                "--token-file", str(tmp_path / "agent-token"), "--ca-file",
                str(tmp_path / "agent-ca.crt"), "--controller", controller_url,
                "--debug-socket", str(tmp_path / f"a{n}.sock")]).start()
            procs.append(agent)
            agent.wait_ready(timeout=30)
            server.wait_for(lambda s: s["agents"], what="agent connected", timeout=20)
        yield {"api": api, "fake": fake, "procs": procs, "servers": servers,
               "controllers": controllers, "ports": ports, "kubeconfig": kubeconfig,
               "tmp": tmp_path, "http": [ports["h1"], ports["h2"]]}
    finally:
        for proc in procs:
            proc.kill()
        if api is not None:
            api.http.close()
        fake.kill()
        fake.wait()
        if fake.stdout is not None:
            fake.stdout.close()
    for proc in procs:
        assert "Traceback" not in proc.logs(), proc.logs()


def get(port: int, timeout: float = 30.0) -> httpx.Response:
    with httpx.Client(timeout=timeout) as client:
        return client.get(f"http://127.0.0.1:{port}/", headers={"host": "a.test"})


def annotate(api: Api, resource: Any, annotations: dict[str, str | None]) -> None:
    """`kubectl annotate`: a merge patch of the annotations alone."""
    response = api.http.patch(resource.path(NS, "web"), json={
        "metadata": {"annotations": annotations}},
        headers={"content-type": "application/merge-patch+json"})
    assert response.status_code == 200, response.text


def replicas(api: Api) -> int:
    return int(api.get(DEPLOYMENTS, "web", NS)["spec"]["replicas"])


def state(api: Api) -> dict[str, Any]:
    text = (api.get(SERVICES, "web", NS)["metadata"].get("annotations") or {}).get(STATE)
    return json.loads(text) if text else {}


def scale_writes(api: Api) -> list[dict[str, Any]]:
    """Successful writes of the Deployment's scale subresource, from the fake's log."""
    log = api.http.get("/_fake/requests").json()
    return [r for r in log if r["method"] in ("PUT", "PATCH") and r["status"] == 200
            and r["path"] == f"/apis/apps/v1/namespaces/{NS}/deployments/web/scale"]


def backends(server: NodeagentProcess) -> list[Any]:
    """The backends of a.test's rule in the server's running routes (debug /config)."""
    transport = httpx.HTTPTransport(uds=str(server.socket))
    with httpx.Client(transport=transport, timeout=5) as client:
        rules = client.get("http://debug/config").json()["ingress"]["rules"]
    return [b for r in rules if r["host"] == "a.test" for b in r["backends"]]


def asleep(sleepy: dict[str, Any]) -> None:
    """Wait for the leader to put the idle workload to sleep, and for the servers to
    run routes without its endpoints."""
    api = sleepy["api"]
    wait_for(lambda: replicas(api) == 0 and state(api).get("state") == "sleeping",
             "the idle Deployment scaled to 0", timeout=30)
    wait_for(lambda: not any(backends(s) for s in sleepy["servers"]),
             "the servers' routes without endpoints")


def test_idle_sleeps_then_a_held_request_wakes_it_to_its_count(sleepy: dict[str, Any]
                                                               ) -> None:
    api, (port, _) = sleepy["api"], sleepy["http"]
    wait_for(lambda: get(port, 5).status_code == 200, "served while awake", timeout=30)
    asleep(sleepy)
    deploy = api.get(DEPLOYMENTS, "web", NS)
    assert deploy["metadata"]["annotations"][REPLICAS_BEFORE_SLEEP] == "2"
    assert state(api)["workload"] == "deployments/web"
    events = [e for e in api.http.get(f"/api/v1/namespaces/{NS}/events").json()["items"]
              if e["involvedObject"]["name"] == "web"]
    assert any(e["reason"] == "Sleeping" for e in events), events
    # No endpoints now: a request is held, not refused; it wakes the workload to its
    # remembered count and is answered by it.
    api.http.delete("/_fake/requests")
    started = time.monotonic()
    response = get(port)
    took = time.monotonic() - started
    assert response.status_code == 200, response.text
    assert "hello from upstream" in response.text
    print(f"\ncold start through a held request: {took:.2f}s (pods ready after 1.0s)")
    assert replicas(api) == 2
    writes = scale_writes(api)
    assert len(writes) == 1, writes
    wait_for(lambda: state(api).get("state") == "awake", "the Service marked awake")
    events = [e["reason"] for e in api.http.get(
        f"/api/v1/namespaces/{NS}/events").json()["items"]
        if e["involvedObject"]["name"] == "web"]
    assert "Waking" in events and "Awake" in events, events
    server = sleepy["servers"][0]
    status = server.status()["held_requests"]
    assert status["held"] >= 1 and status["forwarded"] >= 1 and status["timeouts"] == 0
    assert server.metric("nodeagent_held_requests_ended_total", outcome="forwarded") >= 1
    assert server.metric("nodeagent_wake_cold_start_seconds_count") >= 1


def test_http2_first_requests_are_held_and_answered_like_http1(sleepy: dict[str, Any]
                                                               ) -> None:
    """HTTP/2 (h2c, prior knowledge) requests for a sleeping route, through both servers:
    held, then answered once it wakes, although the node's allow list often reaches its
    agent a moment after the servers' routes (the agent waits for it, as for HTTP/1.1)."""
    ports = sleepy["http"]
    wait_for(lambda: all(get(p, 5).status_code == 200 for p in ports), "both serve",
             timeout=30)
    for cycle in range(3):
        asleep(sleepy)

        def first(i: int) -> httpx.Response:
            with httpx.Client(http1=False, http2=True, timeout=30) as client:
                return client.get(f"http://127.0.0.1:{ports[i % 2]}/",
                                  headers={"host": "a.test"})

        with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
            answers = list(pool.map(first, range(4)))
        assert [(r.status_code, r.http_version) for r in answers] == [
            (200, "HTTP/2")] * 4, (cycle, [r.text[:200] for r in answers])
        assert all("hello from upstream" in r.text for r in answers)


def test_a_hundred_first_requests_through_two_servers_make_one_scale_patch(
        sleepy: dict[str, Any]) -> None:
    api, ports = sleepy["api"], sleepy["http"]
    wait_for(lambda: all(get(p, 5).status_code == 200 for p in ports), "both serve",
             timeout=30)
    # Pods take 3 s to start: all 100 requests arrive while it sleeps or wakes.
    annotate(api, DEPLOYMENTS, {START_DELAY: "3"})
    asleep(sleepy)
    api.http.delete("/_fake/requests")
    held_before = sum(s.status()["held_requests"]["held"] for s in sleepy["servers"])
    together = threading.Barrier(100)

    def first_request(i: int) -> tuple[int, str]:
        # Connected before the barrier: the requests go out together.
        conn = http.client.HTTPConnection("127.0.0.1", ports[i % 2], timeout=30)
        conn.connect()
        together.wait()
        try:
            conn.request("GET", "/", headers={"host": "a.test"})
            response = conn.getresponse()
            return response.status, response.read().decode()
        finally:
            conn.close()

    with concurrent.futures.ThreadPoolExecutor(max_workers=100) as pool:
        answers = list(pool.map(first_request, range(100)))
    codes = [status for status, _ in answers]
    assert codes == [200] * 100, [text for status, text in answers if status != 200][:3]
    assert len(scale_writes(api)) == 1, scale_writes(api)
    assert replicas(api) == 2
    held = sum(s.status()["held_requests"]["held"] for s in sleepy["servers"])
    assert held - held_before == 100, (held, held_before)


def test_a_wake_that_takes_too_long_answers_504_naming_the_route(sleepy: dict[str, Any]
                                                                  ) -> None:
    api, (port, _) = sleepy["api"], sleepy["http"]
    server = sleepy["servers"][0]
    wait_for(lambda: get(port, 5).status_code == 200, "served while awake", timeout=30)
    # Long enough to still be held when `nodeagent debug holds` (a Python process
    # starting on a loaded machine: seconds) looks.
    annotate(api, SERVICES, {"nodeagent.io/wake-timeout": "8s"})
    annotate(api, DEPLOYMENTS, {START_DELAY: "60"})
    asleep(sleepy)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(get, port)
        # While it waits, the debug socket shows it held.
        server.wait_for(lambda s: s["held_requests"]["held_now"].get(
            f"{NS}/web", {}).get("requests") == 1, what="the request held")
        shown = subprocess.run(
            [sys.executable, "-m", "nodeagent", "debug", "holds", "--socket",
             str(server.socket)], capture_output=True, text=True, timeout=20, check=True)
        assert f"{NS}/web" in shown.stdout.split("\n")[1], shown.stdout
        assert shown.stdout.split("\n")[1].split()[1] == "1", shown.stdout
        response = pending.result()
    assert response.status_code == 504, response.text
    assert "route shop/a" in response.text and "did not wake within 8s" in response.text
    assert server.status()["held_requests"]["timeouts"] >= 1


def test_a_workload_that_crashes_on_start_fails_held_requests_with_502(
        sleepy: dict[str, Any]) -> None:
    api, (port, _) = sleepy["api"], sleepy["http"]
    wait_for(lambda: get(port, 5).status_code == 200, "served while awake", timeout=30)
    asleep(sleepy)
    annotate(api, DEPLOYMENTS, {CRASH: "panic: DATABASE_URL is not set"})
    response = get(port)
    assert response.status_code == 502, response.text
    assert "CrashLoopBackOff" in response.text
    assert "DATABASE_URL is not set" in response.text


def test_controller_unreachable_then_back_and_leader_killed_mid_wake(
        sleepy: dict[str, Any]) -> None:
    api, (port, _) = sleepy["api"], sleepy["http"]
    server = sleepy["servers"][0]
    c1, c2 = sleepy["controllers"]["c1"], sleepy["controllers"]["c2"]
    wait_for(lambda: get(port, 5).status_code == 200, "served while awake", timeout=30)
    annotate(api, SERVICES, {"nodeagent.io/wake-timeout": "3s"})
    asleep(sleepy)
    # The controller the servers talk to is gone: the wake cannot be asked; the held
    # request still ends cleanly at its timeout.
    c2.kill()
    response = get(port)
    assert response.status_code == 504, response.text
    assert replicas(api) == 0
    assert "cannot ask the controller to wake a Service" in server.logs()
    # It comes back (same address): the servers' next request wakes the workload, and
    # the leader dies right after the wake: the request is still answered.
    annotate(api, SERVICES, {"nodeagent.io/wake-timeout": "30s"})
    new_c2 = start_controller("c2", sleepy["ports"]["c2"], sleepy["kubeconfig"],
                              sleepy["tmp"])
    sleepy["procs"].append(new_c2)
    new_c2.wait_for_log("controller ready", timeout=20)
    server.wait_for(lambda s: s["config_watch"]["state"] == "watching",
                    what="watching the controller again", timeout=20)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        pending = pool.submit(get, port)
        wait_for(lambda: replicas(api) == 2, "woken")
        c1.kill()
        response = pending.result()
    assert response.status_code == 200, response.text
    new_c2.wait_for_log("leading", timeout=20)
    wait_for(lambda: state(api).get("state") == "awake", "the new leader marks it awake",
             timeout=20)


def lb_get(host: str, port: int, *, wait: float = 0.0) -> str:
    """An HTTP/1.0 request on a bare TCP connection to a LoadBalancer port (after `wait`
    seconds connected and silent), and everything the connection answered."""
    with socket.create_connection((host, port), timeout=30) as sock:
        time.sleep(wait)
        sock.sendall(b"GET / HTTP/1.0\r\nHost: a.test\r\n\r\n")
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    return got.decode(errors="replace")


def lb_backends(server: NodeagentProcess, port: int) -> list[str]:
    view = fetch_debug(server.socket, "/loadbalancers")
    return [b for p in view["ports"] if p["port"] == port for b in p["backends"]]


def test_a_load_balancer_port_holds_connections_while_its_service_sleeps(
        sleepy: dict[str, Any]) -> None:
    """The Service is also of type LoadBalancer: its TCP port (on each server) holds a
    connection while it sleeps, one scale patch wakes it to its remembered count, and
    the held connections are answered by it; an open connection keeps it awake. Its UDP
    port drops datagrams while it sleeps, but they wake it."""
    api, servers = sleepy["api"], sleepy["servers"]
    lb, udp = free_port(), free_port(socket.SOCK_DGRAM)
    response = api.http.patch(SERVICES.path(NS, "web"), json={"spec": {
        "type": "LoadBalancer", "loadBalancerClass": "nodeagent.io/tunnel",
        "ports": [{"name": "http", "port": 80, "targetPort": "http"},
                  {"name": "lb", "port": lb, "targetPort": "http"},
                  {"name": "dgram", "port": udp, "protocol": "UDP", "targetPort": 9}]}},
        headers={"content-type": "application/merge-patch+json"})
    assert response.status_code == 200, response.text
    hosts = ("127.0.0.1", "127.0.0.2")  # s1's and s2's load balancer addresses

    def served(host: str) -> bool:
        try:
            return "hello from upstream" in lb_get(host, lb)
        except OSError:
            return False

    # (Asleep already, maybe: no request came in its first 2 s; the first connection
    # is then held and wakes it.)
    wait_for(lambda: all(served(h) for h in hosts), "both servers' port served", timeout=30)
    asleep(sleepy)
    wait_for(lambda: not any(lb_backends(s, lb) for s in servers),
             "the servers' load balancer port without endpoints")
    api.http.delete("/_fake/requests")
    held_before = [s.status()["held_requests"]["held"] for s in servers]
    # Without the wake these connections would be closed at once (no backends).
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(lambda i: lb_get(hosts[i % 2], lb), range(4)))
    assert all(a.startswith("HTTP/1.") and "hello from upstream" in a for a in answers), \
        answers
    assert replicas(api) == 2
    writes = scale_writes(api)
    assert len(writes) == 1, writes
    for server, before in zip(servers, held_before, strict=True):
        held = server.status()["held_requests"]
        assert held["held"] > before and held["timeouts"] == 0, held
    # An open connection is activity: quiet for five times idle-after (2s) and the
    # minimum awake time (1s), it is still answered by the awake workload, not slept
    # on. The servers report to the standby c2; its record of busy Services reaches the
    # leader c1 through the API (controller/activityshare.py). Not through the
    # Service's last-request annotation, which c2 writes only now and then: here its
    # writes to the Service fail meanwhile (an API slow to take them, as on a loaded
    # cluster), so the leader could not learn of the connection that way.
    wait_for(lambda: state(api).get("state") == "awake", "the Service marked awake")
    response = api.http.post("/_fake/fail", json={
        "count": None, "status": 500, "method": "PATCH", "path": "/services/web"})
    assert response.status_code == 200, response.text
    try:
        assert "hello from upstream" in lb_get(hosts[0], lb, wait=10.0)
        assert replicas(api) == 2
    finally:
        api.http.post("/_fake/clear-faults", json={})
    assert state(api).get("state") == "awake"
    # Asleep again: a datagram to the UDP port is dropped, and asks for the wake.
    asleep(sleepy)
    api.http.delete("/_fake/requests")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(b"wake up", (hosts[1], udp))
        wait_for(lambda: replicas(api) == 2, "woken by a datagram")
    assert len(scale_writes(api)) == 1


def woken(sleepy: dict[str, Any]) -> int:
    """Successful wake writes so far, from the controllers' logs."""
    return sum(p.logs().count("waking a Service's workload") for p in sleepy["procs"]
               if p.role == "controller")


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_hundred_sleep_wake_cycles_with_concurrent_clients_fail_no_request(
        sleepy: dict[str, Any]) -> None:
    """The issue's soak: 100 cycles of sleep, then 10 concurrent first requests through
    both servers; every one answered 200, one scale write to wake each time."""
    api, ports = sleepy["api"], sleepy["http"]
    annotate(api, SERVICES, {"nodeagent.io/idle-after": "1s"})
    wait_for(lambda: all(get(p, 5).status_code == 200 for p in ports), "both serve",
             timeout=30)
    failures: list[str] = []
    wakes = 0
    ready_to_answer: list[float] = []  # endpoints ready (slice written) → first answer
    for cycle in range(100):
        asleep(sleepy)
        before = woken(sleepy)
        answered: list[float] = []

        def first(i: int, answered: list[float] = answered) -> httpx.Response:
            response = get(ports[i % 2])
            answered.append(time.time())
            return response

        with concurrent.futures.ThreadPoolExecutor(max_workers=10) as pool:
            answers = list(pool.map(first, range(10)))
        failures += [f"cycle {cycle}: {r.status_code} {r.text[:100]}" for r in answers
                     if r.status_code != 200]
        # The wake's scale writes (the leader may put it to sleep again meanwhile: the
        # controllers log each successful wake write).
        wakes += woken(sleepy) - before
        (es,) = [e for e in api.list(ENDPOINTSLICES, NS) if e["metadata"]["name"] == "web-sim"]
        ready_to_answer.append(min(answered) - float(es["metadata"]["annotations"][
            WRITTEN_AT]))
        print(f"cycle {cycle}: {len(failures)} failures so far", flush=True)
    ordered = sorted(ready_to_answer)
    print(f"\n100 cycles: {wakes} scale writes to wake, {len(failures)} failures; "
          f"endpoints ready → first held request answered: p50 "
          f"{ordered[49] * 1e3:.0f} ms, p99 {ordered[98] * 1e3:.0f} ms, max "
          f"{ordered[-1] * 1e3:.0f} ms (a figure, not asserted)")
    assert failures == []
    assert wakes == 100


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_endpoints_ready_to_held_request_answered_over_a_hundred_wakes(
        sleepy: dict[str, Any]) -> None:
    """The whole wake path's latency, printed (a figure, not asserted): the workload is
    scaled to 0 directly (no idle wait: a cycle takes about a second), a request is held
    by one server or the other, the controller wakes the workload, the simulator writes
    the ready EndpointSlice 0.2 s later, and the time from that write to the held
    request's answer is recorded: the controller's watch and recompute, the config
    stream, the servers' route swap, the agent's allow list, the dial and the answer."""
    api, ports = sleepy["api"], sleepy["http"]
    # Only the test sleeps it, scaling the Deployment directly: with no pods left and no
    # sleep of the controller's to remember it by, the workload must be named.
    annotate(api, SERVICES, {"nodeagent.io/idle-after": "1h",
                             "nodeagent.io/workload": "deployment/web"})
    annotate(api, DEPLOYMENTS, {START_DELAY: "0.2", REPLICAS_BEFORE_SLEEP: "1"})
    wait_for(lambda: get(ports[0], 5).status_code == 200, "served while awake", timeout=30)
    ready_to_answer: list[float] = []
    failures: list[str] = []
    cycles: list[tuple[int, float, float]] = []  # (server, slice written, answered)
    for cycle in range(100):
        response = api.http.patch(DEPLOYMENTS.path(NS, "web"), json={
            "spec": {"replicas": 0}}, headers={"content-type": "application/merge-patch+json"})
        assert response.status_code == 200, response.text
        wait_for(lambda: not any(backends(s) for s in sleepy["servers"]),
                 "the servers' routes without endpoints")
        answer = get(ports[cycle % 2])
        answered = time.time()
        if answer.status_code != 200:
            failures.append(f"cycle {cycle}: {answer.status_code} {answer.text[:100]}")
            continue
        (es,) = [e for e in api.list(ENDPOINTSLICES, NS) if e["metadata"]["name"] == "web-sim"]
        written = float(es["metadata"]["annotations"][WRITTEN_AT])
        ready_to_answer.append(answered - written)
        cycles.append((cycle % 2, written, answered))
    ordered = sorted(ready_to_answer)
    print(f"\n{len(ordered)} wakes: EndpointSlice ready → held request answered: p50 "
          f"{ordered[len(ordered) // 2] * 1e3:.0f} ms, p99 "
          f"{ordered[max(0, round(len(ordered) * 0.99) - 1)] * 1e3:.0f} ms, max "
          f"{ordered[-1] * 1e3:.0f} ms (a figure, not asserted)")
    print(wake_steps(sleepy, cycles))
    assert failures == []


def _logged(proc: NodeagentProcess, message: str) -> list[float]:
    """When `proc` logged `message` (its log lines' timestamps, epoch seconds)."""
    out = []
    for line in proc.logs().splitlines():
        stamp, _, rest = line.partition(" ")
        if f" {message}" in rest:
            try:
                out.append(dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(
                    tzinfo=dt.UTC).timestamp())
            except ValueError:
                continue
    return out


def wake_steps(sleepy: dict[str, Any], cycles: list[tuple[int, float, float]]) -> str:
    """Where each wake's time went, from the processes' logs (ms after the EndpointSlice
    was written, p50/p99): the serving controller's recompute, the server's routes and
    its agent's allow list applied, the held request released and its backend dialed
    (server, debug), and the answer after that dial."""
    procs = {p.name: p for p in sleepy["procs"]}
    recomputed = _logged(procs["c2"], "config recomputed")
    steps: dict[str, list[float]] = {}
    for server, written, answered in cycles:
        n = server + 1
        found = {"recompute": recomputed,
                 "server routes": _logged(procs[f"s{n}"], "routes applied"),
                 "agent allow list": _logged(procs[f"agent{n}"], "config applied"),
                 "released": _logged(procs[f"s{n}"], "held request released"),
                 "dialed": _logged(procs[f"s{n}"], "woken backend dialed")}
        for step, stamps in found.items():
            at = next((t for t in stamps if written - 0.002 <= t <= answered), None)
            if at is not None:
                steps.setdefault(step, []).append(at - written)
                if step == "dialed":
                    steps.setdefault("answer after dial", []).append(answered - at)
    lines = []
    for step, values in steps.items():
        values.sort()
        lines.append(f"  {step:18} n={len(values):3} p50 {values[len(values) // 2] * 1e3:6.1f}"
                     f" p99 {values[max(0, round(len(values) * 0.99) - 1)] * 1e3:6.1f} ms")
    return "where the time went (ms after the EndpointSlice write):\n" + "\n".join(lines)
