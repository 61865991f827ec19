"""Helpers for tests that need a node's or a server's identity from a running controller
(or from a test CA), built on the production client (nodeagent/trust/enrollment.py).

    pem = await request_certificate(controller_url, ca_pem, token, "node", key)
    token = add_agent_token(fake, "edge-1")               # a bound projected token
    token = add_server_token(fake, "server-0")            # ... and its pod
    identity = await obtain_identity(url, ca_pem, token, "server")  # cert + key + context

`controller_url` is `https://host:port` of the controller's config stream listener. TLS
verifies the controller for `server_hostname` (default: the host of the URL — start the
controller with `tls_names=("127.0.0.1",)` / `--tls-name 127.0.0.1`).
"""

from __future__ import annotations

import functools
import uuid
from urllib.parse import urlsplit

import trio

from nodeagent.testing.fakekube.server import FakeKube
from nodeagent.trust import pki
from nodeagent.trust.enrollment import IssuedIdentity
from nodeagent.trust.enrollment import request_certificate as request_identity

NS = "nodeagent"
AGENT_ACCOUNT = "nodeagent-agent"
SERVER_ACCOUNT = "nodeagent-server"


async def obtain_identity(url: str, ca_pem: bytes | str, token: str, kind: str,
                          key: pki.PrivateKey | None = None, *,
                          server_hostname: str | None = None) -> IssuedIdentity:
    """A certificate of `kind` ("node" or "server") for `key` (a new one by default)."""
    parts = urlsplit(url)
    assert parts.scheme == "https" and parts.hostname and parts.port, url
    with trio.fail_after(15):
        return await request_identity(
            functools.partial(trio.open_tcp_stream, parts.hostname, parts.port),
            host=server_hostname or parts.hostname, token=token, kind=kind,
            key=key or pki.generate_key(), ca_pem=ca_pem)


async def request_certificate(url: str, ca_pem: bytes | str, token: str, kind: str,
                              key: pki.PrivateKey, *, server_hostname: str | None = None
                              ) -> bytes:
    """The PEM certificate the controller at `url` signs for `key`."""
    identity = await obtain_identity(url, ca_pem, token, kind, key,
                                     server_hostname=server_hostname)
    return identity.certificate_pem


def add_pod(fake: FakeKube, name: str, *, node: str | None, namespace: str = NS,
            account: str = AGENT_ACCOUNT) -> str:
    """A Pod object (scheduled on `node` if given); returns its uid."""
    spec: dict[str, object] = {"serviceAccountName": account,
                               "containers": [{"name": "c", "image": "nodeagent"}]}
    if node:
        spec["nodeName"] = node
    pod = fake.put_object({"apiVersion": "v1", "kind": "Pod",
                           "metadata": {"name": name, "namespace": namespace}, "spec": spec})
    return str(pod["metadata"]["uid"])


def add_agent_token(fake: FakeKube, node: str, *, namespace: str = NS,
                    node_claim: bool = True, audiences: tuple[str, ...] = ("nodeagent",),
                    expires_at: float | None = None, account: str = AGENT_ACCOUNT) -> str:
    """An agent pod on `node` and its bound projected token. `node_claim=False`: a token of
    a cluster without the node claim (the controller then reads the pod's nodeName)."""
    token = f"agent-{node}-{uuid.uuid4().hex}"
    pod = f"nodeagent-agent-{uuid.uuid4().hex[:5]}"
    uid = add_pod(fake, pod, node=node, namespace=namespace, account=account)
    fake.add_service_account_token(
        token, namespace=namespace, service_account=account, pod_name=pod, pod_uid=uid,
        node_name=node if node_claim else None, node_uid=f"uid-{node}" if node_claim else None,
        audiences=list(audiences), expires_at=expires_at)
    return token


def add_server_token(fake: FakeKube, pod: str, *, namespace: str = NS,
                     audiences: tuple[str, ...] = ("nodeagent",),
                     account: str = SERVER_ACCOUNT) -> str:
    """A server pod named `pod` and its bound projected token."""
    token = f"server-{pod}-{uuid.uuid4().hex}"
    uid = add_pod(fake, pod, node="cloud-1", namespace=namespace, account=account)
    fake.add_service_account_token(token, namespace=namespace, service_account=account,
                                   pod_name=pod, pod_uid=uid, audiences=list(audiences))
    return token
