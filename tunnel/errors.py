"""The one error for "this stream could not be set up", whoever found out.

A stream's upstream can fail in the tunnel (the peer refused the OPEN, the node is not
connected, the open timed out: `endpoint.StreamRefusedError`) or at a socket (the target
refused or is unreachable: `tcp.DialFailed`). Callers act on both the same way — refuse
the incoming stream with the reason, reset the client, answer 502/504 — so both are a
`StreamFailed` carrying the tunnel's reason code and a message for the log.
"""

from __future__ import annotations

from tunnel.protocol import StreamReason


class StreamFailed(Exception):
    """A stream or connection to a target could not be set up; `reason` says why."""

    def __init__(self, reason: StreamReason, message: str) -> None:
        super().__init__(f"{reason.name.lower()}: {message}" if message else reason.name.lower())
        self.reason = reason
        self.message = message

    @property
    def outcome(self) -> str:
        """The reason as a word for metrics labels and logs (`refused`, `timeout`, ...)."""
        return self.reason.name.lower()
