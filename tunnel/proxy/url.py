"""Proxy URLs, and which proxy (if any) a server address is dialed through.

`ProxyRules.from_environment()` reads `HTTPS_PROXY`/`https_proxy` (for tls:// and wss://
servers), `HTTP_PROXY`/`http_proxy` (tcp://, ws://) and `NO_PROXY`/`no_proxy` with the
rules of Go's golang.org/x/net/http/httpproxy, which kubelet, kubectl and the other
Kubernetes components use, so one set of variables configures a node the same way for
all of them: the upper-case name wins; a value without a scheme is http://; NO_PROXY
lists host names (a name matches itself and its subdomains, `.name` and `*.name` only the
subdomains), IP addresses, CIDRs, any of them with `:port`, or `*` for all; `localhost`
and loopback addresses are never proxied.

A proxy's password is never printed: `str(ProxyURL)` and every error message here show
`[redacted]` in its place.
"""

from __future__ import annotations

import ipaddress
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from tunnel.transports.base import Endpoint

__all__ = ["DIRECT", "REDACTED", "ProxyRules", "ProxyURL", "parse_proxy_url"]

REDACTED = "[redacted]"
ProxyScheme = Literal["http", "socks5", "socks5h"]
_DEFAULT_PORTS: dict[str, int] = {"http": 80, "socks5": 1080, "socks5h": 1080}


@dataclass(frozen=True)
class ProxyURL:
    """A forward proxy: HTTP CONNECT (`http`) or SOCKS5 (`socks5`, `socks5h`: both let
    the proxy resolve the server's name, as Go's SOCKS5 dialer does), with optional
    credentials (Basic for HTTP, username/password for SOCKS5)."""

    scheme: ProxyScheme
    host: str
    port: int
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        """The URL with its password replaced: what logs and status show."""
        user = ""
        if self.username is not None:
            user = urllib.parse.quote(self.username, safe="")
            user += f":{REDACTED}@" if self.password is not None else "@"
        return f"{self.scheme}://{user}{self.address}"

    def __repr__(self) -> str:
        return f"ProxyURL({self})"


def parse_proxy_url(text: str, *, source: str | None = None) -> ProxyURL:
    """`http://[user:password@]host[:port]`, `socks5://...`, `socks5h://...`; no scheme
    means http://. Raises ValueError (naming `source`, e.g. the variable, if given), never
    echoing the URL: it may hold a password."""
    try:
        return _parse_proxy_url(text)
    except ValueError as exc:
        if source is None:
            raise
        raise ValueError(f"{source}: {exc}") from None


def _parse_proxy_url(text: str) -> ProxyURL:
    text = text.strip()
    if not text:
        raise ValueError("empty proxy URL")
    if "://" not in text:
        text = f"http://{text}"
    try:
        parts = urllib.parse.urlsplit(text)
        port = parts.port
    except ValueError:
        raise ValueError("not a valid proxy URL (expected "
                         "http://[user:password@]host:port or socks5://...)") from None
    scheme = parts.scheme.lower()
    if scheme == "https":
        raise ValueError("TLS to the proxy (https://) is not supported; use "
                         "http:// (the tunnel's own TLS runs inside the proxy's stream)")
    if scheme not in _DEFAULT_PORTS:
        raise ValueError(f"unsupported proxy scheme {parts.scheme!r}; "
                         f"use http://, socks5:// or socks5h://")
    host = parts.hostname
    if not host:
        raise ValueError("the proxy URL has no host")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError("a proxy URL takes no path, query or fragment")
    username = urllib.parse.unquote(parts.username) if parts.username is not None else None
    password = urllib.parse.unquote(parts.password) if parts.password is not None else None
    if scheme != "http" and username is not None and (
            len(username.encode()) > 255 or len((password or "").encode()) > 255):
        raise ValueError("SOCKS5 user names and passwords are at most 255 bytes")
    if scheme != "http" and username is not None and password is None:
        raise ValueError("SOCKS5 authentication needs user:password")
    proxy_scheme: ProxyScheme = "http" if scheme == "http" else (
        "socks5" if scheme == "socks5" else "socks5h")
    return ProxyURL(proxy_scheme, host, port if port is not None else _DEFAULT_PORTS[scheme],
                    username, password)


