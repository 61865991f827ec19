"""`FakeKube`: a Kubernetes API server double speaking real HTTP/1.1 (h11 on trio sockets).

It serves the REST and watch protocol of the store in `store.py` — enough that the client
code nodeagent runs against a real cluster runs unchanged against it — plus what tests need
and a real server does not offer: fault injection (drop every watch, fail the next N
requests, delay responses, deny verbs), a log of every request, forced compaction, a table
of tokens for authentication and TokenReview, and control endpoints under `/_fake/` so a
test can drive a server running in another process (`python -m nodeagent.testing.fakekube`).
Opt-in RBAC (`rbac=True`, see `rbac.py`), access reviews, Tables for kubectl (`table.py`)
and OpenAPI v3 (`openapi.py`) are served from here too; each module says where it differs
from a real cluster.
"""

from __future__ import annotations

import datetime
import json
import math
import random
import ssl
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

import h11
import trio

from nodeagent.testing.fakekube import openapi
from nodeagent.testing.fakekube.errors import ApiError, bad_request, not_found
from nodeagent.testing.fakekube.kubeconfig import write_kubeconfig
from nodeagent.testing.fakekube.objects import Obj
from nodeagent.testing.fakekube.pki import CertificateAuthority, CertPair
from nodeagent.testing.fakekube.rbac import (
    AUTHENTICATED,
    MASTERS,
    SA_PREFIX,
    UNAUTHENTICATED,
    Decision,
    RbacAuthorizer,
    RequestAttributes,
    UserInfo,
    bootstrap_policy,
    forbidden,
    request_attributes,
    service_account_groups,
)
from nodeagent.testing.fakekube.registry import RBAC, ResourceType
from nodeagent.testing.fakekube.store import DEFAULT_NAMESPACES, Store
from nodeagent.testing.fakekube.table import to_table, wants_table

MAX_BODY = 3 * 1024 * 1024  # the real API server's request size limit
API_AUDIENCE = "https://kubernetes.default.svc"
SERVER_VERSION = {"major": "1", "minor": "31", "gitVersion": "v1.31.0-fakekube",
                  "platform": "linux/amd64", "goVersion": "go1.22"}


@dataclass
class TokenInfo:
    """Who a bearer token authenticates as (for API access and for TokenReview)."""

    username: str
    uid: str = ""
    groups: list[str] = field(default_factory=lambda: ["system:authenticated"])
    audiences: list[str] = field(default_factory=lambda: [API_AUDIENCE])
    extra: dict[str, list[str]] = field(default_factory=dict)
    expires_at: float | None = None  # wall clock (time.time())
    pod: tuple[str, str, str] | None = None  # (namespace, name, uid) the token is bound to
    # Minted for a pod the store held: checked against it always (as a real apiserver
    # does); otherwise only with FakeKube(validate_bound_pods=True).
    pod_checked: bool = False

    def user(self) -> Obj:
        doc: Obj = {"username": self.username, "groups": list(self.groups)}
        if self.uid:
            doc["uid"] = self.uid
        if self.extra:
            doc["extra"] = {k: list(v) for k, v in self.extra.items()}
        return doc


@dataclass
class RecordedRequest:
    method: str
    path: str
    query: dict[str, str]
    user: str | None
    at: float  # trio.current_time() when the request arrived
    status: int | None = None

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")

    @property
    def resource_version(self) -> str | None:
        return self.query.get("resourceVersion")

    def __str__(self) -> str:
        q = "&".join(f"{k}={v}" for k, v in self.query.items())
        return f"{self.method} {self.path}{'?' + q if q else ''} -> {self.status}"


Match = Callable[[RecordedRequest], bool]


def request_matcher(method: str | None = None, path: str | None = None,
                    watch: bool | None = None) -> Match:
    """Matches requests by method, path substring and watch-ness (None: any)."""
    def match(r: RecordedRequest) -> bool:
        return ((method is None or r.method == method.upper())
                and (path is None or path in r.path)
                and (watch is None or r.watch == watch))
    return match


@dataclass
class _Fault:
    remaining: float
    status: int
    match: Match


@dataclass
class _Response:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)


@dataclass(eq=False)
class _WatchHandle:
    scope: trio.CancelScope
    path: str
    dropped: bool = False


def _json(status: int, doc: Any, headers: list[tuple[str, str]] | None = None) -> _Response:
    return _Response(status, json.dumps(doc).encode(), headers=headers or [])


def _error(exc: ApiError) -> _Response:
    headers = [("Retry-After", "1")] if exc.code in (429, 503) else []
    return _json(exc.code, exc.status(), headers)


class _Dropped(Exception):
    """The connection is to be closed without finishing the response."""


