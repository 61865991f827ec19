"""When a server replica may take public traffic (`/readyz`): pure, no I/O, no clock.

A load balancer (a Service's endpoints, kube-proxy, a cloud LB's health check) puts a
replica in rotation when its readiness passes. A replica that has just started holds no
tunnel yet: every public request for a node would get a 502 until that node's agent has
dialed it. So a new replica says "ready" only once it holds a tunnel from every node its
routes send traffic to (TCP mappings, HTTP and Ingress backends, CONNECT nodes) that could
register here (a node without a token cannot), or once `grace` seconds have passed since
it started listening, whichever comes first:

- the routes name exactly the nodes whose absence would fail a request here; counting
  agents ("as many as before the restart") would be fooled by one node that left and
  another that came, and the peers' lists are not known to a replica;
- the grace bounds the wait when such a node is down (it is down for every replica, so
  waiting longer helps no one) and breaks the cycle where agents can reach a replica only
  through the balancer that waits for it (a tunnel Service without
  publishNotReadyAddresses);
- once ready it stays ready until it drains: an agent disconnecting later is a node
  problem, and taking the replica out of rotation for it would move load for nothing.

In controller mode the replica is not ready before it has routes (the controller's or
those it persisted), within the same grace.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from nodeagent.config import RoutesConfig

DEFAULT_READY_GRACE = 30.0


def nodes_routed_to(routes: RoutesConfig) -> set[str]:
    """Every node the routes send public or control-plane traffic to."""
    nodes = {m.node for m in routes.tcp}
    nodes.update(m.node for m in routes.udp)
    nodes.update(b.node for s in routes.load_balancers for p in s.ports for b in p.backends
                 if b.node is not None)
    nodes.update(r.node for h in routes.http for r in h.routes if r.node is not None)
    ingress = routes.ingress
    rules = [*ingress.rules, *([ingress.default_backend] if ingress.default_backend else [])]
    nodes.update(b.node for rule in rules for b in rule.backends if b.node is not None)
    nodes.update(routes.connect_nodes)
    return nodes


@dataclass
class ReadinessGate:
    """`check()` says None (ready) or why not; `started` is the monotonic time the replica
    began listening."""

    started: float
    grace: float = DEFAULT_READY_GRACE
    ready: bool = False
    # Why it became ready ("tunnels", "grace"), for the one log line and status.
    became: str = ""
    missing: list[str] = field(default_factory=list)

    def check(self, now: float, *, draining: bool, have_routes: bool,
              expected: Iterable[str], held: Iterable[str]) -> str | None:
        if draining:
            return "draining"
        if self.ready:
            return None
        held_set = set(held)
        self.missing = sorted(n for n in expected if n not in held_set)
        if have_routes and not self.missing:
            self.ready, self.became = True, "tunnels"
            return None
        if now - self.started >= self.grace:
            self.ready, self.became = True, "grace"
            return None
        left = max(0.0, self.grace - (now - self.started))
        if not have_routes:
            return f"no routes yet (ready in {left:.0f}s at the latest)"
        shown = ", ".join(self.missing[:5]) + (" ..." if len(self.missing) > 5 else "")
        return (f"waiting for tunnels from {len(self.missing)} node(s) the routes name: "
                f"{shown} (ready in {left:.0f}s at the latest)")
