"""`FakeKube`: a Kubernetes API server double speaking real HTTP/1.1 (h11 on trio sockets).

It serves the REST and watch protocol of the store in `store.py` — enough that the client
code nodeagent runs against a real cluster runs unchanged against it — plus what tests need
and a real server does not offer: fault injection (drop every watch, fail the next N
requests, delay responses, deny verbs), a log of every request, forced compaction, a table
of tokens for authentication and TokenReview, and control endpoints under `/_fake/` so a
test can drive a server running in another process (`python -m nodeagent.testing.fakekube`).

This module owns the configuration, the lifecycle and the test-facing API, and the order a
request goes through: log, hold/delay, authenticate, impersonate, injected faults,
authorize, then route. Each step is its own module: `connection.py` (HTTP),
`authentication.py`, `authorization.py` (with `rbac.py`), `faults.py`, `rest.py`
(routing, with `discovery.py`, `reviews.py`, `table.py`, `openapi.py`), `watchstream.py`
and `control.py`; each says where it differs from a real cluster.
"""

from __future__ import annotations

import random
import ssl
import tempfile
import traceback
from functools import partial
from pathlib import Path

import trio

from nodeagent.testing.fakekube.authentication import API_AUDIENCE, Authenticator, TokenInfo
from nodeagent.testing.fakekube.authorization import Authorizer
from nodeagent.testing.fakekube.connection import (
    HttpConnection,
    Request,
    Response,
    error_response,
    serve_connection,
)
from nodeagent.testing.fakekube.control import control_endpoint
from nodeagent.testing.fakekube.errors import ApiError, not_found
from nodeagent.testing.fakekube.faults import Faults
from nodeagent.testing.fakekube.kubeconfig import write_kubeconfig
from nodeagent.testing.fakekube.objects import Obj
from nodeagent.testing.fakekube.pki import CertificateAuthority, CertPair
from nodeagent.testing.fakekube.rbac import (
    Decision,
    RequestAttributes,
    bootstrap_policy,
    request_attributes,
)
from nodeagent.testing.fakekube.registry import RBAC, ResourceType
from nodeagent.testing.fakekube.requestlog import Match, RecordedRequest, request_matcher
from nodeagent.testing.fakekube.rest import RestApi, WatchRequest
from nodeagent.testing.fakekube.store import DEFAULT_NAMESPACES, Store
from nodeagent.testing.fakekube.watchstream import OpenWatches, serve_watch


