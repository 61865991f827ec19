"""`scripts/demo --cluster`: the Kubernetes path on this machine, driven with kubectl.

The Kubernetes API server here is a LOCAL STAND-IN (nodeagent/testing/fakekube, a test fixture that
speaks the API's list/watch protocol), not a real cluster: nothing schedules or runs pods.
The demo plays the kubelet's part: it installs the manifests with `kubectl apply -k
manifests/`, creates the pods the workloads would have, gives each a token bound to its pod,
and runs two controllers, a server and an agent as processes with the flags the applied
Deployments and DaemonSet give them (only addresses and file paths changed). A sample
backend stands for a pod on the one node, `demo-node`.

It then prints a KUBECONFIG and the steps to try: `kubectl apply` an Ingress and curl it
through the server, the agent and the tunnel. It runs until Ctrl-C (or --seconds).
Needs root (the agent marks its tunnel socket, CAP_NET_ADMIN) and kubectl:

    sudo scripts/demo --cluster [--seconds N]

which runs, from the repository root, `.venv/bin/python -m scripts.demo_cluster`.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

import yaml
from cryptography import x509

from nodeagent.ops.debugcli import program_command
from nodeagent.testing.fakekube.kubectl import KUBECTL
from nodeagent.testing.fakekube.localcluster import (
    MANIFESTS,
    NAMESPACE,
    FakeApiServer,
    Kubectl,
    container_command,
    pod,
    ready,
    wait_for,
)
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.trust import pki

NODE = "demo-node"
HOST = "hello.demo.local"


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def say(text: str = "") -> None:
    print(text, flush=True)


def hello_manifest(backend_port: int) -> str:
    """What the user applies: the app's Service, its endpoints on demo-node (the sample
    backend on 127.0.0.1, which stands for a pod there) and an Ingress of class nodeagent."""
    docs = [
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": "hello", "namespace": "default"},
         "spec": {"ports": [{"name": "http", "port": 80, "targetPort": "http"}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "hello-1", "namespace": "default",
                      "labels": {"kubernetes.io/service-name": "hello"}},
         "addressType": "IPv4",
         "ports": [{"name": "http", "port": backend_port, "protocol": "TCP"}],
         "endpoints": [{"addresses": ["127.0.0.1"], "nodeName": NODE,
                        "conditions": {"ready": True},
                        "targetRef": {"kind": "Pod", "namespace": "default",
                                      "name": "hello-0"}}]},
        {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
         "metadata": {"name": "hello", "namespace": "default"},
         "spec": {"ingressClassName": "nodeagent", "rules": [{"host": HOST, "http": {
             "paths": [{"path": "/", "pathType": "Prefix", "backend": {"service": {
                 "name": "hello", "port": {"name": "http"}}}}]}}]}},
    ]
    return yaml.safe_dump_all(docs, sort_keys=False)


class Demo:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[NodeagentProcess] = []
        self.backend: subprocess.Popen[bytes] | None = None
        self.fake: FakeApiServer | None = None
        self.ports = {name: free_port() for name in (
            "config-a", "config-b", "c-metrics-a", "c-metrics-b", "tunnel", "http", "https",
            "s-metrics", "a-metrics", "backend", "connect")}

    def start(self) -> None:
        tmp, ports = self.tmp, self.ports
        self.fake = fake = FakeApiServer(tmp / "kubeconfig", secrets.token_urlsafe(24))
        k = Kubectl(fake.kubeconfig)
        say(f"fake API server (a local stand-in, not a cluster) at {fake.url}")
        say("$ kubectl apply -k manifests/")
        say(k.ok("apply", "-k", str(MANIFESTS)).rstrip())

        # What the scheduler and the kubelet would have done: the node, the pods, tokens.
        tunnel_url = f"wss://127.0.0.1:{ports['tunnel']}/tunnel"
        pods = {"controller-a": ("nodeagent-controller", "cloud-1"),
                "controller-b": ("nodeagent-controller", "cloud-1"),
                "server": ("nodeagent-server", "cloud-1"),
                "agent": ("nodeagent-agent", NODE)}
        k.apply({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE},
                 "spec": {"podCIDRs": ["10.244.1.0/24"]}},
                *(pod(f"nodeagent-{name}", account, node)
                  for name, (account, node) in pods.items()),
                # The tunnel's public address: the controller puts it in the servers'
                # certificate, which the agent then verifies.
                {"apiVersion": "nodeagent.io/v1alpha1", "kind": "ClusterTunnel",
                 "metadata": {"name": "demo"},
                 "spec": {"serverUrl": tunnel_url, "allowedNodePorts": [10250]}})
        # The kubelet's status: its address, and Ready (what `kubectl get nodes` shows).
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        k.ok("patch", "node", NODE, "--subresource=status", "--type=merge", "-p", json.dumps(
            {"status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}],
                        "conditions": [{"type": "Ready", "status": "True",
                                        "reason": "KubeletReady",
                                        "message": "kubelet is posting ready status",
                                        "lastHeartbeatTime": now,
                                        "lastTransitionTime": now}]}}))
        # The sample backend's Pod, placed and started as the kubelet would: the endpoint
        # in hello.yaml names it, and the controller believes an endpoint only for a Pod
        # of the Service's namespace on that node holding that address.
        k.apply(pod("hello-0", "default", NODE, namespace="default"))
        k.ok("patch", "pod", "hello-0", "--subresource=status", "--type=merge", "-p",
             json.dumps({"status": {"podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}]}}))
        uid = {name: k.ok("get", "pod", f"nodeagent-{name}", "-n", NAMESPACE, "-o",
                          "jsonpath={.metadata.uid}") for name in pods}

        def token(name: str, audiences: list[str] | None = None) -> Path:
            account, _ = pods[name]
            claims: dict[str, Any] = {"namespace": NAMESPACE, "service_account": account,
                      "pod_name": f"nodeagent-{name}", "pod_uid": uid[name]}
            if audiences:
                claims["audiences"] = audiences
            if name == "agent":
                claims |= {"node_name": NODE, "node_uid": "demo-node-uid"}
            return fake.add_token(secrets.token_urlsafe(24), tmp / name / "token", **claims)

        # Two controllers as their ServiceAccount (manifests/rbac.yaml decides what they
        # may do); one leads and writes, both serve config.
        controller_workload = k.json("deployment", "nodeagent-controller", "-n", NAMESPACE)
        for replica in ("a", "b"):
            name = f"controller-{replica}"
            kubeconfig = fake.kubeconfig_as(token(name), tmp / name / "kubeconfig")
            self.run(NodeagentProcess("controller", {"debug_socket": ""}, tmp, name, args=[
                *container_command(controller_workload, "controller",
                                   {"metadata.name": f"nodeagent-{name}",
                                    "metadata.namespace": NAMESPACE},
                                   {"--listen": f"127.0.0.1:{ports['config-' + replica]}",
                                    "--metrics-listen":
                                        f"127.0.0.1:{ports['c-metrics-' + replica]}"}),
                "--kubeconfig", str(kubeconfig), "--tls-name", "127.0.0.1"]))
        for replica in ("a", "b"):
            wait_for(lambda r=replica: ready(ports["c-metrics-" + r]),  # type: ignore[misc]
                     f"controller-{replica} ready", timeout=30)

        # The volumes the kubelet would mount: the CA ConfigMap, the servers' Secret (once
        # the leader has written it for the tunnel's address).
        ca = wait_for(lambda: k.ok("get", "configmap", "nodeagent-ca", "-n", NAMESPACE, "-o",
                                   r"jsonpath={.data.ca\.crt}"), "the CA ConfigMap", 30)
        (tmp / "ca.crt").write_text(ca)

        def server_tls() -> dict[str, str] | None:
            secret = k.json("secret", "nodeagent-server-tls", "-n", NAMESPACE)
            cert = pki.load_certificate(base64.b64decode(secret["data"]["tls.crt"]))
            names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            ips = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
            return dict(secret["data"]) if "127.0.0.1" in ips else None

        tls = wait_for(server_tls, "the servers' certificate", 30)
        (tmp / "server-tls").mkdir()
        for key in ("tls.crt", "tls.key"):
            (tmp / "server-tls" / key).write_bytes(base64.b64decode(tls[key]))
        controller_url = f"https://127.0.0.1:{ports['config-a']}"
        # ConfigMap kube-root-ca.crt, which the server mounts for its CONNECT front's
        # clients (kube-apiserver): the API server's CA, here the stand-in's.
        cluster = yaml.safe_load(fake.kubeconfig.read_text())["clusters"][0]["cluster"]
        (tmp / "kube-root-ca.crt").write_bytes(
            base64.b64decode(cluster["certificate-authority-data"]))

        server = self.run(NodeagentProcess(
            "server", {"debug_socket": str(tmp / "server.sock")}, tmp, "server",
            args=[*container_command(
                k.json("deployment", "nodeagent-server", "-n", NAMESPACE), "server",
                {"metadata.name": "nodeagent-server"},
                {"--controller": controller_url,
                 "--token-file": str(token("server", ["nodeagent"])),
                 "--ca-file": str(tmp / "ca.crt"), "--tunnel-listen": tunnel_url,
                 "--tls-cert": str(tmp / "server-tls" / "tls.crt"),
                 "--tls-key": str(tmp / "server-tls" / "tls.key"),
                 "--ingress-http": f"127.0.0.1:{ports['http']}",
                 "--ingress-https": f"127.0.0.1:{ports['https']}",
                 "--metrics-listen": f"127.0.0.1:{ports['s-metrics']}",
                 "--connect-listen": f"127.0.0.1:{ports['connect']}",
                 "--state-dir": str(tmp / "server-state"),
                 "--connect-client-ca": str(tmp / "kube-root-ca.crt")}),
                "--debug-socket", str(tmp / "server.sock")]))
        server.wait_ready(timeout=30)
        agent = self.run(NodeagentProcess(
            "agent", {"debug_socket": str(tmp / "agent.sock")}, tmp, "agent",
            args=container_command(
                k.json("daemonset", "nodeagent-agent", "-n", NAMESPACE), "agent",
                {"spec.nodeName": NODE},
                {"--server": tunnel_url, "--token-file": str(token("agent", ["nodeagent"])),
                 "--ca-file": str(tmp / "ca.crt"), "--controller": controller_url,
                 "--debug-socket": str(tmp / "agent.sock"),
                 "--metrics-listen": f"127.0.0.1:{ports['a-metrics']}"})))
        agent.wait_ready(timeout=30)
        server.wait_for(lambda s: [a["node"] for a in s["agents"]] == [NODE],
                        what=f"the agent of {NODE} connected", timeout=30)

        # The sample backend: a pod on demo-node, as far as the cluster knows.
        www = tmp / "www"
        www.mkdir()
        (www / "index.html").write_text(f"hello from the sample backend on {NODE}\n")
        self.backend = subprocess.Popen(
            [sys.executable, "-m", "http.server", str(ports["backend"]), "--bind", "127.0.0.1",
             "--directory", str(www)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (tmp / "hello.yaml").write_text(hello_manifest(ports["backend"]))

    def run(self, proc: NodeagentProcess) -> NodeagentProcess:
        self.procs.append(proc.start())
        return proc

    def instructions(self) -> str:
        tmp, http = self.tmp, self.ports["http"]
        return f"""
