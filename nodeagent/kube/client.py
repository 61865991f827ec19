"""`KubeClient`: the Kubernetes REST API over httpx on trio, objects as plain JSON dicts.

One client per process, shared by every informer, the leader elector and the controller's
writes. It does one HTTP request per call and no retries: retry policy (backoff, relist on
410, re-read on 409) belongs to the caller that knows what the request meant. Watches are
streams inside an `async with`: leaving the block (or cancelling it) closes the connection.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from nodeagent.kube.credentials import Credentials
from nodeagent.kube.errors import ApiUnreachable, KubeError
from nodeagent.kube.resources import TOKENREVIEWS, Resource
from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.kube.client")

Object = dict[str, Any]
Selector = str | Mapping[str, str] | None
PatchType = Literal["merge", "json", "strategic"]

_PATCH_CONTENT_TYPES: dict[str, str] = {
    "merge": "application/merge-patch+json",
    "json": "application/json-patch+json",
    "strategic": "application/strategic-merge-patch+json",
}
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
WATCH_TIMEOUT_MARGIN = 10.0  # client read timeout beyond the server-side timeoutSeconds


@dataclass(frozen=True)
class ObjectList:
    """A complete (all pages) list and the resourceVersion to watch from."""

    items: list[Object]
    resource_version: str


@dataclass(frozen=True)
class ListPage:
    items: list[Object]
    resource_version: str
    continue_token: str | None
    remaining_item_count: int | None = None


@dataclass(frozen=True)
class WatchEvent:
    """One line of a watch stream: ADDED, MODIFIED, DELETED or BOOKMARK, and its object."""

    type: str
    object: Object

    @property
    def resource_version(self) -> str:
        return str(self.object.get("metadata", {}).get("resourceVersion", ""))


def selector_string(selector: Selector) -> str | None:
    """`{"app": "x", "tier": "web"}` → `app=x,tier=web`; strings pass through."""
    if selector is None:
        return None
    if isinstance(selector, str):
        return selector or None
    return ",".join(f"{k}={v}" for k, v in selector.items()) or None


def object_key(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(namespace, name) of an object; namespace is "" for cluster-scoped objects."""
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


