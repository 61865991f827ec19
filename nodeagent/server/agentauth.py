"""Which node a dialing agent is, and whether it may stay: authentication, admission and
revocation of agents' tunnels.

- Mutual TLS: the certificate names the node (a `nodeagent://node/<name>` URI SAN) and the
  HELLO's claim must match it.
- Token (standalone): the presented token must match the node's entry (or a "*" entry),
  compared in constant time. When the token files change, or a reloaded config file
  removes or changes a token (`reload_tokens`), a node whose token was removed or
  rotated loses its tunnel: an operator revoking a token expects its sessions to end.
- Controller mode: an authenticated node must also be admitted by the current routes (a
  known Node, not denied); a node the routes stop admitting is disconnected
  (`close_revoked`). An agent with neither certificate nor token that asks for
  `bootstrap` gets a bootstrap connection, whose streams reach only the controller's
  signer.

Every refusal is counted (bad input, or `PolicyRefusals` by reason) and logged at most once
a minute per node.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping, Sequence

from nodeagent.config import ConfigError, RoutesConfig, TokenEntry, valid_node_name
from nodeagent.ops.logs import StructuredLogger
from nodeagent.server.refusals import PolicyRefusals
from tunnel import protocol as p
from tunnel.endpoint import AuthenticationFailed
from tunnel.server import AgentSession, Bootstrap
from tunnel.transports import PeerInfo


class AgentAuthenticator:
    """Decides who a dialing agent is (TunnelServer's `authenticate`) and closes the
    tunnels of nodes that lose their right to one."""

    def __init__(self, *, tokens: Sequence[TokenEntry], controller_mode: bool,
                 client_certificates: bool, routes: Callable[[], RoutesConfig],
                 refusals: PolicyRefusals, on_bad_input: Callable[[], None],
                 log: StructuredLogger) -> None:
        """`tokens`: the config's token entries (read now); `client_certificates`: the
        tunnel verifies client certificates, so any node may hold one; `routes`: the
        routes in force (controller mode admits by them); `on_bad_input`: counts a
        malformed or unauthenticated HELLO."""
        self._entries = tokens
        self._tokens = [(entry.node, entry.read().encode()) for entry in tokens]
        self._controller_mode = controller_mode
        self._client_certificates = client_certificates
        self._routes = routes
        self._refusals = refusals
        self._bad_input = on_bad_input
        self.log = log
        # The token each registered node authenticated with (standalone): a reload that
        # removes or rotates it closes that node's tunnel (reload_tokens).
        self._session_tokens: dict[str, bytes] = {}

    async def authenticate(self, hello: p.Hello, peer: PeerInfo) -> str | Bootstrap:
        """Decide which node a dialing agent is. Mutual TLS: the certificate names the
        node and the claim must match. Token: must match the node's entry (or "*").
        Controller mode: an agent with neither that asks for `bootstrap` may fetch its
        certificate (Bootstrap), nothing else."""
        node = hello.identity.get("node", "")
        if not node:
            self._bad_input()
            raise AuthenticationFailed("HELLO names no node")
        if not isinstance(node, str) or not valid_node_name(node):
            # Before anything else: the name becomes a dict key, a metric label, log fields.
            self._bad_input()
            raise AuthenticationFailed("HELLO names an invalid node name (a node name is a "
                                       "lower-case DNS name of at most 253 characters)")
        if peer.certificate_der is not None:
            # Only agents with certificates need cryptography to read them (~9 MiB):
            # a server of token-authenticated agents never loads it.
            from nodeagent.trust.pki import node_name_from_certificate

            cert_node = node_name_from_certificate(peer.certificate_der)
            if cert_node is not None:
                if cert_node != node:
                    self._bad_input()
                    raise AuthenticationFailed(
                        f"certificate is for node {cert_node}, HELLO claims {node}")
                self._session_tokens.pop(node, None)
                return self._admitted(node)
        token = hello.identity.get("token") or _bearer(peer)
        if token is None and hello.identity.get("bootstrap") and self._controller_mode:
            return Bootstrap(node)  # reaches only the controller, which checks the token
        if token is None:
            self._bad_input()
            if peer.certificate_der is not None:
                raise AuthenticationFailed(
                    f"node {node} presented no token, and its certificate names no node "
                    f"(that takes a nodeagent://node/<name> URI SAN and clientAuth usage)")
            raise AuthenticationFailed(f"node {node} presented no token and no certificate")
        presented = token.encode()
        if self._token_valid(node, presented):
            admitted = self._admitted(node)
            self._session_tokens[node] = presented
            return admitted
        self._bad_input()
        raise AuthenticationFailed(f"token not valid for node {node}")

    def may_register(self, node: str) -> bool:
        """Whether `node`'s agent could register here at all (a node no token or
        certificate admits is never waited for)."""
        if self._controller_mode:
            routes = self._routes()
            return routes.nodes is None or routes.admits(node)
        if self._client_certificates:
            return True
        return any(allowed in (node, "*") for allowed, _ in self._tokens)

    def _token_valid(self, node: str, presented: bytes) -> bool:
        return any(allowed in (node, "*") and hmac.compare_digest(presented, secret)
                   for allowed, secret in self._tokens)

    def _admitted(self, node: str) -> str:
        """Controller mode: an authenticated node must also exist and not be denied (the
        routes' `nodes`, `denied_nodes`); before the first routes, no node is known."""
        routes = self._routes()
        if not self._controller_mode or (routes.nodes is not None and routes.admits(node)):
            return node
        self._refusals.count("node_not_admitted")
        self._refusals.warning(f"node_not_admitted:{node}", "agent refused",
                               reason="node_not_admitted", node=node)
        raise AuthenticationFailed(f"node {node} is not a known Node or is denied")

    # ---------------------------------------------------------------- revocation

    @property
    def entries(self) -> Sequence[TokenEntry]:
        """The token entries in force (a config reload replaces them)."""
        return self._entries

    def load_tokens(self) -> list[tuple[str, bytes]]:
        """The tokens as their files say now (for FileReloader). A token file that is
        gone is a removed token: that entry accepts nothing. Any other problem (unreadable,
        too short: perhaps half-written) raises ConfigError and the loaded tokens stay."""
        return self.read_tokens(self._entries)

    @staticmethod
    def read_tokens(entries: Sequence[TokenEntry]) -> list[tuple[str, bytes]]:
        """The tokens `entries` stand for now (see load_tokens); reads, changes nothing."""
        tokens = []
        for index, entry in enumerate(entries):
            if entry.token_file is not None and not entry.token_file.exists():
                continue
            try:
                tokens.append((entry.node, entry.read().encode()))
            except ConfigError as exc:
                raise ConfigError(f"tokens[{index}].token_file: {exc}") from None
        return tokens

    async def reload_tokens(self, tokens: list[tuple[str, bytes]],
                            sessions: Mapping[str, AgentSession], *,
                            entries: Sequence[TokenEntry] | None = None) -> list[str]:
        """Use `tokens` for new handshakes and close the tunnel (among `sessions`) of every
        node whose token they no longer hold. Returns the nodes closed. `entries`: the
        token entries of a reloaded config file, which `tokens` were read from (the token
        files watched from now on are theirs)."""
        self._tokens = tokens
        if entries is not None:
            self._entries = entries
        for node in [n for n in self._session_tokens if n not in sessions]:
            del self._session_tokens[node]  # ended or never registered
        closed = []
        for node, presented in list(self._session_tokens.items()):
            if self._token_valid(node, presented):
                continue
            session = sessions.get(node)
            del self._session_tokens[node]
            if session is None:
                continue
            closed.append(node)
            self._refusals.count("token_revoked")
            self._refusals.warning(f"token_revoked:{node}",
                                   "agent disconnected: its token was removed",
                                   reason="token_revoked", node=node)
            await session.connection.aclose(p.ErrorCode.UNAUTHORIZED,
                                            f"the token of node {node} was revoked")
        return closed

    async def close_revoked(self, sessions: Mapping[str, AgentSession]) -> list[str]:
        """Close the tunnels (among `sessions`) of nodes the current routes no longer
        admit (a Node deleted, or in a ClusterTunnel's deniedNodes); returns their names."""
        routes = self._routes()
        if not self._controller_mode or routes.nodes is None:
            return []
        revoked = [n for n in sessions if not routes.admits(n)]
        for node in revoked:
            session = sessions.get(node)
            if session is None:
                continue
            self._refusals.count("node_revoked")
            self.log.warning("agent disconnected: node deleted or denied", node=node)
            await session.connection.aclose(p.ErrorCode.UNAUTHORIZED,
                                            f"node {node} is no longer admitted")
        return revoked


def _bearer(peer: PeerInfo) -> str | None:
    for name, value in peer.headers:
        if name == "authorization" and value.lower().startswith("bearer "):
            return value[7:].strip()
    return None
