"""The agent's node identity in controller mode: its certificate, asked of the controller.

An edge node cannot reach the cluster network, and it has no credential the server would
accept yet, so the first certificate comes through a *bootstrap* connection: a tunnel
connection whose HELLO says `bootstrap` and carries no credential. The server registers it
as no node, lets its streams reach only the controller, and closes it after a few seconds
(tunnel.server.Bootstrap). Through that stream the agent speaks TLS to the controller end
to end (nodeagent.trust.enrollment.request_certificate): the server relays bytes it can neither
read nor forge. The projected ServiceAccount token inside proves the pod; the controller
signs for the node the token is bound to, whatever the agent claims.

Renewals (at half-life, with a fresh key) go through the agent's live tunnel when it is
up, else through a new bootstrap connection. A renewed certificate applies from the next
tunnel connection on; the running one stays up (TLS checked validity at its handshake), so
a renewal never drops a stream.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from nodeagent import __version__
from nodeagent.trust import pki
from nodeagent.trust.enrollment import IssuedIdentity, Requester, request_certificate
from tunnel import protocol as p
from tunnel.client import TunnelClient
from tunnel.dial import dial
from tunnel.endpoint import EndpointSettings, TunnelConnection
from tunnel.proxy import DIRECT, ProxyRules
from tunnel.transports import Endpoint


@asynccontextmanager
async def bootstrap_connection(endpoint: Endpoint, *, node: str,
                               ssl_context: ssl.SSLContext | None,
                               server_hostname: str | None, socket_mark: int | None,
                               connect_timeout: float = 10.0,
                               proxy: ProxyRules = DIRECT,
                               ) -> AsyncIterator[TunnelConnection]:
    """A tunnel connection that may only fetch credentials (see the module docstring);
    through the same forward proxy as the tunnel, if any."""
    transport = await dial(endpoint, ssl_context=ssl_context, server_hostname=server_hostname,
                           connect_timeout=connect_timeout, socket_mark=socket_mark,
                           proxy=proxy.for_endpoint(endpoint))
    conn = TunnelConnection(transport, p.Role.DIALER, EndpointSettings(ping_interval=0), None)
    try:
        await conn.dial_handshake(p.Hello(identity={
            "node": node, "bootstrap": "certificate", "agent_version": __version__}))
    except BaseException:
        await transport.aclose()
        raise
    async with trio.open_nursery() as nursery:
        await nursery.start(conn.run)
        try:
            yield conn
        finally:
            with trio.CancelScope(shield=True):
                await conn.aclose(p.ErrorCode.NO_ERROR, "certificate fetched")
            nursery.cancel_scope.cancel()


def node_certificate_requester(
    client: TunnelClient, *, node: str, controller: tuple[str, int], token: Callable[[], str],
    ca_pem: Callable[[], bytes], server_ca: Callable[[], ssl.SSLContext | None],
    current: Callable[[], IssuedIdentity | None] = lambda: None,
) -> Requester:
    """How this agent asks for a certificate: through its tunnel when connected, else
    through a bootstrap connection. `token()` reads the projected token file each time
    (the kubelet rotates it); `server_ca()` verifies the tunnel server on bootstrap and
    `ca_pem()` the controller (both as the --ca-file reads now: a CA bundle changed
    for a rotation applies at the next request). `current()`: the certificate being
    renewed, presented to the controller while it is valid."""
    host, port = controller
    target = p.Target(host, port)

    async def request(key: pki.PrivateKey) -> IssuedIdentity:
        conn = client.connection
        if conn is not None and conn.is_open and not conn.is_draining:
            return await request_certificate(
                lambda: conn.open_stream(target), host=host, token=token(), kind="node",
                key=key, ca_pem=ca_pem(), present=current())
        async with bootstrap_connection(
                client.endpoint, node=node, ssl_context=server_ca(),
                server_hostname=client.server_hostname,
                socket_mark=client.socket_mark, proxy=client.proxy) as boot:
            return await request_certificate(
                lambda: boot.open_stream(target), host=host, token=token(), kind="node",
                key=key, ca_pem=ca_pem(), present=current())

    return request
