"""Rotating the cluster CA with two CAs in the bundle (README "Rotating the CA"), end to
end with real processes — the fake API server, two controllers, a server and an agent —
while HTTP requests flow through the agent's tunnel the whole time:

1. trust both: Secret nodeagent-ca gets `ca.crt` = old + new; every --ca-file too;
2. switch the signer: the Secret's tls.crt/tls.key become the new CA;
3. wait until every certificate has renewed (here 21.6 s certificates, renewed at ~11 s);
4. remove the old CA from the bundle and the --ca-files.

On the way the servers' tunnel certificate is renewed in its files (as the kubelet updates
the mounted Secret): new handshakes get it, the agent's tunnel stays up.

Certificates from both CAs are accepted while the bundle holds both; afterwards an old-CA
certificate is refused by the controller and by the server; not one request fails."""

from __future__ import annotations

import base64
import functools
import socket
import ssl
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from nodeagent.controller.bootstrap import secret_value
from nodeagent.kube.resources import SECRETS
from nodeagent.testing.procs import NodeagentProcess
from nodeagent.testing.standalone import Certs
from nodeagent.trust import pki
from tests.controller.identity import obtain_identity
from tests.e2e.test_kubernetes import (  # noqa: F401 (fixtures)
    AGENT_TOKEN,
    NS,
    Api,
    cluster,
    controllers,
    endpoint_slice,
    get,
    ingress,
    read_config,
    serve_shop_on_edge,
    wait_for,
)
from tests.e2e.test_reload import presented_serial

pytestmark = pytest.mark.needs("root")


def set_ca_secret(api: Api, cert: bytes, key: bytes, bundle: bytes | None) -> None:
    data = {"tls.crt": cert, "tls.key": key}
    if bundle is not None:
        data["ca.crt"] = bundle
    api.replace(SECRETS, {"metadata": {"name": "nodeagent-ca", "namespace": "nodeagent"},
                          "type": "kubernetes.io/tls",
                          "data": {k: base64.b64encode(v).decode() for k, v in data.items()}})


def node_identity(url: str, ca: bytes) -> Any:
    return trio.run(functools.partial(obtain_identity, url, ca, AGENT_TOKEN, "node"))


def tunnel_handshake(port: int, verify: bytes, identity: Any, tmp: Path) -> bool:
    """Whether the server's tunnel listener accepts a TLS handshake with `identity`'s
    certificate (a refusal may surface at the first read under TLS 1.3)."""
    (tmp / "probe.crt").write_bytes(identity.certificate_pem)
    (tmp / "probe.key").write_bytes(identity.key_pem)
    context = ssl.create_default_context(cadata=verify.decode())
    context.load_cert_chain(tmp / "probe.crt", tmp / "probe.key")
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.settimeout(1.0)
            try:
                return tls.recv(1) != b""  # the server waits for our HELLO: a timeout
            except TimeoutError:
                return True
    except (ssl.SSLError, ConnectionResetError, BrokenPipeError):
        return False


def config_status(port: int, identity: Any, ca: bytes) -> int | str:
    """The status of reading edge-1's config with `identity`, or "refused" if the TLS
    handshake fails (a client certificate the controller does not trust)."""
    try:
        return read_config(port, "/v1/config/nodes/edge-1", identity.client_context(ca=ca))[0]
    except (ssl.SSLError, trio.BrokenResourceError, OSError):
        return "refused"


