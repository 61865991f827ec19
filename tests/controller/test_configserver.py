"""The config watch stream over real TLS sockets: ConfigStreamServer (with its in-memory
serving certificate) and watch_config presenting node and server certificates."""

from __future__ import annotations

import functools
import ssl
from collections.abc import Callable
from typing import Any

import h11
import pytest
import trio

from nodeagent.config import AllowRule, NodeConfig, RoutesConfig
from nodeagent.configstream import protocol
from nodeagent.configstream.client import WatchStatus, announced_idle_timeout, watch_config
from nodeagent.controller import compute
from nodeagent.controller.compute import ConfigVersions
from nodeagent.controller.configserver import ConfigStreamServer, Identity, peer_identity
from nodeagent.controller.servingtls import ServingTLS, service_names
from nodeagent.ops.jsonhttp import Reply, json_reply
from nodeagent.trust import pki
from tunnel.backoff import Backoff

NS = "nodeagent"
CA = pki.create_ca("stream test CA")


def node_context(node: str, ca: pki.CertificateAuthority = CA) -> ssl.SSLContext:
    leaf = pki.issue_client_certificate(ca, node)
    return pki.client_ssl_context(CA.certificate, leaf.certificate, leaf.key_pem)


def server_context(pod: str) -> ssl.SSLContext:
    leaf = pki.issue_server_identity(CA, pod)
    return pki.client_ssl_context(CA.certificate, leaf.certificate, leaf.key_pem)


ANONYMOUS = pki.client_ssl_context(CA.certificate)


async def start(nursery: trio.Nursery, versions: ConfigVersions, heartbeat: float = 15.0,
                extra_names: tuple[str, ...] = ("127.0.0.1",)
                ) -> tuple[ConfigStreamServer, int]:
    dns, ips = service_names("nodeagent-controller", NS, extra_names)
    tls = ServingTLS(lambda: CA, dns, ips)
    server = ConfigStreamServer(versions, tls=tls.context, heartbeat=heartbeat)
    listeners = await nursery.start(server.run, "127.0.0.1", 0)
    return server, listeners[0].socket.getsockname()[1]


def watcher(port: int, path: str, model: Any, applied: list[Any], status: WatchStatus,
            tls: ssl.SSLContext, apply: Any = None, host: str = "127.0.0.1") -> Any:
    async def default_apply(config: Any) -> None:
        applied.append(config)
    return functools.partial(
        watch_config, open_stream=functools.partial(trio.open_tcp_stream, "127.0.0.1", port),
        host=host, path=path, tls=lambda: tls, model=model,
        apply=apply or default_apply, status=status,
        backoff=Backoff(initial=0.05, maximum=0.2), idle_timeout=2.0)


async def wait_until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    """Poll a condition on plain data the code under test updates (no event to wait on)."""
    with trio.fail_after(within):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.01)


async def get(port: int, path: str, context: ssl.SSLContext, host: str = "127.0.0.1",
              method: str = "GET") -> tuple[int, bytes]:
    """One request over TLS; the status and the body (the first chunk of a watch)."""
    stream = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", port), context,
                            server_hostname=host)
    async with stream:
        conn = h11.Connection(h11.CLIENT)
        await stream.send_all(conn.send(h11.Request(method=method, target=path, headers=[
            ("host", host), ("content-length", "0")])) + conn.send(h11.EndOfMessage()))
        status, body = 0, b""
        with trio.fail_after(5):
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(bytes(await stream.receive_some(65536)))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
                    if status == 200:
                        return status, body  # a watch never ends
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    return status, body


