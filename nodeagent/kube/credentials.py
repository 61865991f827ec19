"""Where the API server is and how to authenticate to it: kubeconfig or in-cluster.

Why two libraries: the official `kubernetes` package is the reference implementation of
kubeconfig parsing (merged KUBECONFIG lists, contexts, inline `*-data` vs file paths, exec
plugins, OIDC and other auth providers, `insecure-skip-tls-verify`, `tls-server-name`,
`proxy-url`) and of the in-cluster environment, so we let it fill a
`kubernetes.client.Configuration` and never re-implement that. Its HTTP client, though, is
synchronous urllib3: every long-running watch would pin an OS thread and could not be
cancelled by a trio cancel scope. So the I/O runs on httpx, which under trio selects its
trio backend (httpcore's AutoBackend asks sniffio for the running library) — a watch is a
task, cancellation closes its socket, and timeouts are cancel scopes. This module is the
bridge: a `Configuration` in, a `Credentials` (base URL, TLS context, httpx auth) out.

Tokens rotate: projected ServiceAccount tokens are re-issued by the kubelet (hourly by
default) and the file is swapped underneath us. `TokenFileAuth` re-reads the file every
`refresh_period` and immediately on a 401, then retries that request once with the new
token.
"""

from __future__ import annotations

import os
import ssl
import time
from collections.abc import AsyncGenerator, Callable, Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio
from kubernetes import config as _kubernetes_config
from kubernetes.client import Configuration

from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.kube.credentials")

# The package's loaders are untyped; their results are checked where they are used.
kube_config: Any = _kubernetes_config.kube_config
incluster_config: Any = _kubernetes_config.incluster_config

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
SERVICE_TOKEN_PATH = SERVICE_ACCOUNT_DIR / "token"
SERVICE_CA_PATH = SERVICE_ACCOUNT_DIR / "ca.crt"
SERVICE_NAMESPACE_PATH = SERVICE_ACCOUNT_DIR / "namespace"
TOKEN_REFRESH_PERIOD = 60.0


class CredentialsError(Exception):
    """No usable API server configuration (no kubeconfig, not in a cluster, bad files)."""


@dataclass(frozen=True)
class Credentials:
    """Everything needed to open an httpx client to one API server."""

    server: str  # base URL, e.g. https://10.96.0.1:443
    ssl_context: ssl.SSLContext | None  # None for plain http:// servers
    auth: httpx.Auth | None
    tls_server_name: str | None = None  # SNI/hostname to verify if it differs from the URL
    proxy: str | None = None
    source: str = ""  # for logs: "in-cluster" or "kubeconfig <path> context <name>"
    namespace: str | None = None  # in-cluster: the pod's namespace; kubeconfig: context's

    def httpx_options(self) -> dict[str, Any]:
        """Keyword arguments for `httpx.AsyncClient` (the caller adds timeouts and limits)."""
        opts: dict[str, Any] = {"base_url": self.server, "auth": self.auth}
        if self.ssl_context is not None:
            opts["verify"] = self.ssl_context
        if self.proxy:
            opts["proxy"] = self.proxy
        return opts


class TokenFileAuth(httpx.Auth):
    """Bearer token read from a file, re-read every `refresh_period` seconds and on 401."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        refresh_period: float = TOKEN_REFRESH_PERIOD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = Path(path)
        self.refresh_period = refresh_period
        self._clock = clock
        self._token: str | None = None
        self._read_at = 0.0
        self.reads = 0  # how many times the file was read (tests, debug)

    def token(self, *, force: bool = False) -> str:
        now = self._clock()
        if force or self._token is None or now - self._read_at >= self.refresh_period:
            # A small read from a tmpfs mount; cheaper than a thread hop, once a minute.
            text = self.path.read_text().strip()
            if not text:
                raise CredentialsError(f"token file {self.path} is empty")
            if self._token is not None and text != self._token:
                log.info("token rotated", path=str(self.path))
            self._token, self._read_at = text, now
            self.reads += 1
        return self._token

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        token = self.token()
        request.headers["Authorization"] = f"Bearer {token}"
        response = yield request
        if response.status_code == 401:
            fresh = self.token(force=True)
            if fresh != token:
                request.headers["Authorization"] = f"Bearer {fresh}"
                yield request


class ConfigurationAuth(httpx.Auth):
    """The Authorization header a `kubernetes.client.Configuration` computes.

    Covers static tokens, basic auth, exec plugins and auth providers: the package's refresh
    hook re-runs the plugin when its token expired. The hook may spawn a process, so it runs
    in a worker thread (once per `refresh_period`, or on a 401), never on the event loop.
    """

    def __init__(
        self,
        configuration: Any,
        *,
        refresh_period: float = TOKEN_REFRESH_PERIOD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._configuration = configuration
        self.refresh_period = refresh_period
        self._clock = clock
        self._header: str | None = None
        self._read_at = 0.0

    def _compute(self) -> str | None:
        value = self._configuration.get_api_key_with_prefix("BearerToken")
        return str(value) if value else None

    async def _current(self, *, force: bool = False) -> str | None:
        now = self._clock()
        if force or self._header is None or now - self._read_at >= self.refresh_period:
            self._header = await trio.to_thread.run_sync(self._compute)
            self._read_at = now
        return self._header

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        header = await self._current()
        if header:
            request.headers["Authorization"] = header
        response = yield request
        if response.status_code == 401:
            fresh = await self._current(force=True)
            if fresh and fresh != header:
                request.headers["Authorization"] = fresh
                yield request

    def sync_auth_flow(
        self, request: httpx.Request
    ) -> Generator[httpx.Request, httpx.Response, None]:
        raise RuntimeError("ConfigurationAuth is for httpx.AsyncClient under trio")


def ssl_context_from(configuration: Any) -> ssl.SSLContext:
    """A client TLS context from a Configuration's CA, client cert/key and verify flag."""
    ctx = ssl.create_default_context(cafile=configuration.ssl_ca_cert or None)
    if configuration.verify_ssl is False:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if configuration.cert_file:
        ctx.load_cert_chain(configuration.cert_file, configuration.key_file or None)
    return ctx


