"""What the kernel's TCP knows about a connection that the tunnel cannot see from bytes:
whether data we wrote still waits for the peer's acknowledgement, and since when the
peer last acknowledged anything (Linux `TCP_INFO`).

Why: the keepalive judges a peer dead when nothing arrives for its timeout. On a lossy
path our own bytes — the PING itself among them — can sit in TCP's retransmission queue
for longer than that (the retransmission timer doubles with every lost attempt: measured
at 20 % loss both ways, 37 s without a received byte on a connection whose peer
acknowledged something every 20 s at worst). A peer cannot answer what it has not
received; while it still acknowledges our segments now and then, it is alive and the
path works, slowly. A dead path acknowledges nothing.
"""

from __future__ import annotations

import socket
import struct

__all__ = ["unacknowledged_wait"]

# struct tcp_info (linux/tcp.h): tcpi_unacked (segments sent, not yet acknowledged) and
# tcpi_last_ack_recv (ms since the peer's last ACK), both __u32.
_UNACKED = struct.Struct("=I")
_UNACKED_OFFSET = 24
_LAST_ACK_RECV_OFFSET = 56
_INFO_SIZE = _LAST_ACK_RECV_OFFSET + 4


def unacknowledged_wait(sock: socket.socket | object) -> float | None:
    """While segments we sent wait for the peer's acknowledgement: seconds since the peer
    last acknowledged anything. None if nothing waits, or if the socket cannot say (not
    TCP, closed, not Linux)."""
    tcp_info = getattr(socket, "TCP_INFO", None)
    getsockopt = getattr(sock, "getsockopt", None)
    if tcp_info is None or getsockopt is None:
        return None
    try:
        info = getsockopt(socket.IPPROTO_TCP, tcp_info, _INFO_SIZE)
    except OSError:
        return None
    if not isinstance(info, bytes) or len(info) < _INFO_SIZE:
        return None
    if not _UNACKED.unpack_from(info, _UNACKED_OFFSET)[0]:
        return None
    return float(_UNACKED.unpack_from(info, _LAST_ACK_RECV_OFFSET)[0]) / 1000.0