@pytest.mark.controller_args("--certificate-hours", "0.006")  # 21.6 s: renewed at ~11 s
def test_the_ca_rotates_through_a_two_ca_bundle_with_no_failed_request(
        request: pytest.FixtureRequest, tmp_path: Path, certs: Certs) -> None:
    # The fixtures of test_kubernetes.py, by name (imported above so pytest finds them).
    rig: dict[str, Any] = request.getfixturevalue("cluster")
    replicas: dict[str, Any] = request.getfixturevalue("controllers")
    api, port, upstream = rig["api"], rig["http"], rig["upstream"]
    agent, server = rig["agent"], rig["server"]
    url = f"https://127.0.0.1:{replicas['ports']['c2']}"
    tunnel_port = int(server.args[server.args.index("--tunnel-listen") + 1].rsplit(":", 1)[1])
    secret = api.get(SECRETS, "nodeagent-ca", "nodeagent")
    old_cert = secret_value(secret, "tls.crt").encode() + b"\n"
    old_key = secret_value(secret, "tls.key").encode() + b"\n"
    new = pki.create_ca("nodeagent CA 2")
    both = old_cert + new.certificate_pem
    server_ca, agent_ca = tmp_path / "cluster-ca.crt", tmp_path / "agent-ca.crt"
    tunnel_ca = certs.ca.read_bytes()  # the server's tunnel certificate (test CA)

    # Traffic through the agent for the whole rotation.
    serve_shop_on_edge(api, upstream)
    wait_for(lambda: get(port, "shop.test", "/").status_code == 200, "served")
    statuses: list[int | str] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"host": "shop.test"},
                          timeout=10) as client:
            while not stop.is_set():
                try:
                    statuses.append(client.get("/rotation").status_code)
                except httpx.HTTPError as exc:
                    statuses.append(type(exc).__name__)
                time.sleep(0.01)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        old_identity = node_identity(url, old_cert)
        # 1. Trust both.
        set_ca_secret(api, old_cert, old_key, both)
        server_ca.write_bytes(both)
        agent_ca.write_bytes(both + tunnel_ca)
        server.wait_for(lambda s: s["reloads"]["tunnel_tls"]["reloads"] >= 1,
                        what="server reloaded its CA bundle")
        agent.wait_for_log("reloaded from changed files")
        # 2. Switch the signer to the new CA.
        set_ca_secret(api, new.certificate_pem, new.key_pem, both)
        deadline = time.monotonic() + 15
        while True:  # a few requests a second: the signer's rate limit is not the subject
            new_identity = node_identity(url, both)
            if pki.load_certificate(new_identity.certificate_pem).issuer == \
                    new.certificate.subject:
                break
            assert time.monotonic() < deadline, "the signer did not switch to the new CA"
            time.sleep(0.3)
        # Both CAs' certificates are accepted by the controller and the server.
        for identity in (old_identity, new_identity):
            for c in replicas["ports"].values():
                assert config_status(c, identity, both) == 200
            assert tunnel_handshake(tunnel_port, tunnel_ca, identity, tmp_path)
        # 3. Every certificate renews (from the new CA).
        renewals = (agent.status()["identity"]["renewals"],
                    server.status()["identity"]["renewals"])
        agent.wait_for(lambda s: s["identity"]["renewals"] > renewals[0], timeout=30,
                       what="agent renewed")
        server.wait_for(lambda s: s["identity"]["renewals"] > renewals[1], timeout=30,
                        what="server renewed")
        # The servers' tunnel certificate renewed in its Secret reaches the running
        # server: new handshakes get it, the agent's tunnel stays.
        test_ca = pki.CertificateAuthority.load(certs.ca, certs.ca.with_name("ca.key"))
        renewed = pki.issue_server_certificate(test_ca, ["localhost"], ["127.0.0.1"])
        renewed.write(tmp_path / "tunnel.crt", tmp_path / "tunnel.key")
        wait_for(lambda: presented_serial(tunnel_port, certs.ca)
                 == renewed.certificate.serial_number, "the renewed tunnel certificate")
        # 4. Remove the old CA.
        set_ca_secret(api, new.certificate_pem, new.key_pem, new.certificate_pem)
        server_ca.write_bytes(new.certificate_pem)
        agent_ca.write_bytes(new.certificate_pem + tunnel_ca)
        server.wait_for(lambda s: s["reloads"]["tunnel_tls"]["reloads"] >= 2,
                        what="server dropped the old CA")
        time.sleep(2.0)  # requests keep flowing after the removal
    finally:
        stop.set()
        loader.join()
    print(f"CA rotation: {len(statuses)} requests through the agent, "
          f"{statuses.count(200)} answered 200")  # pytest -s shows it
    assert len(statuses) > 100 and set(statuses) == {200}, {
        s: statuses.count(s) for s in set(statuses)}
    assert agent.status()["tunnel"]["connects"] == 1  # the tunnel stayed up throughout
    # An old-CA certificate is refused now, by every controller and by the server.
    for c in replicas["ports"].values():
        wait_for(lambda c=c: config_status(c, old_identity, both) == "refused",
                 f"controller {c} refuses the old CA's certificate")
        assert config_status(c, new_identity, both) == 200
    assert not tunnel_handshake(tunnel_port, tunnel_ca, old_identity, tmp_path)
    assert tunnel_handshake(tunnel_port, tunnel_ca, new_identity, tmp_path)
    # A restarted server (new CA only) gets its certificate and routes, and the agent's
    # renewed certificate reconnects it.
    server.kill()
    restarted = NodeagentProcess("server", server.config, tmp_path, "server2",
                                 args=server.args).start()
    rig["procs"].append(restarted)
    restarted.wait_ready()
    restarted.wait_for(lambda s: s["agents"], timeout=20, what="agent back on the new CA")
    wait_for(lambda: get(port, "shop.test", "/").status_code == 200, "served again",
             timeout=15)
