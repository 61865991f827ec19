"""Typed Kubernetes API errors, built from the `Status` object the API server returns.

Callers branch on the class (`except Conflict:` → re-read and retry) rather than on numbers;
`status`, `reason` and `message` keep what the server said for logs and Events.
"""

from __future__ import annotations

from typing import Any


class KubeError(Exception):
    """An API request failed. `status` is the HTTP code (0 if no response arrived)."""

    default_status = 0
    default_reason = "Unknown"

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        reason: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = self.default_status if status is None else status
        self.reason = reason or self.default_reason
        self.message = message
        self.details = details or {}

    def __str__(self) -> str:
        return f"{self.status} {self.reason}: {self.message}"

    @classmethod
    def from_status(cls, status: Any, http_status: int | None = None) -> KubeError:
        """The typed error for a `Status` object (or any body) and/or an HTTP status code."""
        body: dict[str, Any] = status if isinstance(status, dict) else {}
        code = body.get("code") if isinstance(body.get("code"), int) else None
        code = code or http_status or 0
        reason = str(body.get("reason") or "")
        message = str(body.get("message") or reason or f"HTTP {code}")
        details = body.get("details") if isinstance(body.get("details"), dict) else None
        error_class = _class_for(code, reason)
        return error_class(message, status=code, reason=reason or None, details=details)


class BadRequest(KubeError):
    default_status, default_reason = 400, "BadRequest"


class Unauthorized(KubeError):
    """401: no credentials or the token was rejected (expired, rotated, revoked)."""

    default_status, default_reason = 401, "Unauthorized"


class Forbidden(KubeError):
    """403: authenticated but RBAC denies the verb on this resource."""

    default_status, default_reason = 403, "Forbidden"


class NotFound(KubeError):
    default_status, default_reason = 404, "NotFound"


class Conflict(KubeError):
    """409: the update carried a stale resourceVersion (or a delete precondition failed)."""

    default_status, default_reason = 409, "Conflict"


class AlreadyExists(Conflict):
    """409 AlreadyExists: create of a name that is taken. A `Conflict`, since it is also a 409."""

    default_status, default_reason = 409, "AlreadyExists"


class Gone(KubeError):
    """410: the resourceVersion (watch) or continue token (list) was compacted away: relist."""

    default_status, default_reason = 410, "Expired"


class Invalid(KubeError):
    """422: the object failed validation; `details["causes"]` lists the fields."""

    default_status, default_reason = 422, "Invalid"


class ServerError(KubeError):
    """5xx or 429: the server could not serve this now; retry with backoff."""

    default_status, default_reason = 500, "InternalError"


class ApiUnreachable(KubeError):
    """No (complete) response: connect failure, TLS error, read timeout, dropped stream."""

    default_status, default_reason = 0, "ApiUnreachable"


_BY_STATUS: dict[int, type[KubeError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    410: Gone,
    422: Invalid,
    429: ServerError,
}


def _class_for(code: int, reason: str) -> type[KubeError]:
    if code == 409 and reason == "AlreadyExists":
        return AlreadyExists
    if code in _BY_STATUS:
        return _BY_STATUS[code]
    if code >= 500:
        return ServerError
    return KubeError
