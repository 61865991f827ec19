"""Old home of the transport interface, now tunnel.transports.base.

Only tunnel/endpoint.py still imports this name; it is being changed in parallel (the
protocol split), so its import moves there. Delete this file with that one-line change.
"""

from tunnel.transports.base import PeerInfo, Transport, TransportError

__all__ = ["PeerInfo", "Transport", "TransportError"]
