"""The errors the tunnel's endpoints and dialers raise to their callers.

`StreamFailed` is the one error for "this stream could not be set up", whoever found out.

A stream's upstream can fail in the tunnel (the peer refused the OPEN, the node is not
connected, the open timed out: `endpoint.StreamRefusedError`) or at a socket (the target
refused or is unreachable: `tcp.DialFailed`). Callers act on both the same way — refuse
the incoming stream with the reason, reset the client, answer 502/504 — so both are a
`StreamFailed` carrying the tunnel's reason code and a message for the log.
"""

from __future__ import annotations

import trio

from tunnel import protocol as p
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


class TunnelError(Exception):
    """Base of the errors endpoints raise to their callers."""


class TunnelClosedError(TunnelError, trio.BrokenResourceError):
    """The connection ended; `code` and `message` say why."""

    def __init__(self, message: str, code: p.ErrorCode = p.ErrorCode.NO_ERROR) -> None:
        super().__init__(message)
        self.code = code


class StreamRefusedError(StreamFailed, TunnelError):
    """The peer (or this side's limits) refused to open a stream."""


class StreamResetError(TunnelError, trio.BrokenResourceError):
    """The stream was reset (by the peer, or because the connection ended)."""

    def __init__(self, reason: p.StreamReason, message: str) -> None:
        super().__init__(f"stream reset ({reason.name.lower()}): {message}")
        self.reason = reason
        self.message = message


class HandshakeError(TunnelError):
    """The handshake failed; `code` is what the peer (or we) said, `retry_after` when the
    peer asked us to come back later (seconds; OVERLOADED)."""

    def __init__(self, message: str, code: p.ErrorCode,
                 retry_after: float | None = None, *, transport: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after = retry_after
        self.transport = transport  # the transport failed (cut), nobody refused us


class HandshakeRefused(Exception):
    """Raised by an authenticate callback to refuse a dialer: the message and `code` go to
    the peer (and the log), with `retry_after` seconds when it should come back later."""

    code = p.ErrorCode.UNAUTHORIZED

    def __init__(self, message: str, code: p.ErrorCode | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.retry_after = retry_after


class AuthenticationFailed(HandshakeRefused):
    """The dialer is not who it may be (UNAUTHORIZED)."""


# Why a tunnel connection ended, as a word from a closed set (metric labels, debug views):
# whatever the peer sends, the label set stays this size.
_END_LABELS = {
    p.ErrorCode.NO_ERROR: "closed",
    p.ErrorCode.SHUTTING_DOWN: "shutting_down",
    p.ErrorCode.REPLACED: "replaced",
    p.ErrorCode.KEEPALIVE_TIMEOUT: "keepalive_timeout",
    p.ErrorCode.UNAUTHORIZED: "unauthorized",
    # A transport that failed (the peer vanished, a reset) ends with INTERNAL_ERROR too.
    p.ErrorCode.INTERNAL_ERROR: "connection_lost",
}
END_LABELS = frozenset({*_END_LABELS.values(), "drained", "protocol_error", "cancelled"})


def end_label(reason: TunnelClosedError | None, *, drained: bool = False) -> str:
    """`reason` (a connection's `end_reason`) as one of END_LABELS; `drained`: the peer
    sent GOAWAY first (a rollout), whatever the final close said."""
    if drained:
        return "drained"
    if reason is None:
        return "cancelled"
    return _END_LABELS.get(reason.code, "protocol_error")
