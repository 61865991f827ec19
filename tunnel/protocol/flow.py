"""Connection-level receive credit: how much the peer may send on the whole connection,
and how much of what it sent we let it replace while the app has not read it.

The receiver returns connection credit as soon as data is buffered, until the unread
data of the whole connection passes a budget: so one stream whose reader stalls holds at
most its own window and never stalls its siblings, while the memory a peer can make us
hold stays bounded by the budget plus the window. Per-stream windows live in each
stream's `StreamRecord` (state.py); the send side is a single counter in the connection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tunnel.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError


@dataclass(slots=True)
class ReceiveCredit:
    """The connection's receive window and what it holds back. `Connection` calls
    `received()` for every DATA frame, adds to `unacked` what it hands to the app, calls
    `acknowledged()` as the app reads, and sends what `take_returnable()` gives as a
    connection WINDOW frame."""

    full_window: int  # our connection_window setting: what the peer may have in flight
    budget: int  # unread data we accept before we stop returning credit
    window: int = field(init=False)  # what the peer may still send now
    unacked: int = 0  # delivered to the app (DataReceived), not yet acknowledged
    owed: int = 0  # received, not yet returned as credit

    def __post_init__(self) -> None:
        self.window = self.full_window

    def received(self, size: int) -> None:
        """A DATA frame of `size` bytes arrived, on any stream, live or not."""
        if size > self.window:
            raise RemoteProtocolError(
                f"DATA of {size} bytes exceeds the connection window {self.window}",
                ErrorCode.FLOW_CONTROL_ERROR)
        self.window -= size
        self.owed += size

    def acknowledged(self, size: int) -> None:
        """The app read `size` delivered bytes."""
        if size > self.unacked:
            raise LocalProtocolError("acknowledged more than was received")
        self.unacked -= size

    def take_returnable(self) -> int:
        """Credit to return now (0: none yet), counted as returned: whatever is owed
        while unread data stays within the budget; beyond it, only what the app reads.
        Returned in batches of a quarter window, or sooner once the peer's window is
        half used."""
        if self.owed == 0:
            return 0
        held = min(self.owed, max(0, self.unacked - self.budget))
        returnable = self.owed - held
        if returnable >= self.full_window // 4 or (
            returnable > 0 and self.window < self.full_window // 2
        ):
            self.owed -= returnable
            self.window += returnable
            return returnable
        return 0
