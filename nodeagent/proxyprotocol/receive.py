"""Reading a PROXY v2 header from a load balancer's connection (the trio shell around
`header`), and who may send one.

Only peers in `ProxyTrust` (the server's `proxy_protocol_from`) may, and from them a
header is required (as HAProxy's `accept-proxy` and nginx's `proxy_protocol` do): a
balancer that sends none is misconfigured, and guessing would let a client behind it
pass as the balancer. The header is read in exactly two reads of exactly its size, so no
byte of the client's own stream is consumed. Every refusal (a malformed header, none in
time, a header from a peer not trusted) is counted by reason in `ProxyHeaderStats` and
logged at most once a minute per reason; the caller closes the connection.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from dataclasses import dataclass, field

import trio

from nodeagent.ops.logs import get_logger
from nodeagent.proxyprotocol.header import (
    V2_HEADER_SIZE,
    V2_SIGNATURE,
    Address,
    ProxyHeader,
    ProxyHeaderError,
    parse_v2,
    v2_length,
)
from tunnel.log import RateLimitedLog

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# A balancer sends its header with the connection's first packet; 5 s covers a lost
# packet's retransmits and bounds what a stalled peer holds.
HEADER_TIMEOUT = 5.0

_refusal_log = RateLimitedLog(get_logger("nodeagent.proxyprotocol"), period=60.0)


@dataclass(slots=True)
class ProxyHeaderStats:
    """Headers by result: `accepted`, `local` (the balancer's own connection, LOCAL or
    UNSPEC) and every refusal reason (`header.Reason`, or `untrusted`: a header from a
    peer not in `proxy_protocol_from`). Exported as `nodeagent_proxy_headers`."""

    results: Counter[str] = field(default_factory=Counter)

    def refused(self, reason: str, *, listener: str, peer: str, detail: str) -> None:
        self.results[reason] += 1
        _refusal_log.warning(reason, "proxy header refused", reason=reason,
                             listener=listener, client=peer, detail=detail)


def looks_like_proxy_header(first: bytes) -> bool:
    """Whether a connection's first bytes start a PROXY header (v1 or v2): never valid
    HTTP, so a front that takes no header from this peer refuses them as `untrusted`."""
    return first.startswith(b"PROXY ") or (len(first) >= 5 and
                                           V2_SIGNATURE.startswith(first[:12]))


class ProxyTrust:
    """The load balancers whose PROXY v2 headers the public listeners take."""

    def __init__(self, networks: tuple[Network, ...],
                 stats: ProxyHeaderStats | None = None, timeout: float = HEADER_TIMEOUT):
        self.networks = networks
        self.stats = stats if stats is not None else ProxyHeaderStats()
        self.timeout = timeout

    def trusts(self, host: str) -> bool:
        if not self.networks:
            return False
        try:
            address = ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return any(address.version == net.version and address in net for net in self.networks)

    async def client_of(self, stream: trio.abc.ReceiveStream, peer: Address,
                        listener: str) -> ProxyHeader | None:
        """Whose connection this is: `peer` itself unless it is a trusted balancer, then
        the client its header names (`peer` again for LOCAL/UNSPEC) and the address that
        client reached (None: the connection's own). None: refused (counted, logged);
        the caller closes the connection."""
        if not self.trusts(peer[0]):
            return ProxyHeader(peer, None)
        try:
            header = await receive_v2(stream, self.timeout)
        except ProxyHeaderError as exc:
            self.stats.refused(exc.reason, listener=listener, peer=_show(peer),
                               detail=str(exc))
            return None
        if header.source is None:
            self.stats.results["local"] += 1
            return ProxyHeader(peer, None)
        self.stats.results["accepted"] += 1
        return header

    def refuse_unexpected(self, client: str, listener: str) -> None:
        """Count and log a header from a peer not trusted (the caller closes)."""
        self.stats.refused("untrusted", listener=listener, peer=client,
                           detail="PROXY header from an address not in proxy_protocol_from")


async def receive_v2(stream: trio.abc.ReceiveStream, within: float) -> ProxyHeader:
    """Read one PROXY v2 header, exactly its bytes, within `within` seconds."""
    with trio.move_on_after(within):
        head = await _receive_exactly(stream, V2_HEADER_SIZE)
        rest = await _receive_exactly(stream, v2_length(head))
        return parse_v2(head + rest)
    raise ProxyHeaderError("timeout", f"no whole PROXY v2 header within {within:g}s")


async def _receive_exactly(stream: trio.abc.ReceiveStream, size: int) -> bytes:
    data = b""
    while len(data) < size:
        try:
            chunk = await stream.receive_some(size - len(data))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            chunk = b""
        if not chunk:
            raise ProxyHeaderError("truncated", f"the connection ended after {len(data)} "
                                                f"of {size} header bytes")
        data += chunk
    return data


def _show(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