async def test_node_watch_gets_current_then_each_new_version(nursery: trio.Nursery) -> None:
    versions = ConfigVersions()
    server, port = await start(nursery, versions)
    applied: list[NodeConfig] = []
    status = WatchStatus("https://controller")
    nursery.start_soon(watcher(port, "/v1/config/nodes/edge-1", NodeConfig, applied, status,
                               node_context("edge-1")))
    # Unknown node: an empty config at version 0 until the controller knows it.
    await wait_until(lambda: len(applied) == 1)
    assert applied[0].version == 0 and applied[0].allow == ()
    assert server.subscribers["node/edge-1"] == 1
    versions.update("node/edge-1", NodeConfig(allow=(AllowRule(host="10.1.0.5"),)))
    versions.update("node/other", NodeConfig(allow=(AllowRule(host="10.9.9.9"),)))
    server.notify()
    await wait_until(lambda: len(applied) == 2)
    assert applied[1].version == 1 and applied[1].allows("10.1.0.5", 80)
    assert status.as_dict()["config_version"] == 1 and status.state == "watching"


async def servers_watch(nursery: trio.Nursery, versions: ConfigVersions, *,
                        heartbeat: float, idle_timeout: float
                        ) -> tuple[ConfigStreamServer, list[RoutesConfig], WatchStatus]:
    """A server replica's routes watch against a stream with `heartbeat`, running in
    `nursery` with the watcher's own `idle_timeout`, once its first config is applied."""
    server, port = await start(nursery, versions, heartbeat=heartbeat)
    applied: list[RoutesConfig] = []
    status = WatchStatus("https://controller")
    watch = watcher(port, "/v1/config/servers/s1", RoutesConfig, applied, status,
                    server_context("nodeagent-server-0"))
    nursery.start_soon(functools.partial(watch, idle_timeout=idle_timeout))
    await wait_until(lambda: len(applied) == 1)
    return server, applied, status


async def test_server_watch_stays_alive_on_heartbeats(nursery: trio.Nursery) -> None:
    versions = ConfigVersions()
    versions.update("servers", RoutesConfig(egress=(AllowRule(host="10.1.0.1"),)))
    server, applied, status = await servers_watch(nursery, versions, heartbeat=0.1,
                                                  idle_timeout=0.3)
    # Quiet for longer than the client's idle timeout: heartbeats keep the watch alive.
    await trio.sleep(1.0)
    assert status.state == "watching" and server.subscribers["servers"] == 1
    versions.update("servers", RoutesConfig())
    server.notify()
    await wait_until(lambda: len(applied) == 2)
    assert [c.version for c in applied] == [1, 2]


async def test_heartbeats_wake_only_the_watches_that_waited_long_enough(
        autojump_clock: trio.abc.Clock) -> None:
    # One task wakes the idle watches, in the order they started waiting, and only those
    # that waited `heartbeat` seconds; a change in between restarts a key's wait.
    server = ConfigStreamServer(ConfigVersions(), tls=_no_tls, heartbeat=15.0)
    start_time = trio.current_time()
    first = server._wakeup("node/a")
    await trio.sleep(10)
    second = server._wakeup("node/b")
    third = server._wakeup("servers")
    assert server.wake_idle(start_time + 14.9) == 0
    assert server.wake_idle(start_time + 15) == 1
    assert first.is_set() and not second.is_set() and not third.is_set()
    server.notify(["servers"])  # a change: woken now, waits afresh from here
    assert third.is_set()
    await trio.sleep(10)
    renewed = server._wakeup("servers")
    assert server.wake_idle(start_time + 25) == 1  # node/b only
    assert second.is_set() and not renewed.is_set()
    assert server.wake_idle(start_time + 34.9) == 0
    assert server.wake_idle(start_time + 35) == 1 and renewed.is_set()


async def _no_tls() -> ssl.SSLContext:
    raise AssertionError("no connection in this test")


async def test_watcher_waits_three_announced_heartbeats_not_its_default(
        nursery: trio.Nursery) -> None:
    # The controller announces its interval (here 0.5 s); a watcher whose own default
    # would give up after 0.2 s of quiet waits three intervals instead, and stays.
    versions = ConfigVersions()
    versions.update("servers", RoutesConfig())
    server, _, status = await servers_watch(nursery, versions, heartbeat=0.5,
                                            idle_timeout=0.2)
    await trio.sleep(1.2)  # six of the watcher's defaults, two heartbeats
    assert status.state == "watching" and status.last_error is None
    assert server.subscribers["servers"] == 1


