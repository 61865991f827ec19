"""A compromised server cannot hand an agent its config.

The agent's config watch runs TLS to the controller end to end (inside a tunnel stream the
server relays), verified against the cluster CA *and the controller's name*. A server
holds a certificate from the same CA — its tunnel certificate — so the name is what stops
it: here a "server" answers the watch with its own real certificate and a config that
opens everything, and the agent applies nothing. The same listener with the controller's
certificate is applied at once (so the test can tell the two apart).
"""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncGenerator

import pytest
import trio
import trio.testing

from nodeagent.config import NodeConfig
from nodeagent.configstream.client import WatchStatus, watch_config
from nodeagent.ops.jsonhttp import Reply, Request, StreamingReply, serve_http
from nodeagent.trust import pki
from tunnel.backoff import Backoff

CONTROLLER = "nodeagent-controller.nodeagent.svc"
EVIL = {"version": 99, "config": {"allow": ["0.0.0.0/0:*"]}}


async def serve_config(nursery: trio.Nursery, issued: pki.IssuedCertificate) -> int:
    context = pki.server_ssl_context(issued.certificate_pem, issued.key_pem)

    async def lines() -> AsyncGenerator[bytes, None]:
        yield (json.dumps(EVIL) + "\n").encode()
        await trio.sleep_forever()

    async def answer(request: Request) -> Reply | StreamingReply:
        return StreamingReply(lines())

    async def handle(stream: trio.SocketStream) -> None:
        tls = trio.SSLStream(stream, context, server_side=True)
        try:
            await tls.do_handshake()
        except trio.BrokenResourceError:
            return
        await serve_http(tls, answer)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handle, 0,
                                                      host="127.0.0.1"))
    port: int = listeners[0].socket.getsockname()[1]
    return port


async def watch_for(port: int, ca: pki.CertificateAuthority, seconds: float
                    ) -> tuple[list[NodeConfig], WatchStatus]:
    node = pki.issue_client_certificate(ca, "edge-1")
    context = pki.client_ssl_context(ca.certificate_pem, node.certificate_pem, node.key_pem)
    applied: list[NodeConfig] = []
    status = WatchStatus("https://" + CONTROLLER)

    async def apply(config: NodeConfig) -> None:
        applied.append(config)

    with trio.move_on_after(seconds):
        await watch_config(
            open_stream=functools.partial(trio.open_tcp_stream, "127.0.0.1", port),
            host=CONTROLLER, path="/v1/config/nodes/edge-1", model=NodeConfig, apply=apply,
            status=status, tls=lambda: context, backoff=Backoff(initial=0.05, maximum=0.2))
    return applied, status


@pytest.mark.parametrize("who", ["server", "controller"])
async def test_only_the_controller_can_answer_an_agents_config_watch(
        nursery: trio.Nursery, who: str) -> None:
    ca = pki.create_ca("cluster CA")
    if who == "server":  # the servers' real tunnel certificate, same CA, its own names
        issued = pki.issue_server_certificate(ca, ["nodeagent-server.nodeagent.svc",
                                                   "tunnel.example.com"])
    else:
        issued = pki.issue_server_certificate(ca, [CONTROLLER])
    port = await serve_config(nursery, issued)
    applied, status = await watch_for(port, ca, 1.5)
    if who == "server":
        assert applied == []
        assert status.applied_version == -1
        assert status.last_error is not None and "certificate" in status.last_error.lower()
    else:
        assert [c.version for c in applied] == [99]
    nursery.cancel_scope.cancel()


async def test_a_peer_that_never_answers_the_tls_handshake_is_given_up_on(
        autojump_clock: trio.abc.Clock) -> None:
    # Something accepts the bytes and never answers (a wedged relay): the watch says so
    # and tries again, instead of waiting for ever.
    ca = pki.create_ca("cluster CA")
    node = pki.issue_client_certificate(ca, "edge-1")
    context = pki.client_ssl_context(ca.certificate_pem, node.certificate_pem, node.key_pem)
    silent: list[trio.testing.MemoryReceiveStream] = []

    async def open_stream() -> trio.abc.Stream:
        ours, theirs = trio.testing.memory_stream_pair()
        silent.append(theirs)  # kept open, never read
        return ours

    status = WatchStatus("https://" + CONTROLLER)

    async def apply(config: NodeConfig) -> None:
        raise AssertionError("nothing to apply")

    with trio.move_on_after(60):
        await watch_config(open_stream=open_stream, host=CONTROLLER,
                           path="/v1/config/nodes/edge-1", tls=lambda: context,
                           model=NodeConfig, apply=apply, status=status,
                           backoff=Backoff(initial=1, maximum=1))
    assert status.last_error == "no TLS handshake with the controller within 20s"
    assert len(silent) >= 2  # and it tried again
