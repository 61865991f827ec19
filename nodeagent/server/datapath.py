"""The server's data-path policy and dialing: what a stream may reach, and how the server
connects to it.

- An agent's stream to an address another node owns is a relay: allowed only by a relay
  policy naming both. To the controller (config and signing streams): always. Anything
  else is egress: allowed by the node's egress rules, and never into the protected floor
  (loopback, link-local, the API server, the Service range) unless a CIDR rule names that
  range. A bootstrap connection's streams reach the controller and nothing else.
- An Ingress's direct backend (no node: a name a namespace's user controls) is dialed
  only outside the protected floor.
- Names are resolved here once and every address checked (`dial_checked`): a name with one
  protected address is refused whole, and the connection goes to exactly the addresses
  checked, so DNS cannot rebind between the check and the connect.

Refusals are FORBIDDEN, counted by reason and logged (`refusals.PolicyRefusals`).
Nothing here is an open proxy.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio

from nodeagent.config import RoutesConfig
from nodeagent.config.routes import WAKE_KEY
from nodeagent.http.routetable import Backend
from nodeagent.server.refusals import PolicyRefusals
from tunnel import protocol as p
from tunnel.endpoint import StreamRefusedError, TunnelConnection
from tunnel.errors import StreamFailed
from tunnel.spliceloop import OnEnd, OnRefused, SpliceOwner, open_in_loop, reset_socket
from tunnel.stream import TunnelStream
from tunnel.tcp import DialFailed, connect_tcp
from tunnel.udp import connect_udp

Resolver = Callable[[str, int], Awaitable[list[str]]]


class NodeStreamOpener(Protocol):
    """Opens a stream through a node's tunnel (TunnelServer.open_stream, tracked)."""

    async def __call__(self, node: str, target: p.Target,
                       metadata: dict[str, str]) -> TunnelStream: ...


