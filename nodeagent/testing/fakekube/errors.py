"""The errors the fake API answers with: `ApiError`, rendered as a `Status` object, and
constructors for the reasons kube-apiserver uses (NotFound, Conflict, AlreadyExists,
BadRequest, Expired, Invalid with its field causes)."""

from __future__ import annotations

from typing import Any

from nodeagent.testing.fakekube.objects import Obj
from nodeagent.testing.fakekube.registry import ResourceType

# (field, reason, message) of each invalid field, as kube-apiserver reports them.
Causes = list[tuple[str, str, str]]


class ApiError(Exception):
    """An error the API returns as a `Status` object."""

    def __init__(self, code: int, reason: str, message: str, *,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message
        self.details = details

    def status(self) -> Obj:
        doc: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": self.message, "reason": self.reason, "code": self.code}
        if self.details:
            doc["details"] = self.details
        return doc


def _details(rt: ResourceType, name: str) -> dict[str, Any]:
    d: dict[str, Any] = {"name": name, "kind": rt.plural}
    if rt.group:
        d["group"] = rt.group
    return d


def not_found(rt: ResourceType, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{rt.qualified} "{name}" not found',
                    details=_details(rt, name))


def no_such_resource() -> ApiError:
    """A path that names no resource (as opposed to a missing object)."""
    return ApiError(404, "NotFound", "the server could not find the requested resource")


def already_exists(rt: ResourceType, name: str) -> ApiError:
    return ApiError(409, "AlreadyExists", f'{rt.qualified} "{name}" already exists',
                    details=_details(rt, name))


def conflict(rt: ResourceType, name: str, why: str | None = None) -> ApiError:
    why = why or ("the object has been modified; please apply your changes to the latest "
                  "version and try again")
    return ApiError(409, "Conflict", f'Operation cannot be fulfilled on {rt.qualified} '
                                     f'"{name}": {why}', details=_details(rt, name))


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def expired(message: str) -> ApiError:
    return ApiError(410, "Expired", message)


def invalid(rt: ResourceType, name: str, causes: Causes) -> ApiError:
    parts = [f"{field}: {detail}" for field, _, detail in causes]
    joined = parts[0] if len(parts) == 1 else "[" + ", ".join(parts) + "]"
    kind = f"{rt.kind}.{rt.group}" if rt.group else rt.kind
    details = {**_details(rt, name), "kind": rt.kind,
               "causes": [{"reason": r, "message": d, "field": f} for f, r, d in causes]}
    return ApiError(422, "Invalid", f'{kind} "{name}" is invalid: {joined}', details=details)