@contextmanager
def _transport_errors(what: str) -> Iterator[None]:
    """httpx's exceptions mapped once into ApiUnreachable (the caller's backoff signal)."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise ApiUnreachable(f"{what}: timed out ({type(exc).__name__})") from exc
    except httpx.TransportError as exc:
        raise ApiUnreachable(f"{what}: {type(exc).__name__}: {exc}") from exc


def _error_from_response(response: httpx.Response, body: bytes) -> KubeError:
    try:
        doc: Any = json.loads(body) if body else None
    except ValueError:
        doc = {"message": body[:200].decode("utf-8", "replace")}
    return KubeError.from_status(doc, response.status_code)


class WatchStream:
    """Async iterator of `WatchEvent`s from one watch response.

    An ERROR event is raised as the typed error it carries (`Gone` for 410 "too old
    resource version"), so consumers handle errors in one `except` and only see data events.
    Iteration ends when the server closes the stream cleanly (its timeoutSeconds); a stream
    cut in the middle raises `ApiUnreachable`.
    """

    def __init__(self, response: httpx.Response, resource: Resource) -> None:
        self._response = response
        self._resource = resource
        self._chunks = response.aiter_bytes()
        self._buffer = b""
        self._lines: list[bytes] = []
        self.events = 0

    def __aiter__(self) -> WatchStream:
        return self

    async def __anext__(self) -> WatchEvent:
        while not self._lines:
            with _transport_errors(f"watch {self._resource}"):
                try:
                    chunk = await self._chunks.__anext__()
                except StopAsyncIteration:
                    if self._buffer.strip():
                        raise ApiUnreachable(
                            f"watch {self._resource}: stream ended inside an event"
                        ) from None
                    raise
            self._buffer += chunk
            *complete, self._buffer = self._buffer.split(b"\n")
            self._lines = [line for line in complete if line.strip()]
        line = self._lines.pop(0)
        try:
            doc = json.loads(line)
            event = WatchEvent(type=str(doc["type"]), object=doc["object"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ApiUnreachable(f"watch {self._resource}: bad event line {line[:120]!r}") from exc
        if event.type == "ERROR":
            raise KubeError.from_status(event.object)
        self.events += 1
        return event


class KubeClient:
    """The Kubernetes API; every method raises a `KubeError` subclass on failure."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        timeout: float = 30.0,
        field_manager: str | None = "nodeagent",
        user_agent: str = "nodeagent",
        max_connections: int = 100,
    ) -> None:
        self.credentials = credentials
        self.field_manager = field_manager
        self._timeout = timeout
        self._extensions: dict[str, Any] = {}
        if credentials.tls_server_name:
            self._extensions["sni_hostname"] = credentials.tls_server_name
        self._http = httpx.AsyncClient(
            **credentials.httpx_options(),
            timeout=httpx.Timeout(timeout),
            headers={"User-Agent": user_agent, "Accept": "application/json"},
            # Each watch holds a connection for its lifetime; keep room for requests.
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=20),
        )

    async def __aenter__(self) -> KubeClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- plumbing ---------------------------------------------------------------------------

    def _params(self, params: Mapping[str, Any] | None, *, write: bool = False) -> dict[str, Any]:
        out = {k: v for k, v in (params or {}).items() if v is not None}
        for k, v in list(out.items()):
            if isinstance(v, bool):
                out[k] = "true" if v else "false"
        if write and self.field_manager and "fieldManager" not in out:
            out["fieldManager"] = self.field_manager
        return out

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        write: bool = False,
    ) -> Any:
        """One request; returns the decoded JSON body, raises the typed error on non-2xx."""
        headers = {}
        content = None
        if body is not None:
            content = json.dumps(body).encode()
            headers["Content-Type"] = content_type
        request = self._http.build_request(
            method,
            path,
            params=self._params(params, write=write),
            content=content,
            headers=headers,
            extensions=self._extensions or None,
        )
        with _transport_errors(f"{method} {path}"):
            response = await self._http.send(request)
        data = response.content
        if response.status_code >= 400:
            raise _error_from_response(response, data)
        if not data:
            return None
        try:
            return json.loads(data)
        except ValueError as exc:
            raise ApiUnreachable(f"{method} {path}: response is not JSON") from exc

    @staticmethod
    def _namespace(
        resource: Resource, namespace: str | None, obj: Mapping[str, Any] | None
    ) -> str | None:
        if not resource.namespaced:
            return None
        ns = namespace or (obj or {}).get("metadata", {}).get("namespace")
        if not ns:
            raise ValueError(f"{resource} is namespaced: give a namespace")
        return str(ns)

    @staticmethod
    def _name(obj: Mapping[str, Any]) -> str:
        name = (obj.get("metadata") or {}).get("name")
        if not name:
            raise ValueError("object has no metadata.name")
        return str(name)

    @staticmethod
    def _typed(resource: Resource, obj: Object) -> Object:
        obj.setdefault("apiVersion", resource.api_version)
        obj.setdefault("kind", resource.kind)
        return obj

    # -- reads ------------------------------------------------------------------------------

    async def get(self, resource: Resource, name: str, *, namespace: str | None = None) -> Object:
        ns = self._namespace(resource, namespace, None)
        obj: Object = await self.request("GET", resource.path(ns, name))
        return obj

    async def list_page(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: Selector = None,
        field_selector: Selector = None,
        limit: int | None = 500,
        continue_token: str | None = None,
        resource_version: str | None = None,
    ) -> ListPage:
        """One page of a list. Items get `kind`/`apiVersion` (the API omits them in lists)."""
        doc = await self.request(
            "GET",
            resource.path(namespace if resource.namespaced else None),
            params={
                "labelSelector": selector_string(label_selector),
                "fieldSelector": selector_string(field_selector),
                "limit": limit,
                "continue": continue_token,
                "resourceVersion": resource_version,
            },
        )
        meta = doc.get("metadata") or {}
        items = [self._typed(resource, item) for item in doc.get("items") or []]
        remaining = meta.get("remainingItemCount")
        return ListPage(
            items=items,
            resource_version=str(meta.get("resourceVersion", "")),
            continue_token=meta.get("continue") or None,
            remaining_item_count=int(remaining) if remaining is not None else None,
        )

    async def list(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        label_selector: Selector = None,
        field_selector: Selector = None,
        limit: int | None = 500,
    ) -> ObjectList:
        """All objects, fetched `limit` at a time (`continue`), as one consistent snapshot.

        The snapshot's resourceVersion is the first page's: later pages are served at that
        revision, so the result is what a watch from `resource_version` continues. A
        continue token compacted away raises `Gone`; the caller starts the list again.
        """
        items: list[Object] = []
        token: str | None = None
        version = ""
        while True:
            page = await self.list_page(
                resource,
                namespace=namespace,
                label_selector=label_selector,
                field_selector=field_selector,
                limit=limit,
                continue_token=token,
            )
            items.extend(page.items)
            version = version or page.resource_version
            if not page.continue_token:
                return ObjectList(items=items, resource_version=version)
            token = page.continue_token

    @asynccontextmanager
    async def watch(
        self,
        resource: Resource,
        *,
        namespace: str | None = None,
        resource_version: str | None = None,
        label_selector: Selector = None,
        field_selector: Selector = None,
        timeout_seconds: int | None = 300,
        allow_bookmarks: bool = True,
        read_timeout: float | None = None,
    ) -> AsyncIterator[WatchStream]:
        """`async with kube.watch(...) as events: async for event in events: ...`

        The server ends the stream after `timeout_seconds`; the client's read timeout is a
        little longer, so a silently dead connection is noticed without cutting a healthy
        idle watch short.
        """
        if read_timeout is None:
            read_timeout = timeout_seconds + WATCH_TIMEOUT_MARGIN if timeout_seconds else None
        params = self._params(
            {
                "watch": True,
                "resourceVersion": resource_version,
                "allowWatchBookmarks": allow_bookmarks or None,
                "timeoutSeconds": timeout_seconds,
                "labelSelector": selector_string(label_selector),
                "fieldSelector": selector_string(field_selector),
            }
        )
        path = resource.path(namespace if resource.namespaced else None)
        request = self._http.build_request(
            "GET",
            path,
            params=params,
            timeout=httpx.Timeout(self._timeout, read=read_timeout),
            extensions=self._extensions or None,
        )
        with _transport_errors(f"watch {resource}"):
            response = await self._http.send(request, stream=True)
        try:
            if response.status_code >= 400:
                with _transport_errors(f"watch {resource}"):
                    body = await response.aread()
                raise _error_from_response(response, body)
            yield WatchStream(response, resource)
        finally:
            await response.aclose()

    # -- writes -----------------------------------------------------------------------------

    async def create(
        self, resource: Resource, obj: Mapping[str, Any], *, namespace: str | None = None
    ) -> Object:
        ns = self._namespace(resource, namespace, obj)
        body = self._typed(resource, dict(obj))
        created: Object = await self.request("POST", resource.path(ns), body=body, write=True)
        return created

    async def update(self, resource: Resource, obj: Mapping[str, Any]) -> Object:
        """PUT the whole object. Its metadata.resourceVersion makes it conditional:
        a stale one raises `Conflict` (re-read, re-apply your change, try again)."""
        ns = self._namespace(resource, None, obj)
        body = self._typed(resource, dict(obj))
        updated: Object = await self.request(
            "PUT", resource.path(ns, self._name(obj)), body=body, write=True
        )
        return updated

    async def update_status(self, resource: Resource, obj: Mapping[str, Any]) -> Object:
        """PUT to the status subresource: only `.status` changes, also resourceVersion-checked."""
        ns = self._namespace(resource, None, obj)
        body = self._typed(resource, dict(obj))
        updated: Object = await self.request(
            "PUT", resource.path(ns, self._name(obj), "status"), body=body, write=True
        )
        return updated

    async def patch(
        self,
        resource: Resource,
        name: str,
        patch: Any,
        *,
        namespace: str | None = None,
        subresource: str | None = None,
        patch_type: PatchType = "merge",
    ) -> Object:
        """Merge patch (RFC 7386) by default; `patch_type="json"` for RFC 6902 operations."""
        ns = self._namespace(resource, namespace, None)
        patched: Object = await self.request(
            "PATCH",
            resource.path(ns, name, subresource),
            body=patch,
            content_type=_PATCH_CONTENT_TYPES[patch_type],
            write=True,
        )
        return patched

    async def apply(
        self,
        resource: Resource,
        obj: Mapping[str, Any],
        *,
        field_manager: str,
        force: bool = False,
        subresource: str | None = None,
    ) -> Object:
        """Server-side apply: create or update the fields `field_manager` owns."""
        ns = self._namespace(resource, None, obj)
        body = self._typed(resource, dict(obj))
        applied: Object = await self.request(
            "PATCH",
            resource.path(ns, self._name(obj), subresource),
            body=body,
            content_type=APPLY_CONTENT_TYPE,
            params={"fieldManager": field_manager, "force": force or None},
        )
        return applied

    async def delete(
        self,
        resource: Resource,
        name: str,
        *,
        namespace: str | None = None,
        uid: str | None = None,
        resource_version: str | None = None,
        propagation_policy: str | None = None,
        grace_period_seconds: int | None = None,
    ) -> Object:
        """Delete; `uid`/`resource_version` are preconditions (`Conflict` if they do not hold).

        Returns the server's answer: the object (with deletionTimestamp, if finalizers hold
        it back) or a Status.
        """
        ns = self._namespace(resource, namespace, None)
        options: Object = {"apiVersion": "v1", "kind": "DeleteOptions"}
        preconditions = {
            k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v is not None
        }
        if preconditions:
            options["preconditions"] = preconditions
        if propagation_policy:
            options["propagationPolicy"] = propagation_policy
        if grace_period_seconds is not None:
            options["gracePeriodSeconds"] = grace_period_seconds
        result: Object = await self.request("DELETE", resource.path(ns, name), body=options)
        return result

    async def review_token(
        self, token: str, *, audiences: builtins.list[str] | None = None
    ) -> Object:
        """TokenReview: returns its `status` ({authenticated, user{username, uid, groups,
        extra}, audiences, error})."""
        spec: Object = {"token": token}
        if audiences is not None:
            spec["audiences"] = audiences
        review = await self.request(
            "POST",
            TOKENREVIEWS.path(),
            body={"apiVersion": TOKENREVIEWS.api_version, "kind": TOKENREVIEWS.kind, "spec": spec},
        )
        status: Object = review.get("status") or {}
        return status
