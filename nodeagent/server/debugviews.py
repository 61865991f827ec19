"""What the server shows of its agents' tunnels: the debug socket's `tunnels` and
`streams` views, the `agents` rows of its status, and the live metrics read from the
tunnels at each scrape (agents connected, RTT and open streams per node, disconnects by
why, the HTTP fronts' counters).

Pure reads of the TunnelServer and the fronts' counters, computed on request: nothing
here runs on the data path.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.metrics_core import Metric

from nodeagent.http.holds import COLD_START_BUCKETS, HeldRequests
from nodeagent.http.stats import HttpStats
from nodeagent.ops.metrics import counter, gauge
from nodeagent.ops.streamviews import StreamNotes, stream_rows
from nodeagent.proxyprotocol.receive import ProxyHeaderStats
from nodeagent.server.healthwatch import BackendHealth
from tunnel.server import TunnelServer


def tunnels_view(tunnel: TunnelServer, server_id: str, node: str | None = None
                 ) -> dict[str, Any]:
    """`nodeagent debug tunnels` on a server: a row per node tunnel (or `node`'s),
    then nodes whose tunnel ended lately (state disconnected, why, since when)."""
    rows = []
    now = time.time()
    sessions = tunnel.sessions
    for name in ([node] if node is not None else sorted(sessions)):
        session = sessions.get(name)
        if session is None:
            continue
        info = session.connection.info()
        ended = tunnel.recent_ends.get(name)
        rows.append({
            "node": name, "peer": info.peer,
            "state": "draining" if info.draining else "open",
            "rtt_ms": round(info.rtt_seconds * 1000, 2) if info.rtt_seconds is not None
            else None,
            "streams_open": info.streams_open, "bytes_in": info.bytes_in,
            "bytes_out": info.bytes_out,
            "since_seconds": round(max(0.0, now - session.since), 1),
            # Bandwidth shaping (limits.md): rates in bytes/s and seconds waited.
            "bandwidth": session.shaper.as_dict() if session.shaper is not None and (
                session.shaper.rate_out or session.shaper.rate_in) else None,
            # A node connected again (the live tunnel has not ended): why its
            # previous tunnel ended, replaced by this one included.
            "last_error": f"previous tunnel: {ended.label}: {ended.reason}"
            if ended is not None else None,
        })
    for name, ended in reversed(tunnel.recent_ends.items()):
        if name in sessions or (node is not None and name != node):
            continue
        rows.append({"node": name, "peer": ended.peer, "state": "disconnected",
                     "rtt_ms": None, "streams_open": 0, "bytes_in": None,
                     "bytes_out": None,
                     "since_seconds": round(max(0.0, now - ended.since), 1),
                     "last_error": f"{ended.label}: {ended.reason}"})
    return {"role": "server", "server_id": server_id,
            "node_filter": node, "connected": len(sessions),
            "disconnects": dict(tunnel.disconnects), "tunnels": rows}


def streams_view(tunnel: TunnelServer, notes: StreamNotes, server_id: str,
                 node: str | None = None) -> dict[str, Any]:
    """`nodeagent debug streams` on a server: every stream of every node's tunnel."""
    sessions = tunnel.sessions
    rows = []
    for name in ([node] if node is not None else sorted(sessions)):
        session = sessions.get(name)
        if session is not None:
            rows.extend(stream_rows(session.connection, notes, peer={"node": name}))
    return {"role": "server", "server_id": server_id, "node_filter": node, "streams": rows}


def agent_rows(tunnel: TunnelServer) -> list[dict[str, Any]]:
    """The `agents` of the server's status: one row per connected node."""
    agents = []
    for node, session in sorted(tunnel.sessions.items()):
        info = session.connection.info()
        agents.append({
            "node": node, "peer": info.peer,
            # The agent's release, from its HELLO: what the version-skew policy is about.
            "agent_version": session.connection.identity.get("agent_version"),
            "connected_seconds": round(time.time() - session.since, 1),
            "rtt_ms": round(info.rtt_seconds * 1000, 2) if info.rtt_seconds is not None
            else None,
            "streams_open": info.streams_open, "bytes_in": info.bytes_in,
            "bytes_out": info.bytes_out, "draining": info.draining,
        })
    return agents


def live_metrics(tunnel: TunnelServer, http_stats: Mapping[str, HttpStats],
                 holds: HeldRequests | None = None,
                 proxy: ProxyHeaderStats | None = None,
                 health: BackendHealth | None = None) -> Iterable[Metric]:
    """The metrics read from the tunnels and fronts at each scrape."""
    if holds is not None:
        yield from hold_metrics(holds)
    if proxy is not None:
        headers = counter("nodeagent_proxy_headers", "PROXY v2 headers on the public "
                          "listeners by result: accepted, local (the balancer's own), or "
                          "why refused (bad_signature, timeout, truncated, untrusted, ...)",
                          labels=["result"])
        for result, count in sorted(proxy.results.items()):
            headers.add_metric([result], count)
        yield headers
    if health is not None:
        states = gauge("nodeagent_backend_health", "Backends under active health checks: 1 "
                       "for the state their agent reports (healthy, unhealthy, unknown)",
                       ["node", "target", "state"])
        for (node, host, port), reported in sorted(health.states.items()):
            states.add_metric([node, f"{host}:{port}", reported.state], 1)
        yield states
    agents = gauge("nodeagent_agents_connected", "Agents with an open tunnel")
    agents.add_metric([], len(tunnel.sessions))
    yield agents
    rtt = gauge("nodeagent_agent_rtt_seconds", "Round-trip time to each agent", ["node"])
    streams = gauge("nodeagent_agent_streams_open", "Open streams per agent", ["node"])
    shaped = counter("nodeagent_tunnel_shaping_wait_seconds", "Seconds a node's shaped "
                     "tunnel waited for its bandwidth, by direction (to_node, from_node)",
                     labels=["node", "direction"])
    for node, session in tunnel.sessions.items():
        if session.connection.rtt is not None:
            rtt.add_metric([node], session.connection.rtt)
        streams.add_metric([node], session.connection.info().streams_open)
        if (shaper := session.shaper) is not None and (shaper.rate_out or shaper.rate_in):
            shaped.add_metric([node, "to_node"], shaper.waited_out)
            shaped.add_metric([node, "from_node"], shaper.waited_in)
    yield rtt
    yield streams
    yield shaped
    disconnects = counter(
        "nodeagent_agent_disconnects",
        "Agent tunnels that ended, by why (drained, keepalive_timeout, "
        "connection_lost, shutting_down, replaced, unauthorized, protocol_error, "
        "closed, cancelled)", labels=["reason"])
    for reason, count in sorted(tunnel.disconnects.items()):
        disconnects.add_metric([reason], count)
    yield disconnects
    http = gauge("nodeagent_http_front", "HTTP front counters by listener",
                 ["listener", "counter"])
    by_route = counter(
        "nodeagent_http_route_requests",
        "Requests that reached a route, by listener, route, client protocol (h1, h2, grpc) "
        "and result (status class, or the gRPC status name)",
        labels=["listener", "route", "protocol", "result"])
    for name, stats in http_stats.items():
        for field_name, value in stats.as_dict().items():
            http.add_metric([name, field_name], value)
        for (route, protocol, result), count in sorted(stats.by_route.items()):
            by_route.add_metric([name, route, protocol, result], count)
    yield http
    yield by_route


def hold_metrics(holds: HeldRequests) -> Iterable[Metric]:
    """Scale to zero: requests held now, how held requests ended, cold starts."""
    now = gauge("nodeagent_held_requests", "Requests held now for a sleeping route, by "
                "Service", ["service"])
    for service, count in sorted(holds.pending.items()):
        now.add_metric([service], count)
    yield now
    stats = holds.stats
    ended = counter("nodeagent_held_requests_ended", "Held requests by how they ended: "
                    "forwarded once the route woke, timeout (504), overflowed (503 over "
                    "max-pending), failed (502: the workload fails to start)", ["outcome"])
    for outcome, value in (("forwarded", stats.forwarded), ("timeout", stats.timeouts),
                           ("overflowed", stats.overflowed), ("failed", stats.failed)):
        ended.add_metric([outcome], value)
    yield ended
    cold = HistogramMetricFamily(
        "nodeagent_wake_cold_start_seconds", "From a sleeping route's first held request "
        "to each held request forwarded")
    cumulative, buckets = 0, []
    for bound, count in zip(COLD_START_BUCKETS, stats.cold_starts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else f"{bound:g}", cumulative))
    cold.add_metric([], buckets, stats.cold_start_sum)
    yield cold