class FakeKube:
    """The fake API server. Configure, then `await nursery.start(fake.serve)`."""

    def __init__(self, *, token: str | None = None, tls: bool = False,
                 bookmark_interval: float = 1.0, history_limit: int | None = None,
                 namespaces: tuple[str, ...] = DEFAULT_NAMESPACES,
                 watch_queue_limit: int = 10_000, validate_bound_pods: bool = False,
                 gone_as_http_status: bool = False, rbac: bool = False) -> None:
        self.store = Store(namespaces=namespaces, history_limit=history_limit,
                           watch_queue_limit=watch_queue_limit)
        # rbac=True: everyone but system:masters is authorized by RBAC (see rbac.py), over
        # the bootstrap policy plus whatever Roles and bindings the test stores.
        self.rbac = rbac
        self.authorizer = RbacAuthorizer(
            lambda plural: self.store.objects(self.store.types[(RBAC, plural)]))
        if rbac:
            for obj in bootstrap_policy():
                self.put_object(obj)
        self.tokens: dict[str, TokenInfo] = {}
        self.require_auth = token is not None
        self.admin_token = token
        if token is not None:
            self.add_token(token, username="admin",
                           groups=["system:masters", "system:authenticated"])
        self.tls = tls
        self.ca: CertificateAuthority | None = CertificateAuthority() if tls else None
        self.bookmark_interval = bookmark_interval
        self.validate_bound_pods = validate_bound_pods
        self.gone_as_http_status = gone_as_http_status
        self.requests: list[RecordedRequest] = []
        self.delay = 0.0
        self._delays: list[tuple[Match, float]] = []
        self._faults: list[_Fault] = []
        self._gates: list[tuple[Match, trio.Event]] = []
        self._denied: list[tuple[str | None, str | None, str | None]] = []
        self._watches: set[_WatchHandle] = set()
        self._watches_changed = trio.Event()
        self.host = "127.0.0.1"
        self.port = 0
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._rng = random.Random()

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    def _server_ssl_context(self) -> ssl.SSLContext:
        assert self.ca is not None and self._tmp is not None
        cert, key = self.ca.server_cert().write(Path(self._tmp.name), "server")
        ca_file = Path(self._tmp.name) / "ca.crt"
        ca_file.write_bytes(self.ca.cert_pem)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(cert, key)
        ctx.load_verify_locations(ca_file)
        ctx.verify_mode = ssl.CERT_OPTIONAL  # client certificates authenticate if present
        return ctx

    async def serve(self, *, host: str = "127.0.0.1", port: int = 0,
                    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen and serve until cancelled; reports the base URL once listening."""
        self._tmp = tempfile.TemporaryDirectory(prefix="fakekube-")
        try:
            ssl_context = self._server_ssl_context() if self.tls else None
            listeners = await trio.open_tcp_listeners(port, host=host)
            self.host = host
            self.port = listeners[0].socket.getsockname()[1]
            async with trio.open_nursery() as nursery:
                handler = partial(self._connection, ssl_context=ssl_context)
                await nursery.start(partial(trio.serve_listeners, handler, listeners,
                                            handler_nursery=nursery))
                task_status.started(self.url)
                await trio.sleep_forever()
        finally:
            self._tmp.cleanup()

    # -- test helpers -----------------------------------------------------------------------

    def add_token(self, token: str, *, username: str, uid: str = "",
                  groups: list[str] | None = None, audiences: list[str] | None = None,
                  extra: dict[str, list[str]] | None = None, expires_at: float | None = None,
                  pod: tuple[str, str, str] | None = None) -> TokenInfo:
        info = TokenInfo(username=username, uid=uid,
                         groups=groups if groups is not None else ["system:authenticated"],
                         audiences=audiences if audiences is not None else [API_AUDIENCE],
                         extra=extra or {}, expires_at=expires_at, pod=pod)
        self.tokens[token] = info
        return info

    def add_service_account_token(
            self, token: str, *, namespace: str, service_account: str,
            pod_name: str | None = None, pod_uid: str | None = None,
            node_name: str | None = None, node_uid: str | None = None,
            audiences: list[str] | None = None, expires_at: float | None = None,
            sa_uid: str | None = None) -> TokenInfo:
        """A bound projected ServiceAccount token, with the `extra` a real one carries.

        Bound to a pod the store holds (its uid unless `pod_uid` says otherwise), the token
        stops authenticating once that pod is gone or replaced by one with another uid, as a
        real one does. A real TokenRequest refuses to mint for a pod that does not exist;
        here such a token is checked only with `validate_bound_pods=True`."""
        extra: dict[str, list[str]] = {
            "authentication.kubernetes.io/credential-id": [f"JTI={token[-12:]}"]}
        if pod_name:
            extra["authentication.kubernetes.io/pod-name"] = [pod_name]
            extra["authentication.kubernetes.io/pod-uid"] = [pod_uid or ""]
        if node_name:
            extra["authentication.kubernetes.io/node-name"] = [node_name]
            extra["authentication.kubernetes.io/node-uid"] = [node_uid or ""]
        pod = self.get_object("pods", pod_name, namespace) if pod_name else None
        if pod is not None:
            pod_uid = pod_uid or pod["metadata"]["uid"]
            extra["authentication.kubernetes.io/pod-uid"] = [pod_uid]
        info = self.add_token(
            token, username=f"system:serviceaccount:{namespace}:{service_account}",
            uid=sa_uid or f"sa-{namespace}-{service_account}",
            groups=["system:serviceaccounts", f"system:serviceaccounts:{namespace}",
                    "system:authenticated"],
            audiences=audiences, extra=extra, expires_at=expires_at,
            pod=(namespace, pod_name, pod_uid or "") if pod_name else None)
        info.pod_checked = pod is not None
        return info

    def revoke_token(self, token: str) -> None:
        self.tokens.pop(token, None)

    def client_cert(self, username: str, groups: tuple[str, ...] = ()) -> CertPair:
        """A client certificate the server accepts as `username` (TLS servers only)."""
        if self.ca is None:
            raise RuntimeError("client certificates need FakeKube(tls=True)")
        return self.ca.issue(username, organizations=groups)

    def write_kubeconfig(self, path: str | Path, *, token: str | None = None,
                         token_file: str | Path | None = None, client_cert: bool = False,
                         username: str = "admin", namespace: str | None = None) -> Path:
        """A kubeconfig for this server; default credentials: the admin token, if any."""
        pair = self.client_cert(username, ("system:masters",)) if client_cert else None
        if token is None and token_file is None and pair is None:
            token = self.admin_token
        return write_kubeconfig(
            path, self.url, token=token, token_file=token_file,
            ca_pem=self.ca.cert_pem if self.ca else None,
            client_cert_pem=pair.cert_pem if pair else None,
            client_key_pem=pair.key_pem if pair else None, namespace=namespace)

    def resource_type(self, plural: str, group: str = "") -> ResourceType:
        rt = self.store.types.get((group, plural))
        if rt is None:
            raise KeyError(f"no resource {plural}.{group}")
        return rt

    def objects(self, plural: str, group: str = "", namespace: str | None = None
                ) -> list[Obj]:
        """Current objects of a type, straight from the store (no HTTP)."""
        return [o for o in self.store.objects(self.resource_type(plural, group))
                if namespace is None or o["metadata"].get("namespace") == namespace]

    def get_object(self, plural: str, name: str, namespace: str | None = None,
                   group: str = "") -> Obj | None:
        rt = self.resource_type(plural, group)
        try:
            return self.store.get(rt, rt.versions[0], namespace, name)
        except ApiError:
            return None

    def put_object(self, obj: Obj) -> Obj:
        """Create or replace an object by apiVersion/kind, status included (test setup)."""
        rt, version = self.store.type_for(obj["apiVersion"], obj["kind"])
        meta = obj.get("metadata") or {}
        ns, name = meta.get("namespace"), meta.get("name", "")
        try:
            old = self.store.live(rt, ns, name)
        except ApiError:
            return self.store.create(rt, version, ns, obj, keep_status=True)
        body = {**obj, "metadata": {**meta, "resourceVersion": old["metadata"][
            "resourceVersion"]}}
        self.store.update(rt, version, ns, name, body)
        if "status" in obj and rt.status:
            current = self.store.get(rt, version, ns, name)
            self.store.update(rt, version, ns, name, {**current, "status": obj["status"]},
                              subresource="status")
        return self.store.get(rt, version, ns, name)

    def delete_object(self, plural: str, name: str, namespace: str | None = None,
                      group: str = "") -> None:
        rt = self.resource_type(plural, group)
        self.store.delete(rt, rt.versions[0], namespace, name)

    def compact(self, revision: int | None = None) -> int:
        """Forget history up to `revision` (default: now); older versions then get 410."""
        return self.store.compact(revision)

    @property
    def revision(self) -> int:
        return self.store.revision

    # -- fault injection --------------------------------------------------------------------

    def drop_watches(self) -> int:
        """Cut every open watch connection mid-stream (no final chunk). Returns how many."""
        handles = list(self._watches)
        for handle in handles:
            handle.dropped = True
            handle.scope.cancel()
        return len(handles)

    def fail_next(self, count: float = 1, *, status: int = 500, method: str | None = None,
                  path: str | None = None, watch: bool | None = None,
                  match: Match | None = None) -> None:
        """The next `count` matching requests get `status` (500 InternalError by default);
        `count=math.inf` until `clear_faults()`."""
        self._faults.append(_Fault(count, status, match or request_matcher(method, path,
                                                                           watch)))

    def delay_matching(self, seconds: float, *, method: str | None = None,
                       path: str | None = None, watch: bool | None = None) -> None:
        """Delay responses to matching requests (`delay` delays every response)."""
        self._delays.append((request_matcher(method, path, watch), seconds))

    def hold(self, *, method: str | None = None, path: str | None = None,
             watch: bool | None = None) -> trio.Event:
        """Hold matching requests (after they are logged) until the returned event is set."""
        gate = trio.Event()
        self._gates.append((request_matcher(method, path, watch), gate))
        return gate

    def deny(self, *, verb: str | None = None, resource: str | None = None,
             user: str | None = None) -> None:
        """Answer 403 Forbidden for this verb/resource(plural)/user (None: any)."""
        self._denied.append((verb, resource, user))

    def clear_faults(self) -> None:
        self._faults.clear()
        self._delays.clear()
        for _, gate in self._gates:
            gate.set()
        self._gates.clear()
        self._denied.clear()
        self.delay = 0.0

    # -- request log ------------------------------------------------------------------------

    def requests_matching(self, *, method: str | None = None, path: str | None = None,
                          watch: bool | None = None) -> list[RecordedRequest]:
        match = request_matcher(method, path, watch)
        return [r for r in self.requests if match(r)]

    def clear_requests(self) -> None:
        self.requests.clear()

    def active_watches(self, path: str | None = None) -> int:
        return sum(1 for h in self._watches if path is None or path in h.path)

    async def wait_for_watches(self, count: int = 1, path: str | None = None) -> None:
        while self.active_watches(path) < count:
            await self._watches_changed.wait()

    def _watches_change(self) -> None:
        self._watches_changed.set()
        self._watches_changed = trio.Event()

    # -- HTTP -------------------------------------------------------------------------------

    async def _connection(self, stream: trio.abc.Stream, *,
                          ssl_context: ssl.SSLContext | None) -> None:
        peer_user: tuple[str, list[str]] | None = None
        try:
            if ssl_context is not None:
                tls = trio.SSLStream(stream, ssl_context, server_side=True,
                                     https_compatible=True)
                with trio.fail_after(10):
                    await tls.do_handshake()
                peer_user = _cert_user(tls.getpeercert())
                stream = tls
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
            while True:
                request, body = await self._read_request(conn, stream)
                if request is None:
                    return
                keep = await self._handle(conn, stream, request, body, peer_user)
                if not keep or conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError,
                h11.ProtocolError, _Dropped, ssl.SSLError, OSError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async def _read_request(self, conn: h11.Connection, stream: trio.abc.Stream
                            ) -> tuple[h11.Request | None, bytes]:
        request: h11.Request | None = None
        body = bytearray()
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await stream.receive_some(65536)
                conn.receive_data(bytes(data))  # b"" marks EOF
                continue
            if isinstance(event, h11.ConnectionClosed):
                return None, b""
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY:
                    raise _Dropped
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            elif event is h11.PAUSED:
                return None, b""

    async def _send(self, conn: h11.Connection, stream: trio.abc.Stream,
                    event: h11.Event) -> None:
        data = conn.send(event)
        if data:
            await stream.send_all(data)

    async def _respond(self, conn: h11.Connection, stream: trio.abc.Stream,
                       response: _Response) -> None:
        headers = [("Content-Type", response.content_type),
                   ("Content-Length", str(len(response.body))),
                   ("Audit-Id", f"{self._rng.getrandbits(64):016x}"),
                   *response.headers]
        await self._send(conn, stream, h11.Response(status_code=response.status,
                                                    headers=headers))
        await self._send(conn, stream, h11.Data(data=response.body))
        await self._send(conn, stream, h11.EndOfMessage())

    async def _handle(self, conn: h11.Connection, stream: trio.abc.Stream,
                      request: h11.Request, body: bytes,
                      peer_user: tuple[str, list[str]] | None) -> bool:
        target = urlsplit(request.target.decode("latin-1"))
        path = target.path
        query = dict(parse_qsl(target.query, keep_blank_values=True))
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in request.headers}
        impersonate_groups = [v.decode("latin-1") for k, v in request.headers
                              if k.lower() == b"impersonate-group"]
        method = request.method.decode()
        record = RecordedRequest(method, path, query, None, trio.current_time())
        if path.startswith("/_fake/"):
            response = self._control(method, path, query, body)
            record.status = response.status
            await self._respond(conn, stream, response)
            return True
        self.requests.append(record)
        for match, gate in list(self._gates):
            if match(record):
                await gate.wait()
        delay = self.delay + sum(s for m, s in self._delays if m(record))
        if delay:
            await trio.sleep(delay)
        result: _Response | tuple[Any, ...]
        try:
            user = self._authenticate(headers, peer_user)
            record.user = user.name
            user = self._impersonate(user, headers, impersonate_groups)
            record.user = user.name
            self._inject_fault(record)
            self._authorize(request_attributes(user, method, path, query))
            if path in ("/healthz", "/livez", "/readyz"):
                result = _Response(200, b"ok", "text/plain")
            else:
                result = self._route(method, path, query, headers, body, record, user)
        except ApiError as exc:
            result = _error(exc)
        except Exception as exc:  # a bug in the fake: answer 500 so the test sees it
            traceback.print_exc()
            result = _error(ApiError(500, "InternalError",
                                     f"fakekube bug: {type(exc).__name__}: {exc}"))
        if not isinstance(result, _Response):
            record.status = 200
            return await self._watch(conn, stream, record, *result)
        record.status = result.status
        await self._respond(conn, stream, result)
        return True

    def _authenticate(self, headers: dict[str, str],
                      peer_user: tuple[str, list[str]] | None) -> UserInfo:
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            info = self.tokens.get(auth[7:].strip())
            if info is None or API_AUDIENCE not in info.audiences or self._token_invalid(info):
                raise ApiError(401, "Unauthorized", "Unauthorized")
            return UserInfo(info.username, tuple(info.groups), info.uid, dict(info.extra))
        if peer_user is not None:
            return UserInfo(peer_user[0], (*peer_user[1], AUTHENTICATED))
        if self.require_auth:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return UserInfo("system:anonymous", (UNAUTHENTICATED,))

    def _impersonate(self, user: UserInfo, headers: dict[str, str], groups: list[str]
                     ) -> UserInfo:
        """`Impersonate-User`/`-Group`/`-Uid` (kubectl --as/--as-group), each name allowed
        by an `impersonate` rule on users, serviceaccounts, groups or uids."""
        name = headers.get("impersonate-user")
        uid = headers.get("impersonate-uid")
        if name is None:
            if groups or uid:
                raise bad_request("requested impersonation of groups or uid without "
                                  "impersonating a user")
            return user
        sa_namespace = ""
        if name.startswith(SA_PREFIX) and name.count(":") == 3:
            sa_namespace, sa_name = name.removeprefix(SA_PREFIX).split(":")
            self._authorize(RequestAttributes(user, "impersonate", True,
                                              namespace=sa_namespace,
                                              resource="serviceaccounts", name=sa_name))
        else:
            self._authorize(RequestAttributes(user, "impersonate", True, resource="users",
                                              name=name))
        for group in groups:
            self._authorize(RequestAttributes(user, "impersonate", True, resource="groups",
                                              name=group))
        if uid:
            self._authorize(RequestAttributes(user, "impersonate", True,
                                              api_group="authentication.k8s.io",
                                              resource="uids", name=uid))
        if sa_namespace and not groups:
            groups = list(service_account_groups(sa_namespace))
        extra = AUTHENTICATED if name != "system:anonymous" else UNAUTHENTICATED
        if extra not in groups:
            groups = [*groups, extra]
        return UserInfo(name, tuple(groups), uid or "")

    def decide(self, attrs: RequestAttributes) -> Decision:
        """The authorizer chain: system:masters, then RBAC when on, else allow."""
        if MASTERS in attrs.user.groups or not self.rbac:
            return Decision(True)
        return self.authorizer.authorize(attrs)

    def _inject_fault(self, record: RecordedRequest) -> None:
        for fault in self._faults:
            if fault.remaining > 0 and fault.match(record):
                fault.remaining -= 1
                reason = {429: "TooManyRequests", 503: "ServiceUnavailable",
                          504: "Timeout"}.get(fault.status, "InternalError")
                raise ApiError(fault.status, reason,
                               f"Internal error occurred: injected fault ({fault.status})")
        self._faults = [f for f in self._faults if f.remaining > 0]

    def _authorize(self, attrs: RequestAttributes) -> None:
        decision = self.decide(attrs)
        if not decision.allowed:
            raise forbidden(attrs, decision.reason)
        if not attrs.resource_request:
            return
        for d_verb, d_resource, d_user in self._denied:
            if ((d_verb is None or d_verb == attrs.verb)
                    and (d_resource is None or d_resource == attrs.resource)
                    and (d_user is None or d_user == attrs.user.name)):
                raise forbidden(attrs)

    # -- routing ----------------------------------------------------------------------------

    def _route(self, method: str, path: str, query: dict[str, str], headers: dict[str, str],
               body: bytes, record: RecordedRequest, user: UserInfo
               ) -> _Response | tuple[Any, ...]:
        parts = [unquote(p) for p in path.split("/") if p]
        if path == "/version":
            return _json(200, SERVER_VERSION)
        if parts == ["api"]:
            return _json(200, {"kind": "APIVersions", "versions": ["v1"],
                               "serverAddressByClientCIDRs": [
                                   {"clientCIDR": "0.0.0.0/0",
                                    "serverAddress": f"{self.host}:{self.port}"}]})
        if parts == ["apis"]:
            return _json(200, self._group_list())
        if parts[:2] == ["openapi", "v3"]:
            types = list(self.store.types.values())
            if len(parts) == 2:
                return _json(200, openapi.index(types))
            rest = parts[2:]
            doc = None
            if rest[:1] == ["api"] and len(rest) == 2:
                doc = openapi.document(types, "", rest[1])
            elif rest[:1] == ["apis"] and len(rest) == 3:
                doc = openapi.document(types, rest[1], rest[2])
            if doc is None:
                raise ApiError(404, "NotFound", "the server could not find the requested "
                                                "resource")
            return _json(200, doc)
        if len(parts) == 2 and parts[0] == "apis":
            group_doc = self._group(parts[1])
            if group_doc is None:
                raise ApiError(404, "NotFound", "the server could not find the requested "
                                                "resource")
            return _json(200, group_doc)
        if parts[:1] == ["api"] and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[:1] == ["apis"] and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if not rest:
            return _json(200, self._resource_list(group, version))
        namespace: str | None = None
        if (rest[0] == "namespaces" and len(rest) >= 3
                and (t := self.store.types.get((group, rest[2]))) is not None and t.namespaced):
            namespace, rest = rest[1], rest[2:]
        if len(rest) > 3:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        rt = self.store.resolve(group, version, rest[0])
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        if rt.namespaced and name is not None and namespace is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if not rt.namespaced and namespace is not None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if sub not in (None, "status") or (sub == "status" and not rt.status):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        verb = _verb(method, name, query)
        if verb is None or verb not in rt.verbs:
            raise ApiError(405, "MethodNotAllowed",
                           "the server does not allow this method on the requested resource")
        store = self.store
        field_manager = query.get("fieldManager")
        if verb == "watch":
            return (rt, version, namespace, query)
        table = verb in ("list", "get") and wants_table(headers.get("accept", ""))
        if verb == "list":
            listed = store.list(
                rt, version, namespace, label=query.get("labelSelector"),
                field=query.get("fieldSelector"), limit=_int(query.get("limit")),
                continue_token=query.get("continue") or None,
                resource_version=query.get("resourceVersion"),
                resource_version_match=query.get("resourceVersionMatch"))
            return _json(200, to_table(rt, version, listed, query.get("includeObject"))
                         if table else listed)
        if verb == "get":
            got = store.get(rt, version, namespace, name or "")
            return _json(200, to_table(rt, version, got, query.get("includeObject"))
                         if table else got)
        if verb == "create":
            doc = _body(body)
            if rt.key == ("authentication.k8s.io", "tokenreviews"):
                return _json(201, self._token_review(doc))
            if rt.group == "authorization.k8s.io":
                return _json(201, self._access_review(rt, doc, user, namespace))
            return _json(201, store.create(rt, version, namespace, doc,
                                           field_manager=field_manager,
                                           dry_run=query.get("dryRun") == "All"))
        if verb == "update":
            return _json(200, store.update(rt, version, namespace, name or "", _body(body),
                                           subresource=sub, field_manager=field_manager))
        if verb == "patch":
            content_type = headers.get("content-type", "").split(";")[0].strip()
            return _json(200, store.patch(rt, version, namespace, name or "", content_type,
                                          body, subresource=sub, field_manager=field_manager,
                                          force=query.get("force") == "true"))
        if verb == "delete":
            options = _body(body) if body.strip() else {}
            for key in ("propagationPolicy", "gracePeriodSeconds"):
                if key in query:
                    options.setdefault(key, query[key])
            code, obj = store.delete(rt, version, namespace, name or "", options)
            return _json(code, obj)
        if verb == "deletecollection":
            listed = store.list(rt, version, namespace, label=query.get("labelSelector"),
                                field=query.get("fieldSelector"))
            for item in listed["items"]:
                meta = item["metadata"]
                store.delete(rt, version, meta.get("namespace"), meta["name"])
            listed["items"] = [{**i, "apiVersion": rt.api_version(version), "kind": rt.kind}
                               for i in listed["items"]]
            return _json(200, listed)
        raise AssertionError(verb)

    def _group_list(self) -> Obj:
        groups: dict[str, list[str]] = {}
        for rt in self.store.types.values():
            if rt.group:
                versions = groups.setdefault(rt.group, [])
                versions.extend(v for v in rt.versions if v not in versions)
        return {"kind": "APIGroupList", "apiVersion": "v1",
                "groups": [self._group(g) for g in sorted(groups)]}

    def _group(self, group: str) -> Obj | None:
        versions: list[str] = []
        for rt in self.store.types.values():
            if rt.group == group:
                versions.extend(v for v in rt.versions if v not in versions)
        if not versions:
            return None
        entries = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": entries,
                "preferredVersion": entries[0]}

    def _resource_list(self, group: str, version: str) -> Obj:
        resources = []
        for rt in self.store.types.values():
            if rt.group == group and version in rt.versions:
                resources.append(rt.discovery())
                if rt.status:
                    resources.append({"name": f"{rt.plural}/status", "singularName": "",
                                      "namespaced": rt.namespaced, "kind": rt.kind,
                                      "verbs": ["get", "patch", "update"]})
        if not resources:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version,
                "resources": resources}

    def _token_review(self, review: Obj) -> Obj:
        spec = review.get("spec") or {}
        token = spec.get("token")
        if not token:
            raise ApiError(422, "Invalid", 'TokenReview.authentication.k8s.io "" is invalid: '
                                           "spec.token: Required value")
        wanted = spec.get("audiences") or [API_AUDIENCE]
        info = self.tokens.get(token)
        status: Obj
        if info is None:
            status = {"user": {}, "error": "[invalid bearer token, service account token "
                                           "has expired or is not valid]"}
        elif not (matched := [a for a in wanted if a in info.audiences]):
            status = {"user": {}, "error": f"[invalid bearer token, token audiences "
                                           f"{json.dumps(info.audiences)} is invalid for the "
                                           f"target audiences {json.dumps(wanted)}]"}
        elif error := self._token_invalid(info):
            status = {"user": {}, "error": f"[invalid bearer token, {error}]"}
        else:
            status = {"authenticated": True, "user": info.user(), "audiences": matched}
        return {"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
                "metadata": {"creationTimestamp": None}, "spec": spec, "status": status}

    def _access_review(self, rt: ResourceType, review: Any, user: UserInfo,
                       namespace: str | None) -> Obj:
        """(Self|Local)SubjectAccessReview, answered by the authorizer requests meet."""
        if not isinstance(review, dict):
            raise bad_request("the body of the request was in an unknown format")
        spec = review.get("spec")
        name = (review.get("metadata") or {}).get("name", "")
        if not isinstance(spec, dict):
            spec = {}
        resource, non_resource = spec.get("resourceAttributes"), spec.get(
            "nonResourceAttributes")
        kind = f"{rt.kind}.{rt.group}"
        if not isinstance(resource, dict | None) or not isinstance(non_resource, dict | None):
            raise bad_request("resourceAttributes and nonResourceAttributes are objects")
        if bool(resource) == bool(non_resource):
            raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: spec.resourceAttributes:'
                                           " Invalid value: exactly one of "
                                           "nonResourceAttributes or resourceAttributes must "
                                           "be specified")
        if rt.plural != "selfsubjectaccessreviews":
            groups = spec.get("groups") or []
            if not spec.get("user") and not groups:
                raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: spec.user: Invalid '
                                               'value: "": at least one of user or group must '
                                               "be specified")
            user = UserInfo(spec.get("user", ""), tuple(groups), spec.get("uid", ""),
                            dict(spec.get("extra") or {}))
        if rt.plural == "localsubjectaccessreviews":
            if non_resource:
                raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: '
                                               "spec.nonResourceAttributes: Invalid value: "
                                               "disallowed on this kind of request")
            assert resource is not None  # exactly one of the two is set (checked above)
            if resource.get("namespace", namespace) != namespace:
                raise ApiError(422, "Invalid", f'{kind} "{name}" is invalid: '
                                               "spec.resourceAttributes.namespace: Invalid "
                                               "value: must match metadata.namespace")
            resource = {**resource, "namespace": namespace}
        if resource is not None:
            attrs = RequestAttributes(
                user, resource.get("verb", ""), True, namespace=resource.get("namespace", ""),
                api_group=resource.get("group", ""), api_version=resource.get("version", ""),
                resource=resource.get("resource", ""),
                subresource=resource.get("subresource", ""), name=resource.get("name", ""))
        else:
            assert non_resource is not None
            attrs = RequestAttributes(user, non_resource.get("verb", ""), False,
                                      path=non_resource.get("path", ""))
        decision = self.decide(attrs)
        status: Obj = {"allowed": decision.allowed}
        if decision.reason:
            status["reason"] = decision.reason
        meta: Obj = {"creationTimestamp": None}
        if namespace:
            meta["namespace"] = namespace
        return {"kind": rt.kind, "apiVersion": "authorization.k8s.io/v1", "metadata": meta,
                "spec": spec, "status": status}

    def _token_invalid(self, info: TokenInfo) -> str | None:
        """Why a known token no longer authenticates (the service account validator's
        words), or None."""
        if info.expires_at is not None and info.expires_at < time.time():
            return "service account token has expired"
        if info.pod is not None and (info.pod_checked or self.validate_bound_pods):
            obj = self.get_object("pods", info.pod[1], info.pod[0])
            if obj is None or (info.pod[2] and obj["metadata"]["uid"] != info.pod[2]):
                return "service account token has been invalidated"
            deleting = obj["metadata"].get("deletionTimestamp")
            if deleting and _age(deleting) > 60:
                return "service account token has been invalidated"
        return None

    # -- watch ------------------------------------------------------------------------------

    async def _watch(self, conn: h11.Connection, stream: trio.abc.Stream,
                     record: RecordedRequest, rt: ResourceType, version: str,
                     namespace: str | None, query: dict[str, str]) -> bool:
        timeout = _int(query.get("timeoutSeconds")) or self._rng.uniform(1800, 3600)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        headers = [("Content-Type", "application/json"), ("Transfer-Encoding", "chunked"),
                   ("Audit-Id", f"{self._rng.getrandbits(64):016x}")]
        try:
            watcher = self.store.watch(rt, version, namespace,
                                       label=query.get("labelSelector"),
                                       field=query.get("fieldSelector"),
                                       resource_version=query.get("resourceVersion"))
        except ApiError as exc:
            if exc.code != 410 or self.gone_as_http_status:
                record.status = exc.code
                await self._respond(conn, stream, _error(exc))
                return True
            # What a real API server does: accept the watch, then send an ERROR event.
            await self._send(conn, stream, h11.Response(status_code=200, headers=headers))
            line = json.dumps({"type": "ERROR", "object": exc.status()}) + "\n"
            await self._send(conn, stream, h11.Data(data=line.encode()))
            await self._send(conn, stream, h11.EndOfMessage())
            return True
        handle = _WatchHandle(trio.CancelScope(deadline=trio.current_time() + timeout),
                              record.path)
        try:
            await self._send(conn, stream, h11.Response(status_code=200, headers=headers))
            self._watches.add(handle)
            self._watches_change()
            with handle.scope:
                while True:
                    event: tuple[str, Obj] | None = None
                    with trio.move_on_after(self.bookmark_interval):
                        try:
                            event = await watcher.receive.receive()
                        except trio.EndOfChannel:
                            break  # the store closed this watcher (it fell too far behind)
                    if event is None:
                        if not bookmarks or watcher.pending:
                            continue
                        # Everything up to the store's revision has been sent: say so.
                        event = ("BOOKMARK", {"kind": rt.kind,
                                              "apiVersion": rt.api_version(version),
                                              "metadata": {"resourceVersion":
                                                           str(self.store.revision)}})
                    line = json.dumps({"type": event[0], "object": event[1]}) + "\n"
                    await self._send(conn, stream, h11.Data(data=line.encode()))
        finally:
            self._watches.discard(handle)
            self._watches_change()
            watcher.close()
        if handle.dropped:
            raise _Dropped
        await self._send(conn, stream, h11.EndOfMessage())
        return True

    # -- control endpoints for out-of-process tests -----------------------------------------

    def _control(self, method: str, path: str, query: dict[str, str], body: bytes
                 ) -> _Response:
        try:
            doc = json.loads(body) if body.strip() else {}
        except ValueError:
            return _json(400, {"error": "body is not JSON"})
        action = path.removeprefix("/_fake/").strip("/")
        if action == "compact" and method == "POST":
            return _json(200, {"compacted": self.compact(doc.get("revision"))})
        if action == "drop-watches" and method == "POST":
            return _json(200, {"dropped": self.drop_watches()})
        if action == "fail" and method == "POST":
            count = doc.get("count", 1)
            self.fail_next(math.inf if count is None else count,
                           status=doc.get("status", 500), method=doc.get("method"),
                           path=doc.get("path"), watch=doc.get("watch"))
            return _json(200, {})
        if action == "delay" and method == "POST":
            self.delay = float(doc.get("seconds", 0))
            return _json(200, {})
        if action == "clear-faults" and method == "POST":
            self.clear_faults()
            return _json(200, {})
        if action == "tokens" and method == "POST":
            token = doc.pop("token")
            if "service_account" in doc:
                self.add_service_account_token(token, **doc)
            else:
                self.add_token(token, **doc)
            return _json(200, {})
        if action.startswith("tokens/") and method == "DELETE":
            self.revoke_token(action.removeprefix("tokens/"))
            return _json(200, {})
        if action == "requests" and method == "GET":
            return _json(200, [{"method": r.method, "path": r.path, "query": r.query,
                                "user": r.user, "status": r.status, "at": r.at}
                               for r in self.requests])
        if action == "requests" and method == "DELETE":
            self.clear_requests()
            return _json(200, {})
        if action == "state" and method == "GET":
            return _json(200, {"revision": self.store.revision,
                               "compacted": self.store.compacted,
                               "watches": self.active_watches()})
        return _json(404, {"error": f"no control endpoint {method} {path}"})


def _verb(method: str, name: str | None, query: dict[str, str]) -> str | None:
    if name is None:
        if method == "GET":
            return "watch" if query.get("watch") in ("true", "1") else "list"
        return {"POST": "create", "DELETE": "deletecollection"}.get(method)
    return {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(method)


def _age(timestamp: str) -> float:
    """Seconds since an RFC 3339 timestamp the store wrote."""
    moment = datetime.datetime.strptime(timestamp, "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.UTC)
    return time.time() - moment.timestamp()


def _int(value: str | None) -> int | None:
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise bad_request(f"invalid integer {value!r}") from None


def _body(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError as exc:
        raise bad_request(f"the body of the request was in an unknown format: {exc}") from None


def _cert_user(cert: Any) -> tuple[str, list[str]] | None:
    if not cert:
        return None
    cn, orgs = None, []
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                cn = value
            elif key == "organizationName":
                orgs.append(value)
    return (cn, orgs) if cn else None


__all__ = ["FakeKube", "RecordedRequest", "TokenInfo", "not_found", "request_matcher"]