@dataclass(frozen=True)
class _NoProxy:
    """NO_PROXY, parsed once: what is dialed directly."""

    everything: bool = False
    networks: tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str], ...] = ()
    # (suffix with its leading dot, port or "", whether the bare name matches too)
    domains: tuple[tuple[str, str, bool], ...] = ()

    @classmethod
    def parse(cls, value: str) -> _NoProxy:
        networks: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str]] = []
        domains: list[tuple[str, str, bool]] = []
        for raw in value.split(","):
            entry = raw.strip().lower()
            if not entry:
                continue
            if entry == "*":
                return cls(everything=True)
            try:  # a CIDR (no port), as Go reads it
                if "/" in entry:
                    networks.append((ipaddress.ip_network(entry, strict=False), ""))
                    continue
            except ValueError:
                continue  # best effort, as Go: a malformed entry is ignored
            host, port = _split_host_port(entry)
            try:
                address = ipaddress.ip_address(host)
            except ValueError:
                pass
            else:
                networks.append((ipaddress.ip_network(address), port))
                continue
            if host.startswith("*."):
                host = host[1:]
            if not host.strip("."):
                continue
            bare = not host.startswith(".")
            domains.append((host if not bare else f".{host}", port, bare))
        return cls(networks=tuple(networks), domains=tuple(domains))

    def matches(self, host: str, port: int) -> bool:
        if self.everything:
            return True
        host = host.lower().rstrip(".")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            address = None
        if address is not None:
            return any(address in net and want in ("", str(port))
                       for net, want in self.networks)
        return any((host.endswith(suffix) or (bare and host == suffix[1:]))
                   and want in ("", str(port)) for suffix, want, bare in self.domains)


def _split_host_port(entry: str) -> tuple[str, str]:
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, rest[1:] if rest.startswith(":") else ""
    if entry.count(":") == 1:
        host, _, port = entry.partition(":")
        return host, port
    return entry, ""


def _never_proxied(host: str) -> bool:
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ProxyRules:
    """Which proxy each server address is dialed through (None: directly).

    `explicit` (a config field) applies to every address; otherwise `https` serves TLS
    endpoints (tls://, wss://), `http` the plain ones (tcp://, ws://), minus what
    `no_proxy` lists and loopback."""

    explicit: ProxyURL | None = None
    https: ProxyURL | None = None
    http: ProxyURL | None = None
    no_proxy: _NoProxy = _NoProxy()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> ProxyRules:
        """The rules the variables in `environ` (default os.environ) give; ValueError
        naming the variable if one holds an invalid proxy URL."""
        env = os.environ if environ is None else environ

        def first(*names: str) -> tuple[str, str] | None:
            for name in names:
                value = env.get(name, "").strip()
                if value:
                    return name, value
            return None

        proxies: dict[str, ProxyURL | None] = {}
        for kind, names in (("https", ("HTTPS_PROXY", "https_proxy")),
                            ("http", ("HTTP_PROXY", "http_proxy"))):
            found = first(*names)
            proxies[kind] = (parse_proxy_url(found[1], source=found[0])
                             if found is not None else None)
        no_proxy = first("NO_PROXY", "no_proxy")
        return cls(https=proxies["https"], http=proxies["http"],
                   no_proxy=_NoProxy.parse(no_proxy[1]) if no_proxy else _NoProxy())

    def for_endpoint(self, endpoint: Endpoint) -> ProxyURL | None:
        if self.explicit is not None:
            return self.explicit
        proxy = self.https if endpoint.uses_tls else self.http
        if proxy is None or _never_proxied(endpoint.host):
            return None
        if self.no_proxy.matches(endpoint.host, endpoint.port):
            return None
        return proxy

    def describe(self) -> str:
        """One phrase for logs and --check: what dials through what (passwords redacted)."""
        if self.explicit is not None:
            return f"proxy {self.explicit}"
        parts = [f"{name} {proxy}" for name, proxy in
                 (("HTTPS_PROXY", self.https), ("HTTP_PROXY", self.http)) if proxy]
        return ", ".join(parts) if parts else "direct"


DIRECT = ProxyRules()