def _server(configuration: Any) -> str:
    host = str(configuration.host or "").rstrip("/")
    if not host:
        raise CredentialsError("the configuration names no API server")
    return host


def _kubeconfig_paths(path: str | os.PathLike[str] | None) -> str:
    if path is not None:
        return os.fspath(path)
    return os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")


def _context_user(paths: str, context: str | None) -> tuple[Mapping[str, Any], str | None]:
    """The raw `user` section and namespace of the chosen context (for `tokenFile`)."""
    merged = kube_config.KubeConfigMerger(paths).config
    name = context or merged["current-context"]
    ctx = merged["contexts"].get_with_name(name)["context"]
    namespace = ctx.safe_get("namespace")
    user_name = ctx.safe_get("user")
    if not user_name or not merged.safe_get("users"):
        return {}, namespace
    user = merged["users"].get_with_name(user_name, safe=True)
    return (user.value.get("user") or {}) if user else {}, namespace


def load_kubeconfig(
    path: str | os.PathLike[str] | None = None,
    *,
    context: str | None = None,
    refresh_period: float = TOKEN_REFRESH_PERIOD,
) -> Credentials:
    """Credentials from a kubeconfig file (default: $KUBECONFIG, then ~/.kube/config)."""
    paths = _kubeconfig_paths(path)
    configuration = Configuration()
    try:
        kube_config.load_kube_config(
            config_file=paths,
            context=context,
            client_configuration=configuration,
            persist_config=False,
        )
        user, namespace = _context_user(paths, context)
    except Exception as exc:  # the loader raises ConfigException, KeyError, OSError, yaml errors
        raise CredentialsError(f"cannot load kubeconfig {paths}: {exc}") from exc
    server = _server(configuration)
    auth: httpx.Auth
    token_file = user.get("tokenFile")
    if token_file and not user.get("token"):
        # The package reads tokenFile once; we re-read it like client-go does.
        base = os.path.dirname(os.path.abspath(paths.split(os.pathsep)[0]))
        auth = TokenFileAuth(
            os.path.join(base, os.path.expanduser(token_file)), refresh_period=refresh_period
        )
    else:
        auth = ConfigurationAuth(configuration, refresh_period=refresh_period)
    return Credentials(
        server=server,
        ssl_context=ssl_context_from(configuration) if server.startswith("https:") else None,
        auth=auth,
        tls_server_name=configuration.tls_server_name or None,
        proxy=configuration.proxy or None,
        source=f"kubeconfig {paths} context {context or 'current'}",
        namespace=namespace,
    )


def load_incluster(
    *,
    token_path: str | os.PathLike[str] = SERVICE_TOKEN_PATH,
    ca_path: str | os.PathLike[str] = SERVICE_CA_PATH,
    namespace_path: str | os.PathLike[str] = SERVICE_NAMESPACE_PATH,
    environ: Mapping[str, str] | None = None,
    refresh_period: float = TOKEN_REFRESH_PERIOD,
) -> Credentials:
    """Credentials of the pod's ServiceAccount: KUBERNETES_SERVICE_HOST/PORT, CA, token file."""
    configuration = Configuration()
    loader = incluster_config.InClusterConfigLoader(
        token_filename=os.fspath(token_path),
        cert_filename=os.fspath(ca_path),
        try_refresh_token=False,
        environ=dict(os.environ if environ is None else environ),
    )
    try:
        loader.load_and_set(configuration)
    except Exception as exc:
        raise CredentialsError(f"not usable in-cluster: {exc}") from exc
    try:
        namespace: str | None = Path(namespace_path).read_text().strip() or None
    except OSError:
        namespace = None
    return Credentials(
        server=_server(configuration),
        ssl_context=ssl_context_from(configuration),
        auth=TokenFileAuth(token_path, refresh_period=refresh_period),
        source="in-cluster",
        namespace=namespace,
    )


def in_cluster(environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return bool(env.get("KUBERNETES_SERVICE_HOST")) and SERVICE_TOKEN_PATH.exists()


def load_credentials(
    kubeconfig: str | os.PathLike[str] | None = None, *, context: str | None = None
) -> Credentials:
    """Explicit kubeconfig if given, else in-cluster when running in a pod, else kubeconfig."""
    if kubeconfig is None and in_cluster():
        return load_incluster()
    return load_kubeconfig(kubeconfig, context=context)
