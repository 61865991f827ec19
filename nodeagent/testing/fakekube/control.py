"""Drive a FakeKube in another process through its /_fake/ endpoints."""

from __future__ import annotations

from typing import Any

import httpx


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