class FakeKube:
    """The fake API server. Configure, then `await nursery.start(fake.serve)`."""

    def __init__(self, *, token: str | None = None, tls: bool = False,
                 bookmark_interval: float = 1.0, history_limit: int | None = None,
                 namespaces: tuple[str, ...] = DEFAULT_NAMESPACES,
                 watch_queue_limit: int = 10_000, validate_bound_pods: bool = False,
                 gone_as_http_status: bool = False, rbac: bool = False) -> None:
        self.store = Store(namespaces=namespaces, history_limit=history_limit,
                           watch_queue_limit=watch_queue_limit)
        self.faults = Faults()
        # rbac=True: everyone but system:masters is authorized by RBAC (see rbac.py), over
        # the bootstrap policy plus whatever Roles and bindings the test stores.
        self.authorizer = Authorizer(
            lambda plural: self.store.objects(self.store.types[(RBAC, plural)]),
            rbac=rbac, denied=self.faults.denies)
        if rbac:
            for obj in bootstrap_policy():
                self.put_object(obj)
        self.authenticator = Authenticator(
            lambda namespace, name: self.get_object("pods", name, namespace),
            require_auth=token is not None, validate_bound_pods=validate_bound_pods)
        self.admin_token = token
        if token is not None:
            self.add_token(token, username="admin",
                           groups=["system:masters", "system:authenticated"])
        self.tls = tls
        self.ca: CertificateAuthority | None = CertificateAuthority() if tls else None
        self.bookmark_interval = bookmark_interval
        self.gone_as_http_status = gone_as_http_status
        self.requests: list[RecordedRequest] = []
        self.watches = OpenWatches()
        self.rest = RestApi(self.store, self.authenticator, self.authorizer.decide,
                            self.authorizer.rules)
        self.host = "127.0.0.1"
        self.port = 0
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._rng = random.Random()

    @property
    def rbac(self) -> bool:
        return self.authorizer.rbac

    @property
    def tokens(self) -> dict[str, TokenInfo]:
        return self.authenticator.tokens

    @property
    def require_auth(self) -> bool:
        return self.authenticator.require_auth

    @property
    def validate_bound_pods(self) -> bool:
        return self.authenticator.validate_bound_pods

    @validate_bound_pods.setter
    def validate_bound_pods(self, value: bool) -> None:
        self.authenticator.validate_bound_pods = value

    @property
    def delay(self) -> float:
        """Seconds added to every response."""
        return self.faults.delay

    @delay.setter
    def delay(self, seconds: float) -> None:
        self.faults.delay = seconds

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
                handler = partial(serve_connection, ssl_context=ssl_context,
                                  handler=self._handle, rng=self._rng)
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
        return self.authenticator.add_token(
            token, username=username, uid=uid, groups=groups, audiences=audiences,
            extra=extra, expires_at=expires_at, pod=pod)

    def add_service_account_token(
            self, token: str, *, namespace: str, service_account: str,
            pod_name: str | None = None, pod_uid: str | None = None,
            node_name: str | None = None, node_uid: str | None = None,
            audiences: list[str] | None = None, expires_at: float | None = None,
            sa_uid: str | None = None) -> TokenInfo:
        """A bound projected ServiceAccount token (see
        `Authenticator.add_service_account_token`)."""
        return self.authenticator.add_service_account_token(
            token, namespace=namespace, service_account=service_account, pod_name=pod_name,
            pod_uid=pod_uid, node_name=node_name, node_uid=node_uid, audiences=audiences,
            expires_at=expires_at, sa_uid=sa_uid)

    def revoke_token(self, token: str) -> None:
        self.authenticator.revoke_token(token)

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
        return self.watches.drop()

    def fail_next(self, count: float = 1, *, status: int = 500, method: str | None = None,
                  path: str | None = None, watch: bool | None = None,
                  match: Match | None = None) -> None:
        """The next `count` matching requests get `status` (500 InternalError by default);
        `count=math.inf` until `clear_faults()`."""
        self.faults.fail(count, status, match or request_matcher(method, path, watch))

    def delay_matching(self, seconds: float, *, method: str | None = None,
                       path: str | None = None, watch: bool | None = None) -> None:
        """Delay responses to matching requests (`delay` delays every response)."""
        self.faults.delay_matching(request_matcher(method, path, watch), seconds)

    def hold(self, *, method: str | None = None, path: str | None = None,
             watch: bool | None = None) -> trio.Event:
        """Hold matching requests (after they are logged) until the returned event is set."""
        return self.faults.hold(request_matcher(method, path, watch))

    def deny(self, *, verb: str | None = None, resource: str | None = None,
             user: str | None = None) -> None:
        """Answer 403 Forbidden for this verb/resource(plural)/user (None: any)."""
        self.faults.deny(verb, resource, user)

    def clear_faults(self) -> None:
        self.faults.clear()

    # -- request log ------------------------------------------------------------------------

    def requests_matching(self, *, method: str | None = None, path: str | None = None,
                          watch: bool | None = None) -> list[RecordedRequest]:
        match = request_matcher(method, path, watch)
        return [r for r in self.requests if match(r)]

    def clear_requests(self) -> None:
        self.requests.clear()

    def active_watches(self, path: str | None = None) -> int:
        return self.watches.count(path)

    async def wait_for_watches(self, count: int = 1, path: str | None = None) -> None:
        await self.watches.wait_for(count, path)

    def decide(self, attrs: RequestAttributes) -> Decision:
        """The authorizer chain: system:masters, then RBAC when on, else allow."""
        return self.authorizer.decide(attrs)

    # -- a request's way through ------------------------------------------------------------

    async def _handle(self, http: HttpConnection, request: Request) -> bool:
        method, path, query = request.method, request.path, request.query
        record = RecordedRequest(method, path, query, None, trio.current_time())
        if path.startswith("/_fake/"):
            response = control_endpoint(self, method, path, request.body)
            record.status = response.status
            await http.respond(response)
            return True
        self.requests.append(record)
        await self.faults.hold_and_delay(record)
        result: Response | WatchRequest
        try:
            user = self.authenticator.authenticate(request.headers, request.peer_cert)
            record.user = user.name
            user = self.authorizer.impersonate(user, request.headers,
                                               request.impersonate_groups)
            record.user = user.name
            self.faults.inject(record)
            self.authorizer.authorize(request_attributes(user, method, path, query))
            if path in ("/healthz", "/livez", "/readyz"):
                result = Response(200, b"ok", "text/plain")
            else:
                result = self.rest.route(request, user, f"{self.host}:{self.port}")
        except ApiError as exc:
            result = error_response(exc)
        except Exception as exc:  # a bug in the fake: answer 500 so the test sees it
            traceback.print_exc()
            result = error_response(ApiError(500, "InternalError",
                                             f"fakekube bug: {type(exc).__name__}: {exc}"))
        if isinstance(result, WatchRequest):
            record.status = 200
            return await serve_watch(http, self.store, result, record, self.watches,
                                     bookmark_interval=self.bookmark_interval,
                                     gone_as_http_status=self.gone_as_http_status,
                                     rng=self._rng)
        record.status = result.status
        await http.respond(result)
        return True

__all__ = ["API_AUDIENCE", "FakeKube", "RecordedRequest", "TokenInfo", "not_found",
           "request_matcher"]
