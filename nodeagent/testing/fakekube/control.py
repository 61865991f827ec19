"""The /_fake/ control endpoints, both ends: `control_endpoint` answers them on a FakeKube,
`FakeKubeControl` drives a FakeKube in another process through them.

    POST /_fake/compact {"revision"}          POST /_fake/drop-watches
    POST /_fake/fail {"count", "status", "method", "path", "watch"}
    POST /_fake/delay {"seconds"}             POST /_fake/clear-faults
    POST /_fake/tokens {"token", ...}         DELETE /_fake/tokens/<token>
    GET|DELETE /_fake/requests                GET /_fake/state
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, Protocol

import httpx

from nodeagent.testing.fakekube.connection import Response, json_response
from nodeagent.testing.fakekube.requestlog import Match, RecordedRequest
from nodeagent.testing.fakekube.store import Store


class ControlTarget(Protocol):
    """What the endpoints drive: FakeKube's public test API."""

    store: Store
    requests: list[RecordedRequest]
    delay: float

    def compact(self, revision: int | None = None) -> int: ...
    def drop_watches(self) -> int: ...
    def fail_next(self, count: float = 1, *, status: int = 500, method: str | None = None,
                  path: str | None = None, watch: bool | None = None,
                  match: Match | None = None) -> None: ...
    def clear_faults(self) -> None: ...
    # Called with the JSON body's fields as keyword arguments.
    @property
    def add_token(self) -> Callable[..., object]: ...
    @property
    def add_service_account_token(self) -> Callable[..., object]: ...
    def revoke_token(self, token: str) -> None: ...
    def clear_requests(self) -> None: ...
    def active_watches(self, path: str | None = None) -> int: ...


def control_endpoint(fake: ControlTarget, method: str, path: str, body: bytes) -> Response:
    try:
        doc = json.loads(body) if body.strip() else {}
    except ValueError:
        return json_response(400, {"error": "body is not JSON"})
    action = path.removeprefix("/_fake/").strip("/")
    if action == "compact" and method == "POST":
        return json_response(200, {"compacted": fake.compact(doc.get("revision"))})
    if action == "drop-watches" and method == "POST":
        return json_response(200, {"dropped": fake.drop_watches()})
    if action == "fail" and method == "POST":
        count = doc.get("count", 1)
        fake.fail_next(math.inf if count is None else count,
                       status=doc.get("status", 500), method=doc.get("method"),
                       path=doc.get("path"), watch=doc.get("watch"))
        return json_response(200, {})
    if action == "delay" and method == "POST":
        fake.delay = float(doc.get("seconds", 0))
        return json_response(200, {})
    if action == "clear-faults" and method == "POST":
        fake.clear_faults()
        return json_response(200, {})
    if action == "tokens" and method == "POST":
        token = doc.pop("token")
        if "service_account" in doc:
            fake.add_service_account_token(token, **doc)
        else:
            fake.add_token(token, **doc)
        return json_response(200, {})
    if action.startswith("tokens/") and method == "DELETE":
        fake.revoke_token(action.removeprefix("tokens/"))
        return json_response(200, {})
    if action == "requests" and method == "GET":
        return json_response(200, [{"method": r.method, "path": r.path, "query": r.query,
                                    "user": r.user, "status": r.status, "at": r.at}
                                   for r in fake.requests])
    if action == "requests" and method == "DELETE":
        fake.clear_requests()
        return json_response(200, {})
    if action == "state" and method == "GET":
        return json_response(200, {"revision": fake.store.revision,
                                   "compacted": fake.store.compacted,
                                   "watches": fake.active_watches()})
    return json_response(404, {"error": f"no control endpoint {method} {path}"})


class FakeKubeControl:
    def __init__(self, url: str, *, verify: Any = False) -> None:
        self._http = httpx.AsyncClient(base_url=url, verify=verify, timeout=10.0)

    async def __aenter__(self) -> FakeKubeControl:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def _post(self, action: str, body: dict[str, Any] | None = None) -> Any:
        response = await self._http.post(f"/_fake/{action}", json=body or {})
        response.raise_for_status()
        return response.json()

    async def compact(self, revision: int | None = None) -> int:
        return int((await self._post("compact", {"revision": revision}))["compacted"])

    async def drop_watches(self) -> int:
        return int((await self._post("drop-watches"))["dropped"])

    async def fail_next(self, count: int | None = 1, *, status: int = 500,
                        method: str | None = None, path: str | None = None,
                        watch: bool | None = None) -> None:
        """count=None fails every matching request until clear_faults()."""
        await self._post("fail", {"count": count, "status": status, "method": method,
                                  "path": path, "watch": watch})

    async def set_delay(self, seconds: float) -> None:
        await self._post("delay", {"seconds": seconds})

    async def clear_faults(self) -> None:
        await self._post("clear-faults")

    async def add_token(self, token: str, **info: Any) -> None:
        """Keyword arguments of FakeKube.add_token, or of add_service_account_token when
        `service_account=` is given."""
        await self._post("tokens", {"token": token, **info})

    async def revoke_token(self, token: str) -> None:
        (await self._http.delete(f"/_fake/tokens/{token}")).raise_for_status()

    async def requests(self) -> list[dict[str, Any]]:
        response = await self._http.get("/_fake/requests")
        response.raise_for_status()
        result: list[dict[str, Any]] = response.json()
        return result

    async def state(self) -> dict[str, Any]:
        response = await self._http.get("/_fake/state")
        response.raise_for_status()
        result: dict[str, Any] = response.json()
        return result