@pytest.mark.parametrize(("headers", "expected"), [
    ([(b"X-Nodeagent-Heartbeat", b"60")], 180.0),
    ([(b"x-nodeagent-heartbeat", b"2.5")], 7.5),
    ([], 45.0),  # an older controller: it sends every 15 s
    ([(b"x-nodeagent-heartbeat", b"soon")], 45.0),
    ([(b"x-nodeagent-heartbeat", b"0")], 45.0),
    ([(b"x-nodeagent-heartbeat", b"nan")], 45.0),
    ([(b"x-nodeagent-heartbeat", b"1e9")], 45.0),
])
def test_announced_heartbeat_bounds(headers: list[tuple[bytes, bytes]],
                                    expected: float) -> None:
    assert announced_idle_timeout(headers, 45.0) == expected


def forbidden_count(server: ConfigStreamServer) -> float:
    value = server.metrics.registry.get_sample_value(
        "nodeagent_controller_config_requests_total",
        {"outcome": "refused", "reason": "forbidden"})
    return value or 0.0


@pytest.mark.parametrize(("path", "who"), [
    ("/v1/config/nodes/edge-2", "node edge-1"),     # another node's config
    ("/v1/config/servers/s1", "node edge-1"),       # a node on the servers' routes
    ("/v1/config/nodes/edge-1", "anonymous"),       # no certificate
    ("/v1/config/servers/s1", "anonymous"),
    ("/v1/config/nodes/edge-1", "server s1"),       # a server identity is no node
    # The servers' tunnel certificate (clientAuth, CN nodeagent-server) names nobody.
    ("/v1/config/nodes/nodeagent-server", "tunnel certificate"),
])
async def test_identity_decides_what_a_client_reads(nursery: trio.Nursery, path: str,
                                                    who: str) -> None:
    versions = ConfigVersions()
    versions.update("servers", RoutesConfig())
    versions.update("node/edge-2", NodeConfig(allow=(AllowRule(host="10.2.0.9"),)))
    server, port = await start(nursery, versions)
    tunnel = pki.issue_server_certificate(CA, ["nodeagent-server"],
                                          common_name="nodeagent-server")
    contexts = {"node edge-1": node_context("edge-1"), "anonymous": ANONYMOUS,
                "server s1": server_context("s1"),
                "tunnel certificate": pki.client_ssl_context(
                    CA.certificate, tunnel.certificate, tunnel.key_pem)}
    status, body = await get(port, path, contexts[who])
    assert status == 403, body
    assert b'"reason":"forbidden"' in body and b"10.2.0.9" not in body
    assert body.count(b"\n") == 1  # one line
    assert forbidden_count(server) == 1


async def test_own_config_is_readable_and_refusals_are_counted_per_request(
        nursery: trio.Nursery) -> None:
    versions = ConfigVersions()
    versions.update("node/edge-1", NodeConfig(allow=(AllowRule(host="10.1.0.5"),)))
    versions.update("servers", RoutesConfig(egress=(AllowRule(host="10.7.0.1"),)))
    server, port = await start(nursery, versions)
    status, body = await get(port, "/v1/config/nodes/edge-1?after=-1", node_context("edge-1"))
    assert status == 200 and b"10.1.0.5" in body
    status, body = await get(port, "/v1/config/servers/any", server_context("s1"))
    assert status == 200 and b"10.7.0.1" in body
    for _ in range(3):
        assert (await get(port, "/v1/config/nodes/edge-1", ANONYMOUS))[0] == 403
    assert forbidden_count(server) == 3


