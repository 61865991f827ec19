"""TCP connections for a sleeping Service (scale to zero): held until it wakes, then
relayed, as HTTP requests are (`http/holds.py`).

A TCP listener whose Service may sleep hands each accepted connection to
`HeldConnections.serve` with `pick`: what to relay the connection to now, a
`TcpMapping` (node and target: one of the Service's endpoints), or a `Refusal` (`asleep`:
no endpoints, the Service sleeps; or a failure to answer). While it sleeps the
connection is held by the server's `HeldRequests`, exactly as an HTTP request: counted
against the Service's `max_pending`, the Service marked wanted (the server's
`WakeClient` asks the controller to wake it), no polling: it looks again at every
route table swap. Once `pick` gives a mapping, the first dial is retried while the
node refuses it (`holds.dial_woken`), then `TcpMappingRelay` splices the two. The
client's bytes wait meanwhile in the kernel's socket buffer: nothing is read here.

A connection that cannot be held or woken is closed (a FIN: the client sees the
connection end, not a reset) with a rate-limited log line naming the listener, the
Service and the reason: `overflowed` (over `max_pending`), `timeout` (not awake within
the wake timeout), `failed` (the workload fails to start, or the first dial still
failed at the deadline), `gone` (the route went away while held); counted in the
holds' statistics (`nodeagent_held_requests_ended_total{outcome}`). A relayed
connection counts as the Service's activity until it closes: the controller never puts
a Service to sleep under open connections.

Standalone TCP mappings name a fixed node and target and never sleep: they do not come
here. The LoadBalancer Service ports of controller mode do, when their Service has
`wake` and no endpoints (`serve` with a `pick` over the port's backends).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from nodeagent.config import TcpMapping
from nodeagent.http.dispatch import Refusal
from nodeagent.http.holds import HeldRequests, dial_woken
from nodeagent.http.routetable import WakeSpec
from nodeagent.ops.logs import StructuredLogger
from nodeagent.server.tcpmappings import TcpMappingRelay, peer_address
from tunnel.errors import StreamFailed
from tunnel.log import RateLimitedLog

Pick = Callable[[], TcpMapping | Refusal]
# What a refusal that ends a held connection means (HeldRequests' answers), for its log.
_OUTCOMES = {503: "overflowed", 504: "timeout", 502: "failed"}
LINGER = 1.0  # seconds a closed held connection's unread input is drained


def asleep(name: str, wake: WakeSpec) -> Refusal:
    """What `pick` returns for a listener whose Service sleeps (no endpoints): with the
    workload failing to start, the failure (the connection is closed at once)."""
    if wake.failure:
        return Refusal(502, f"{name}: its backend fails to start: {wake.failure}",
                       route=name)
    return Refusal(503, f"{name} is asleep", wake=wake, route=name)


class HeldConnections:
    """See the module docstring. One per server process, beside its HTTP fronts'
    `HeldRequests` (shared: one count of held work per Service, one wake)."""

    def __init__(self, holds: HeldRequests, relay: TcpMappingRelay,
                 log: StructuredLogger) -> None:
        self.holds = holds
        self.relay = relay
        self.log = log
        self._limited = RateLimitedLog(log)

    async def serve(self, name: str, wake: WakeSpec | None, pick: Pick,
                    client: trio.SocketStream) -> None:
        """Carry one accepted connection of listener `name`, whose Service sleeps when
        idle with `wake` (None: it does not): relayed now if `pick` has a target, else
        held while the Service wakes (see the module docstring)."""
        first = pick()
        if type(first) is TcpMapping:
            await self._relay(first, client, None, wake)
            return
        assert type(first) is Refusal
        if first.wake is None:
            await self._close(name, client, first, _OUTCOMES.get(first.status, "gone"))
            return
        wake = first.wake
        deadline = trio.current_time() + wake.timeout
        outcome = await self.holds.hold(first, pick)
        if type(outcome) is Refusal:
            await self._close(name, client, outcome, _OUTCOMES.get(outcome.status, "gone"))
            return
        assert type(outcome) is TcpMapping
        peer = peer_address(client)
        try:
            dialed = await dial_woken(outcome, pick, lambda m: self.relay.open_target(
                m, peer, wakes=True), deadline, StreamFailed)
        except StreamFailed as exc:
            self.holds.stats.failed += 1
            await self._close(name, client, Refusal(502, f"{name}: {exc}", wake=wake),
                              "failed")
            return
        if isinstance(dialed, Refusal):
            await self._close(name, client, dialed, "gone")
            return
        mapping, stream = dialed
        await self._relay(mapping, client, stream, wake)

    async def _relay(self, mapping: TcpMapping, client: trio.SocketStream,
                     opened: trio.abc.HalfCloseableStream | None,
                     wake: WakeSpec | None) -> None:
        """Relay, counted as the Service's activity while the connection lasts."""
        if wake is None:
            await self.relay.serve(mapping, client, opened=opened)
            return
        self.holds.begin(wake)
        try:
            await self.relay.serve(mapping, client, opened=opened)
        finally:
            self.holds.end(wake)

    async def _close(self, name: str, client: trio.SocketStream, refusal: Refusal,
                     reason: str) -> None:
        self._limited.warning(f"held:{name}:{reason}", "held connection closed",
                              listener=name, reason=reason, client=peer_address(client),
                              error=refusal.reason)
        # A clean end: FIN, then what the client sent meanwhile is drained for a moment,
        # so that closing with unread input does not turn into a reset.
        try:
            with trio.move_on_after(LINGER):
                await client.send_eof()
                for _ in range(16):
                    if not await client.receive_some(65536):
                        break
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            await trio.aclose_forcefully(client)