Running: a fake Kubernetes API server (a local stand-in for a real cluster), two
controllers, a server, an agent for node {NODE} and a sample backend on it. Logs: {tmp}/*.log

Try it (in another terminal, from this checkout):
  export KUBECONFIG={tmp}/kubeconfig
  kubectl get ct,nodes
  kubectl apply -f {tmp}/hello.yaml
  curl -H 'Host: {HOST}' http://127.0.0.1:{http}/
  kubectl describe ingress hello
  {program_command()} debug --socket {tmp}/agent.sock status

Ctrl-C stops everything."""

    def stop(self) -> None:
        for proc in reversed(self.procs):
            try:
                proc.stop(timeout=10)
            except AssertionError:
                pass
        if self.backend is not None:
            self.backend.terminate()
            self.backend.wait()
        if self.fake is not None:
            self.fake.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/demo --cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=None, metavar="N",
                        help="stop after N seconds (default: run until Ctrl-C)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        say("scripts/demo --cluster needs root: the agent marks its tunnel socket "
            "(SO_MARK, CAP_NET_ADMIN). Run it with sudo, or try `scripts/demo` (no cluster).")
        return 2
    if not os.access(KUBECTL, os.X_OK):
        say(f"scripts/demo --cluster needs kubectl (not found at {KUBECTL}); "
            "install it (e.g. the apt package kubectl) and run again.")
        return 2

    def interrupted(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    tmp = Path(tempfile.mkdtemp(prefix="nodeagent-cluster-demo-"))
    demo = Demo(tmp)
    try:
        try:
            demo.start()
        except AssertionError as exc:
            say(f"FAILED to start: {exc}")
            return 1
        say(demo.instructions())
        deadline = None if args.seconds is None else time.monotonic() + args.seconds
        while deadline is None or time.monotonic() < deadline:
            for proc in demo.procs:
                if proc.proc is not None and proc.proc.poll() is not None:
                    say(f"{proc.name} exited ({proc.proc.returncode}); see {proc.log_path}")
                    return 1
            time.sleep(0.5)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        demo.stop()
        say("stopped.")
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