async def resolve_tcp(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to for TCP, in the resolver's order, once each."""
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DialFailed("dns", f"cannot resolve {host}: {exc.strerror}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise DialFailed("dns", f"{host} has no addresses")
    return addresses


class DataPath:
    """Decides and dials the destinations of the server's streams."""

    def __init__(self, *, routes: Callable[[], RoutesConfig], open_stream: NodeStreamOpener,
                 refusals: PolicyRefusals, dial_timeout: float,
                 controller: tuple[str, int] | None, resolve: Resolver = resolve_tcp,
                 live_connection: Callable[[str], TunnelConnection] | None = None) -> None:
        """`routes`: the routes in force (read per stream); `controller`: the
        controller's (host, port) in controller mode, which agents always reach;
        `live_connection`: a node's tunnel connection, or NodeNotConnected
        (TunnelServer.live_connection), for `open_to_now`."""
        self._routes = routes
        self._open_stream = open_stream
        self._live_connection = live_connection
        self._refusals = refusals
        self.dial_timeout = dial_timeout
        self.controller = controller
        # How names are resolved for egress and direct backends (tests inject theirs).
        self.resolve = resolve

    def is_controller(self, target: p.Target) -> bool:
        return (target.host, target.port) == self.controller

    def agent_destination(self, node: str, owner: str | None, target: p.Target,
                          origin: str, routes: RoutesConfig | None = None) -> str:
        """Where a stream `node`'s agent opened goes, decided without waiting: "relay" (to
        `owner`, the node whose address it is, where a relay policy allows), "controller",
        or "egress" (the node's rules allow it; an IP literal is checked here in full, a
        name's addresses once resolved, by `dial_checked`). Raises FORBIDDEN (counted and
        logged) when policy refuses: nothing is dialed before this has said yes."""
        routes = routes or self._routes()
        if owner is not None and owner != node:
            if not routes.relay_allows(node, target.host, target.port, target.protocol):
                raise self._refusals.forbid(
                    "relay_not_allowed", node, f"{target} belongs to node {owner}; no "
                    f"relay policy lets node {node} reach it", target=str(target),
                    origin=origin)
            return "relay"
        if self.is_controller(target):
            # The config and signing streams: always, whatever the egress rules.
            return "controller"
        why = routes.check_egress(node, target.host, target.port, target.protocol)
        if why is None:
            return "egress"
        if why == "not_allowed":
            raise self._refusals.forbid("egress_not_allowed", node,
                                        f"{target} is not in node {node}'s egress allow list",
                                        target=str(target), origin=origin)
        raise self._refusals.forbid("egress_protected", node,
                                    f"{target} is protected (loopback, link-local, the API "
                                    f"server or the Service range) and no egress rule of "
                                    f"node {node} names its range", target=str(target),
                                    origin=origin)

    async def open_for_agent(self, node: str, owner: str | None, target: p.Target,
                             origin: str) -> trio.abc.HalfCloseableStream:
        """The destination of a stream `node`'s agent opened, as `agent_destination`
        decides: relayed to `owner`, the controller, or egress. Raises StreamFailed
        (FORBIDDEN when policy refuses)."""
        where = self.agent_destination(node, owner, target, origin)
        if where == "relay":
            assert owner is not None
            return await self.open_to(owner, target.host, target.port, f"{node}/{origin}")
        if where == "controller":
            return await connect_tcp(target.host, target.port,
                                     connect_timeout=self.dial_timeout)
        return await self.dial_checked(
            target.host, target.port,
            lambda address: self._routes().address_protected(
                node, address, target.port, target.protocol),
            lambda address: self._refusals.forbid(
                "egress_protected", node, f"{target.host} resolves to {address}, "
                f"which is protected (loopback, link-local, the API server or the "
                f"Service range) and no CIDR egress rule of node {node} names its "
                f"range", target=str(target), origin=origin))

    def flow_for_agent(self, node: str, owner: str | None, target: p.Target,
                       origin: str) -> socket.socket:
        """The destination of a flow (udp) `node`'s agent opened: egress only, decided
        exactly as for TCP (the node's egress rules for udp, the protected floor), to an
        address (names are not resolved for UDP). A connected UDP socket; raises
        StreamFailed (FORBIDDEN when policy refuses)."""
        routes = self._routes()
        if owner is not None and owner != node:
            raise self._refusals.forbid(
                "relay_not_allowed", node, f"{target} belongs to node {owner}; UDP is not "
                f"relayed between nodes", target=str(target), origin=origin)
        why = routes.check_egress(node, target.host, target.port, "udp")
        if why is None and routes.address_protected(node, target.host, target.port, "udp"):
            why = "protected"
        if why == "not_allowed":
            raise self._refusals.forbid("egress_not_allowed", node,
                                        f"{target} is not in node {node}'s egress allow list",
                                        target=str(target), origin=origin)
        if why is not None:
            raise self._refusals.forbid(
                "egress_protected", node, f"{target} is protected (loopback, link-local, "
                f"the API server or the Service range) and no egress rule of node {node} "
                f"names its range", target=str(target), origin=origin)
        return connect_udp(target.host, target.port)

    async def open_for_bootstrap(self, claimed_node: str,
                                 target: p.Target) -> trio.abc.HalfCloseableStream:
        """The destination of a bootstrap connection's stream: the controller (whose
        signer checks the agent's token, inside TLS end to end) or nowhere."""
        if not self.is_controller(target):
            self._refusals.warning(
                "bootstrap", "bootstrap stream refused: only the controller is reachable",
                claimed_node=claimed_node, target=str(target))
            raise StreamFailed(p.StreamReason.FORBIDDEN, "a connection without a "
                               "certificate may only reach the controller")
        return await connect_tcp(target.host, target.port, connect_timeout=self.dial_timeout)

    async def dial_direct_backend(self, backend: Backend,
                                  route_name: str) -> trio.SocketStream:
        """An Ingress's direct backend (opted in; a name a namespace's user controls):
        dialed only outside the protected floor."""
        return await self.dial_checked(
            backend.host, backend.port,
            lambda address: self._routes().address_protected("*", address, backend.port),
            lambda address: self._refusals.forbid(
                "backend_protected", route_name, f"{backend.host} is or resolves to "
                f"{address}, which is protected (loopback, link-local, the API server or "
                f"the Service range)", backend=f"{backend.host}:{backend.port}"))

    async def open_to(self, node: str | None, host: str, port: int,
                      origin: str, *, wakes: bool = False) -> trio.abc.HalfCloseableStream:
        """A stream to host:port through `node` (or directly when node is None).
        `wakes`: the target is a backend of a Service that scales to zero (WAKE_KEY).
        Raises StreamFailed (StreamRefusedError or DialFailed) with the reason."""
        if node is None:
            return await connect_tcp(host, port, connect_timeout=self.dial_timeout)
        metadata = {"origin": origin, WAKE_KEY: "1"} if wakes else {"origin": origin}
        with trio.move_on_after(self.dial_timeout) as scope:
            return await self._open_stream(node, p.Target(host, port), metadata)
        assert scope.cancelled_caught
        raise StreamRefusedError(p.StreamReason.TIMEOUT,
                                 f"node {node} did not answer within {self.dial_timeout}s")

    @property
    def opens_now(self) -> bool:
        """Whether `open_to_now` can be used (it needs the nodes' connections)."""
        return self._live_connection is not None

    def open_to_now(self, node: str, host: str, port: int, origin: str,
                    client: socket.socket, *, to_tunnel: bytes, owner: SpliceOwner | None,
                    on_accepted: Callable[[], None], on_refused: OnRefused,
                    on_end: OnEnd, retried: bool = False) -> TunnelStream | None:
        """`open_to` for a caller that does not wait (a TCP mapping's accept loop): a
        stream to host:port through `node`, joined to the client connection `client` by
        the node's tunnel connection's splice loop once accepted (tunnel/spliceloop.py
        `open_in_loop`, `to_tunnel` first), within the dial timeout. Any failure (not
        connected, refused, timed out, the tunnel lost, the client gone) resets the
        client and goes to `on_refused`; the tunnel lost while a newer connection of the
        node is up (the agent reconnected), the open is tried there once, as
        TunnelServer.open_stream does. The stream, or None if none was opened."""
        live = self._live_connection
        assert live is not None
        try:
            conn = live(node)
        except StreamFailed as exc:
            reset_socket(client)
            on_refused(exc)
            return None

        def reopen(sock: socket.socket) -> bool:
            try:
                newer = live(node)
            except StreamFailed:
                return False
            if newer is conn:
                return False
            self.open_to_now(node, host, port, origin, sock, to_tunnel=to_tunnel,
                             owner=owner, on_accepted=on_accepted, on_refused=on_refused,
                             on_end=on_end, retried=True)
            newer.flush()  # its OPEN: nobody else flushes this connection now
            return True

        return open_in_loop(conn, p.Target(host, port), {"origin": origin}, client,
                            timeout=self.dial_timeout, on_accepted=on_accepted,
                            on_refused=on_refused, on_end=on_end, to_tunnel=to_tunnel,
                            owner=owner, on_lost=None if retried else reopen)

    async def open_flow(self, node: str, target: p.Target, origin: str,
                        idle_timeout: float) -> TunnelStream:
        """A flow (udp target) through `node`'s tunnel, within the dial timeout; the
        agent learns the idle timeout from the metadata. Raises StreamFailed."""
        metadata = {"origin": origin, "idle": f"{idle_timeout:g}"}
        with trio.move_on_after(self.dial_timeout) as scope:
            return await self._open_stream(node, target, metadata)
        assert scope.cancelled_caught
        raise StreamRefusedError(p.StreamReason.TIMEOUT,
                                 f"node {node} did not answer within {self.dial_timeout}s")

    async def dial_checked(self, host: str, port: int, protected: Callable[[str], bool],
                           refuse: Callable[[str], Exception]) -> trio.SocketStream:
        """Dial host:port, a name resolved here once: every address it resolves to must
        pass `protected` (else `refuse(address)` is raised: a name with one protected
        address is refused whole), and the connection goes to exactly those checked
        addresses, in order — no second resolution, so no DNS-rebinding window between
        the check and the connect. An IP literal is checked and dialed as it is."""
        try:
            ipaddress.ip_address(host)
        except ValueError:
            literal = False
        else:
            literal = True
        failure: StreamFailed | None = None
        with trio.move_on_after(self.dial_timeout):
            addresses = [host] if literal else await self.resolve(host, port)
            for address in addresses:
                if protected(address):
                    raise refuse(address)
            for address in addresses:
                try:
                    return await connect_tcp(address, port, connect_timeout=None)
                except DialFailed as exc:
                    failure = exc
        raise failure or DialFailed("timeout", f"connecting to {host}:{port} timed out "
                                               f"after {self.dial_timeout:g}s")