async def test_a_config_that_fails_to_apply_is_not_retried(nursery: trio.Nursery) -> None:
    versions = ConfigVersions()
    versions.update("node/a", NodeConfig(allow=(AllowRule(host="10.1.0.5"),)))
    server, port = await start(nursery, versions, heartbeat=0.05)
    attempts: list[int] = []

    async def failing(config: NodeConfig) -> None:
        attempts.append(config.version)
        if config.version == 1:
            raise ValueError("interface cni0 does not exist")

    status = WatchStatus("https://controller")
    nursery.start_soon(watcher(port, "/v1/config/nodes/a", NodeConfig, [], status,
                               node_context("a"), apply=failing))
    await wait_until(lambda: attempts == [1])
    await trio.sleep(0.3)  # heartbeats come and go: version 1 is not tried again
    assert attempts == [1] and "cni0" in (status.last_error or "")
    versions.update("node/a", NodeConfig())
    server.notify()
    await wait_until(lambda: attempts == [1, 2])
    assert status.applied_version == 2 and status.last_error is None


async def test_a_forbidden_watch_is_retried_with_backoff(nursery: trio.Nursery) -> None:
    _, port = await start(nursery, ConfigVersions())
    status = WatchStatus("https://controller")
    nursery.start_soon(watcher(port, "/v1/config/nodes/a", NodeConfig, [], status,
                               node_context("b")))
    await wait_until(lambda: "403" in (status.last_error or ""))
    assert status.applied_version == -1 and "forbidden" in (status.last_error or "")


@pytest.mark.parametrize(("path", "method", "code", "reason"), [
    ("/v1/config/bogus/a", "GET", 404, b"not_found"),
    ("/v1/config/nodes/a?after=x", "GET", 400, b"bad_after"),
    ("/v1/config/nodes/a", "POST", 405, b"method_not_allowed"),
])
async def test_bad_requests_get_clear_statuses(nursery: trio.Nursery, path: str,
                                               method: str, code: int, reason: bytes) -> None:
    _, port = await start(nursery, ConfigVersions())
    status, body = await get(port, path, node_context("a"), method=method)
    assert status == code and b'"reason":"' + reason + b'"' in body


@pytest.mark.parametrize("name", ["nodeagent-controller", "nodeagent-controller.nodeagent",
                                  "nodeagent-controller.nodeagent.svc",
                                  "nodeagent-controller.nodeagent.svc.cluster.local",
                                  "127.0.0.1", "controller.test"])
async def test_listener_presents_a_certificate_for_the_configured_names(
        nursery: trio.Nursery, name: str) -> None:
    _, port = await start(nursery, ConfigVersions(),
                          extra_names=("127.0.0.1", "controller.test"))
    status, _ = await get(port, "/v1/config/nodes/a", node_context("a"), host=name)
    assert status == 200


async def test_listener_is_not_valid_for_other_names_nor_for_clients_of_another_ca(
        nursery: trio.Nursery) -> None:
    server, port = await start(nursery, ConfigVersions())
    with pytest.raises(trio.BrokenResourceError) as info:
        await get(port, "/v1/config/nodes/a", node_context("a"), host="evil.example")
    assert isinstance(info.value.__cause__, ssl.SSLCertVerificationError)
    # A certificate from another CA does not get through the handshake at all.
    other = pki.create_ca("another CA")
    leaf = pki.issue_client_certificate(other, "a")
    foreign = pki.client_ssl_context(CA.certificate, leaf.certificate, leaf.key_pem)
    # (TLS 1.3: the client finishes first and may see the refusal as a reset or as the
    # connection closing before any response; either way, no answer.)
    with pytest.raises((trio.BrokenResourceError, trio.ClosedResourceError,
                        h11.RemoteProtocolError)):
        await get(port, "/v1/config/nodes/a", foreign)
    await wait_until(lambda: (server.metrics.registry.get_sample_value(
        "nodeagent_controller_config_requests_total",
        {"outcome": "refused", "reason": "tls_handshake"}) or 0) >= 1)


