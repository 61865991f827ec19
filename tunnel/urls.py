"""Endpoint URLs: what `tls://`, `tcp://`, `wss://` and `ws://` addresses mean, for
dialing (dial.py) and accepting (accept.py) alike, and which WebSocket implementation
"auto" picks.
"""

from __future__ import annotations

import ipaddress
import urllib.parse

# base, not the package: config validation reads URLs without importing trio or ssl.
from tunnel.transports.base import WEBSOCKET_IMPLS, Endpoint, WebSocketImpl

__all__ = [
    "DEFAULT_WEBSOCKET_IMPL",
    "as_endpoint",
    "choose_websocket_impl",
    "parse_endpoint",
]

# websockets' core masks in C, wsproto in pure Python: uploads (client → server, what
# agents mostly do) are about twice as fast, downloads about even
# (`python -m scripts.bench.websocket_transports`).
DEFAULT_WEBSOCKET_IMPL: WebSocketImpl = "websockets"

_SCHEMES = ("tls", "tcp", "wss", "ws")
_DEFAULT_PORTS = {"tls": 443, "wss": 443, "ws": 80}


def parse_endpoint(url: str) -> Endpoint:
    """`tls://host:port`, `tcp://host:port`, `wss://host[:port]/path`, `ws://...`.

    IPv6 literals go in brackets. Default ports: 443 for tls and wss, 80 for ws; tcp needs
    one. Raises ValueError saying what is wrong."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("endpoint URL is empty; expected e.g. tls://tunnel.example.com:443")
    url = url.strip()
    if "://" not in url:
        raise ValueError(f"{url!r}: missing scheme; expected tls://, tcp://, wss:// or ws://")
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        if "[" in url:
            raise ValueError(f"{url!r}: the address in brackets is not an IPv6 address "
                             f"({exc})") from None
        raise ValueError(f"{url!r}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"{url!r}: unsupported scheme {parts.scheme!r}; "
                         "use tls://, tcp://, wss:// or ws://")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{url!r}: credentials in the URL are not supported; "
                         "use a token or a client certificate")
    if parts.fragment:
        raise ValueError(f"{url!r}: a fragment (#...) has no meaning here")
    netloc = parts.netloc
    host = parts.hostname
    if netloc.count(":") > 1 and not netloc.startswith("["):
        raise ValueError(f"{url!r}: put IPv6 addresses in brackets, e.g. "
                         f"{scheme}://[::1]:443")
    if not host:
        raise ValueError(f"{url!r}: no host")
    if netloc.startswith("["):
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise ValueError(f"{url!r}: {host!r} in brackets is not an IPv6 address") from None
    elif host.count(":") or not _valid_hostname(host):
        hint = "; put IPv6 addresses in brackets: [::1]" if ":" in host else ""
        raise ValueError(f"{url!r}: invalid host {host!r}{hint}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{url!r}: invalid port; expected a number in 0-65535") from None
    if port is None:
        if scheme not in _DEFAULT_PORTS:
            raise ValueError(f"{url!r}: tcp:// needs a port, e.g. tcp://{netloc}:7000")
        port = _DEFAULT_PORTS[scheme]
    path = parts.path or "/"
    if scheme in ("tls", "tcp"):
        if path != "/" or parts.query:
            raise ValueError(f"{url!r}: {scheme}:// endpoints take no path or query")
        path = "/"
    elif parts.query:
        path = f"{path}?{parts.query}"
    return Endpoint(scheme=scheme, host=host, port=port, path=path)


def _valid_hostname(host: str) -> bool:
    if len(host) > 253:
        return False
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789-._")
    return all(label and set(label.lower()) <= allowed
               for label in host.rstrip(".").split("."))


def choose_websocket_impl(choice: str) -> WebSocketImpl:
    """"auto" (the default implementation) or one of WEBSOCKET_IMPLS; ValueError otherwise."""
    if choice == "auto":
        return DEFAULT_WEBSOCKET_IMPL
    for impl in WEBSOCKET_IMPLS:
        if choice == impl:
            return impl
    raise ValueError(f"unknown websocket_impl {choice!r}; "
                     f"use 'auto' or one of {', '.join(WEBSOCKET_IMPLS)}")


def as_endpoint(endpoint: Endpoint | str) -> Endpoint:
    """An Endpoint as it is, a URL parsed (parse_endpoint)."""
    return parse_endpoint(endpoint) if isinstance(endpoint, str) else endpoint
