"""Errors shared between the HTTP front and whoever opens its upstream streams."""

from __future__ import annotations


class UpstreamUnavailable(Exception):
    """Raised by an upstream opener when it cannot give a stream to the backend.

    `status` is the HTTP status the front answers with (502 when the node is not
    connected or the target refused, 504 when the dial timed out); `reason` is a short
    human sentence put in the response body and the log line.
    """

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(status, reason)
        self.status = status
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.status} {self.reason}"