def test_peer_identity_reads_only_our_identities() -> None:
    def der(issued: pki.IssuedCertificate) -> bytes:
        return issued.certificate.public_bytes(pki.serialization.Encoding.DER)
    assert peer_identity(der(pki.issue_client_certificate(CA, "edge-1"))) == \
        Identity("node", "edge-1")
    assert peer_identity(der(pki.issue_server_identity(CA, "server-0"))) == \
        Identity("server", "server-0")
    assert peer_identity(der(pki.issue_server_certificate(CA, ["x"]))) is None
    assert peer_identity(None) is None and peer_identity(b"") is None


def test_per_address_caps_count_an_ipv4_address_or_an_ipv6_64() -> None:
    from nodeagent.controller.configserver import ConnectionLimits, peer_key
    assert peer_key("10.0.0.7") == "10.0.0.7"
    assert peer_key("::ffff:10.0.0.7") == "10.0.0.7"
    assert peer_key("2001:db8:1:2:aaaa::1") == peer_key("2001:db8:1:2:bbbb::9") == \
        "2001:db8:1:2::/64"
    assert peer_key("fe80::1%eth0") == "fe80::/64"
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limits = ConnectionLimits(max_connections=10**6)
    assert limits.effective_max() == (10**6 if soft == resource.RLIM_INFINITY
                                      else max(1, min(10**6, soft - 128)))


@pytest.mark.parametrize("who", ["node edge-1", "anonymous"])
async def test_only_a_server_may_post_scale_to_zero_reports(nursery: trio.Nursery,
                                                            who: str) -> None:
    seen: list[tuple[str, str, bytes]] = []

    async def reports(kind: str, server_id: str, body: bytes) -> Reply:
        seen.append((kind, server_id, body))
        return json_reply(202, {"state": "waking"})

    dns, ips = service_names("nodeagent-controller", NS, ("127.0.0.1",))
    server = ConfigStreamServer(ConfigVersions(), tls=ServingTLS(lambda: CA, dns, ips).context,
                                reports=reports)
    port = (await nursery.start(server.run, "127.0.0.1", 0))[0].socket.getsockname()[1]
    contexts = {"node edge-1": node_context("edge-1"), "anonymous": ANONYMOUS}
    for path in ("/v1/servers/s1/wake", "/v1/servers/s1/activity"):
        status, body = await get(port, path, contexts[who], method="POST")
        assert status == 403 and b'"reason":"forbidden"' in body, body
    assert seen == [] and forbidden_count(server) == 2
    status, body = await get(port, "/v1/servers/s1/wake", server_context("s1"),
                             method="POST")
    assert status == 202 and b"waking" in body
    assert seen == [("wake", "s1", b"")]
    status, _ = await get(port, "/v1/servers/s1/wake", server_context("s1"))
    assert status == 405


async def test_a_version_is_encoded_once_and_every_watch_of_it_gets_those_bytes(
        nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every server replica watches the same key: the routes of 10,000 hosts are encoded
    # once per version, not once per replica (nor again for a reconnecting watch).
    encoded: list[int] = []

    def counting(version: int, config: Any) -> bytes:
        encoded.append(version)
        return protocol.config_line(version, config)

    monkeypatch.setattr(compute, "config_line", counting)
    versions = ConfigVersions()
    routes = RoutesConfig(egress=(AllowRule(host="10.1.0.1"),))
    versions.update("servers", routes)
    _, port = await start(nursery, versions)
    bodies = [await get(port, "/v1/config/servers/s", server_context(f"nodeagent-server-{i}"))
              for i in range(3)]
    assert bodies == [(200, protocol.config_line(1, routes))] * 3
    assert encoded == [1]
    newer = RoutesConfig(egress=(AllowRule(host="10.1.0.2"),))
    versions.update("servers", newer)
    bodies = [await get(port, "/v1/config/servers/s", server_context(f"nodeagent-server-{i}"))
              for i in range(2)]
    assert bodies == [(200, protocol.config_line(2, newer))] * 2
    assert encoded == [1, 2]
    # A node the controller has no config for gets the empty config at version 0.
    status, body = await get(port, "/v1/config/nodes/edge-9", node_context("edge-9"))
    assert (status, body) == (200, protocol.config_line(0, NodeConfig()))
