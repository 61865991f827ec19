"""Proxy handshakes without I/O: bytes in, bytes out, a result or a `ProxyError`.

`HttpConnectHandshake` sends `CONNECT host:port` (with `Proxy-Authorization: Basic` when
the URL has credentials) and reads the proxy's answer with h11; `Socks5Handshake` speaks
RFC 1928/1929 with socksio's message codecs. socksio parses whole messages only, so this
module says how many bytes complete the next one (the sizes RFC 1928 fixes) and feeds it
exactly those. The caller (tunnel.dial) sends `data_to_send()`, feeds what it reads to
`receive_data()` until `done`, then starts TLS on the same socket.

Errors carry a `reason` a dialer can act on: `proxy_auth` (the proxy refused or wants
credentials: fix the URL, retrying will not help), `unavailable`/`unreachable`/`refused`
(the proxy is fine but could not reach the server: retry soon), `proxy` (it refused for
another reason, or is not the kind of proxy the URL says).
"""

from __future__ import annotations

import abc
import base64

import h11
from socksio import ProtocolError as SocksProtocolError
from socksio import socks5

from tunnel.proxy.url import ProxyURL

__all__ = [
    "MAX_RESPONSE_HEAD",
    "HttpConnectHandshake",
    "ProxyError",
    "ProxyHandshake",
    "Socks5Handshake",
    "handshake_for",
]

# Largest CONNECT response head accepted: a proxy's answer is a few hundred bytes.
MAX_RESPONSE_HEAD = 16 * 1024


