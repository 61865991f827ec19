"""Small builders shared by the kube tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio


def secret(name: str, namespace: str = "default", **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels},
            "stringData": {"k": name}}


def configmap(name: str, namespace: str = "default", data: dict[str, str] | None = None,
              **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels},
            "data": data or {"v": "1"}}


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels},
            "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}}


def names(objs: list[dict[str, Any]]) -> list[str]:
    return [o["metadata"]["name"] for o in objs]


async def eventually(predicate: Callable[[], bool], *, interval: float = 0.02) -> None:
    """Wait until `predicate()` holds (the caller bounds it with `trio.fail_after`);
    for state that has no change notification."""
    while not predicate():  # noqa: ASYNC110 - polling outside state, in tests only
        await trio.sleep(interval)
