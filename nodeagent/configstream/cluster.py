"""A role's link to the controller in controller mode, the same for an agent and a server:
the projected token, the CA bundle that verifies the controller, the certificate the
controller signs (kept renewed by an IdentityKeeper) and the config watch that presents it.

    link = ControllerLink(kind="server", name=server_id, url=controller_url,
                          token=token_reader(token_file), ca_pem=current_ca,
                          open_stream=dial_controller, log=log)
    await nursery.start(link.run, RoutesConfig, apply)

How the bytes reach the controller is the role's: a server dials it (`open_stream`); an
agent opens a tunnel stream, and asks for its first certificate through a bootstrap
connection (its own `requester`). Everything after that is here, once.
"""

from __future__ import annotations

import ssl
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

import trio
from pydantic import BaseModel

from nodeagent.configstream.client import (
    PostError,
    WatchStatus,
    controller_address,
    post_json,
    watch_config,
)
from nodeagent.configstream.protocol import node_config_path, servers_config_path
from nodeagent.ops.logs import StructuredLogger
from nodeagent.trust import pki
from nodeagent.trust.enrollment import (
    IdentityKeeper,
    IssuedIdentity,
    Requester,
    request_certificate,
)

M = TypeVar("M", bound=BaseModel)


class ControllerLink:
    """`kind` "node" (an agent, `name` its node) or "server" (`name` its server id).
    `token()` reads the projected token (at each request: the kubelet rotates it);
    `ca_pem()` gives the bundle that verifies the controller as it is now (a CA rotation
    changes it); `open_stream()` reaches the controller. `requester`: how to ask for a
    certificate, when not simply over `open_stream` (the agent's bootstrap path); it is
    built with the link, so it may read `link.keeper.identity` to present it on renewal.
    `on_renewed` hears of every new certificate (to swap TLS contexts)."""

    def __init__(self, *, kind: Literal["node", "server"], name: str, url: str,
                 token: Callable[[], str], ca_pem: Callable[[], bytes],
                 open_stream: Callable[[], Awaitable[trio.abc.Stream]],
                 log: StructuredLogger,
                 requester: Callable[[ControllerLink], Requester] | None = None,
                 on_renewed: Callable[[IssuedIdentity], None] = lambda _: None) -> None:
        self.kind = kind
        self.name = name
        self.host, self.port = controller_address(url)
        self.path = node_config_path(name) if kind == "node" else servers_config_path(name)
        self.token = token
        self.ca_pem = ca_pem
        self.open_stream = open_stream
        self.log = log
        self.status = WatchStatus(url)
        self.keeper = IdentityKeeper(kind, requester(self) if requester else self._request,
                                     log=log, on_renewed=on_renewed)

    async def _request(self, key: pki.PrivateKey) -> IssuedIdentity:
        return await request_certificate(
            self.open_stream, host=self.host, token=self.token(), kind=self.kind, key=key,
            ca_pem=self.ca_pem(), present=self.keeper.identity)

    def watch_context(self) -> ssl.SSLContext:
        """At each (re)connect of the watch: the current certificate, verifying the
        controller with the bundle as it is now."""
        identity = self.keeper.identity
        assert identity is not None, "the watch starts after the first certificate"
        return identity.client_context(ca=self.ca_pem())

    async def post(self, path: str, body: bytes, *, answer_within: float = 10.0
                   ) -> tuple[int, dict[str, Any]]:
        """POST a report to the controller (a server's activity and wake requests),
        presenting this link's certificate; PostError when there is no answer. Before
        the first certificate: PostError too."""
        if self.keeper.identity is None:
            raise PostError("no certificate from the controller yet")
        return await post_json(open_stream=self.open_stream, host=self.host, path=path,
                               body=body, tls=self.watch_context(), answer_within=answer_within)

    async def run(self, model: type[M], apply: Callable[[M], Awaitable[None]], *,
                  running: dict[str, Any] | None = None, serve_before_identity: bool = False,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Get the first certificate (retrying until the controller signs), then keep it
        renewed and the config watch open, until cancelled. Reports started once the
        first certificate is in, or at once with `serve_before_identity` (a server that
        serves the routes it persisted meanwhile). `running`: see `watch_config`."""
        if serve_before_identity:
            task_status.started()
        self.log.info(f"asking the controller for this {self.kind}'s certificate")
        await self.keeper.obtain()
        if not serve_before_identity:
            task_status.started()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.keeper.renew_forever)
            await watch_config(open_stream=self.open_stream, host=self.host, path=self.path,
                               tls=self.watch_context, model=model, apply=apply,
                               status=self.status, running=running, log=self.log)