class ProxyError(Exception):
    """The proxy did not open the stream; `reason` as in the module docstring, `status`
    the HTTP status (CONNECT) or SOCKS5 reply code, if any."""

    def __init__(self, message: str, reason: str, status: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


class ProxyHandshake(abc.ABC):
    """Ask a proxy for a byte stream to (host, port)."""

    def __init__(self, proxy: ProxyURL, host: str, port: int) -> None:
        self.proxy = proxy
        self.host = host
        self.port = port
        self.done = False
        # Bytes the proxy sent after its answer (none from a proxy that waits for the
        # client to speak first, as TLS does).
        self.leftover = b""

    @property
    def target(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @abc.abstractmethod
    def data_to_send(self) -> bytes:
        """Bytes for the proxy (empty: nothing now)."""

    @abc.abstractmethod
    def receive_data(self, data: bytes) -> None:
        """Bytes from the proxy; b"" is its end of stream. Sets `done` when the stream to
        the target is open; raises ProxyError when it will not be."""

    def _closed(self) -> ProxyError:
        return ProxyError(f"proxy {self.proxy} closed the connection before opening a "
                          f"stream to {self.target}", "proxy")


def _printable(text: str, limit: int = 80) -> str:
    """A proxy-supplied phrase, safe for a log line."""
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[:limit] + "..."


class HttpConnectHandshake(ProxyHandshake):
    """HTTP CONNECT (RFC 9110 §9.3.6), the response read by h11."""

    def __init__(self, proxy: ProxyURL, host: str, port: int) -> None:
        super().__init__(proxy, host, port)
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_RESPONSE_HEAD)
        headers = [("Host", self.target), ("User-Agent", "nodeagent")]
        if proxy.username is not None:
            pair = f"{proxy.username}:{proxy.password or ''}".encode()
            headers.append(("Proxy-Authorization",
                            "Basic " + base64.b64encode(pair).decode("ascii")))
        self._out = (self._h11.send(h11.Request(method="CONNECT", target=self.target,
                                                headers=headers))
                     + (self._h11.send(h11.EndOfMessage()) or b""))

    def data_to_send(self) -> bytes:
        out, self._out = self._out, b""
        return out

    def receive_data(self, data: bytes) -> None:
        if self.done:
            raise RuntimeError("the handshake is done")
        if not data:
            raise self._closed()
        self._h11.receive_data(data)
        while True:
            try:
                event = self._h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise ProxyError(f"proxy {self.proxy} did not answer CONNECT in HTTP: "
                                 f"{_printable(str(exc))}", "proxy") from None
            if event is h11.NEED_DATA:
                return
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                self._answered(event)
                continue
            if event is h11.PAUSED:  # the 2xx switched the connection to the tunnel
                self.leftover = bytes(self._h11.trailing_data[0])
                self.done = True
                return
            # A body after a 2xx cannot happen (h11 pauses); anything else is a bug here.
            raise ProxyError(f"proxy {self.proxy}: unexpected {type(event).__name__} in "
                             f"its CONNECT response", "proxy")

    def _answered(self, response: h11.Response) -> None:
        status = response.status_code
        if 200 <= status < 300:
            return  # PAUSED follows
        phrase = _printable(response.reason.decode("latin-1")) if response.reason else ""
        said = f"{status} {phrase}".strip()
        where = f"proxy {self.proxy}"
        # 407 is the standard answer; some proxies (tinyproxy, for CONNECT) say 401. Either
        # way it is the proxy's: a CONNECT has not reached the server yet.
        if status in (401, 407):
            hint = ("the credentials in the proxy URL were refused" if self.proxy.username
                    else "it wants credentials: put user:password in the proxy URL")
            raise ProxyError(f"{where} refused CONNECT {self.target} ({said}): {hint}",
                             "proxy_auth", status)
        if status in (502, 503, 504):
            raise ProxyError(f"{where} could not reach {self.target} ({said})",
                             "unavailable", status)
        raise ProxyError(f"{where} refused CONNECT {self.target} ({said})", "proxy", status)


_SOCKS_REPLIES: dict[socks5.SOCKS5ReplyCode, tuple[str, str]] = {
    socks5.SOCKS5ReplyCode.GENERAL_SERVER_FAILURE: ("general SOCKS server failure", "proxy"),
    socks5.SOCKS5ReplyCode.CONNECTION_NOT_ALLOWED_BY_RULESET: (
        "connection not allowed by its rules", "proxy"),
    socks5.SOCKS5ReplyCode.NETWORK_UNREACHABLE: ("network unreachable", "unreachable"),
    socks5.SOCKS5ReplyCode.HOST_UNREACHABLE: ("host unreachable", "unreachable"),
    socks5.SOCKS5ReplyCode.CONNECTION_REFUSED: ("connection refused", "refused"),
    socks5.SOCKS5ReplyCode.TTL_EXPIRED: ("TTL expired", "unreachable"),
    socks5.SOCKS5ReplyCode.COMMAND_NOT_SUPPORTED: ("command not supported", "proxy"),
    socks5.SOCKS5ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED: ("address type not supported",
                                                        "proxy"),
}
_SOCKS_VERSION = 5
_ATYPE_SIZES = {1: 4, 4: 16}  # IPv4, IPv6 address bytes; 3 (a name) is length-prefixed


class Socks5Handshake(ProxyHandshake):
    """SOCKS5 CONNECT (RFC 1928) with no authentication or username/password (RFC 1929);
    the server's name goes to the proxy, which resolves it."""

    def __init__(self, proxy: ProxyURL, host: str, port: int) -> None:
        super().__init__(proxy, host, port)
        self._socks = socks5.SOCKS5Connection()
        methods = [socks5.SOCKS5AuthMethod.NO_AUTH_REQUIRED]
        if proxy.username is not None:
            methods.append(socks5.SOCKS5AuthMethod.USERNAME_PASSWORD)
        self._socks.send(socks5.SOCKS5AuthMethodsRequest(methods))
        self._buffer = bytearray()

    def data_to_send(self) -> bytes:
        return self._socks.data_to_send()

    def receive_data(self, data: bytes) -> None:
        if self.done:
            raise RuntimeError("the handshake is done")
        if not data:
            raise self._closed()
        self._buffer += data
        while not self.done:
            size = self._next_size()
            if size is None or len(self._buffer) < size:
                return
            message = bytes(self._buffer[:size])
            del self._buffer[:size]
            self._handle(message)
        self.leftover = bytes(self._buffer)

    def _next_size(self) -> int | None:
        """Bytes in the next message from the proxy; None: not known yet."""
        state = self._socks.state
        if state in (socks5.SOCKS5State.SERVER_AUTH_REPLY,
                     socks5.SOCKS5State.SERVER_VERIFY_USERNAME_PASSWORD):
            return 2
        # The CONNECT reply: VER REP RSV ATYP, the bound address, the port.
        if len(self._buffer) < 5:
            return None
        atype = self._buffer[3]
        if atype == 3:
            return 4 + 1 + self._buffer[4] + 2
        if atype in _ATYPE_SIZES:
            return 4 + _ATYPE_SIZES[atype] + 2
        raise self._not_socks5()

    def _not_socks5(self) -> ProxyError:
        return ProxyError(f"proxy {self.proxy} does not speak SOCKS5", "proxy")

    def _handle(self, message: bytes) -> None:
        state = self._socks.state
        if message[0] != (_SOCKS_VERSION if state != socks5.SOCKS5State.
                          SERVER_VERIFY_USERNAME_PASSWORD else 1):
            raise self._not_socks5()
        try:
            reply = self._socks.receive_data(message)
        except SocksProtocolError:
            raise self._not_socks5() from None
        if isinstance(reply, socks5.SOCKS5AuthReply):
            self._authenticate(reply.method)
        elif isinstance(reply, socks5.SOCKS5UsernamePasswordReply):
            if not reply.success:
                raise ProxyError(f"proxy {self.proxy} refused the user name and password",
                                 "proxy_auth")
            self._connect()
        else:
            self._connected(reply)

    def _authenticate(self, method: socks5.SOCKS5AuthMethod) -> None:
        if method is socks5.SOCKS5AuthMethod.NO_AUTH_REQUIRED:
            self._connect()
        elif (method is socks5.SOCKS5AuthMethod.USERNAME_PASSWORD
              and self.proxy.username is not None):
            self._socks.send(socks5.SOCKS5UsernamePasswordRequest(
                self.proxy.username.encode(), (self.proxy.password or "").encode()))
        elif self.proxy.username is None:
            raise ProxyError(f"proxy {self.proxy} wants authentication: put user:password "
                             f"in the proxy URL", "proxy_auth")
        else:
            raise ProxyError(f"proxy {self.proxy} accepts none of our authentication "
                             f"methods (none, username/password)", "proxy_auth")

    def _connect(self) -> None:
        self._socks.send(socks5.SOCKS5CommandRequest.from_address(
            socks5.SOCKS5Command.CONNECT, (self.host, self.port)))

    def _connected(self, reply: socks5.SOCKS5Reply) -> None:
        if reply.reply_code is socks5.SOCKS5ReplyCode.SUCCEEDED:
            self.done = True
            return
        said, reason = _SOCKS_REPLIES.get(reply.reply_code, ("refused", "proxy"))
        raise ProxyError(f"proxy {self.proxy} could not open {self.target}: {said}",
                         reason, reply.reply_code[0])


def handshake_for(proxy: ProxyURL, host: str, port: int) -> ProxyHandshake:
    """The handshake that asks `proxy` for a stream to (host, port)."""
    if proxy.scheme == "http":
        return HttpConnectHandshake(proxy, host, port)
    return Socks5Handshake(proxy, host, port)
