"""The client of the controller's config watch stream (nodeagent/controller/configserver.py).

`watch_config` keeps one watch open: it sends the GET over a byte stream that `open_stream`
provides (an agent opens a tunnel stream to the controller; a server a TCP connection),
reads ndjson lines with h11, validates each config with the one config model and hands it
to `apply`. It reconnects with jittered backoff and resumes from the last version it
applied. A config that fails to apply is logged once and not retried until a newer
version arrives; the process keeps running its previous config.

With `tls` (a callable giving the client context at each connect, so a renewed certificate
is used from the next one on) the watch runs TLS over that stream itself, verifying the
controller for `host` and presenting the client certificate the controller authorizes by:
end to end even through an agent's tunnel. Without it the watch is plain HTTP (tests).
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import h11
import trio
from pydantic import BaseModel

from nodeagent.config import ConfigError, controller_url_address, parse_config
from nodeagent.configstream.protocol import (
    HEARTBEAT_HEADER,
    MAX_LINE,
    LineError,
    parse_config_line,
    parse_line,
)
from nodeagent.ops.logs import StructuredLogger, get_logger
from nodeagent.trust import tlscontext
from tunnel.backoff import Backoff
from tunnel.transports.tls import TLSStream

M = TypeVar("M", bound=BaseModel)
HANDSHAKE_TIMEOUT = 20.0  # seconds for the TLS handshake with the controller
UNREACHABLE_MAXIMUM = 1.0  # seconds between attempts while the controller is unreachable


@dataclass
class WatchStatus:
    url: str
    state: str = "starting"  # starting | connecting | watching | backoff
    applied_version: int = -1
    received_version: int = -1
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"controller": self.url, "state": self.state,
                "config_version": self.applied_version,
                "received_version": self.received_version, "last_error": self.last_error}


class WatchError(Exception):
    """The watch failed (HTTP status, bad line, connection): reconnect after a backoff."""


async def watch_config(
    *, open_stream: Callable[[], Awaitable[trio.abc.Stream]], host: str, path: str,
    model: type[M], apply: Callable[[M], Awaitable[None]], status: WatchStatus,
    token: Callable[[], str] | None = None, tls: Callable[[], ssl.SSLContext] | None = None,
    backoff: Backoff | None = None, idle_timeout: float = 45.0,
    log: StructuredLogger | None = None, running: dict[str, Any] | None = None,
) -> None:
    """Run until cancelled. `idle_timeout`: no line (not even a heartbeat) for this long means
    the watch is dead; once the controller announces its heartbeat interval
    (`x-nodeagent-heartbeat`), three of them instead. `running`: the config already in force
    (a server's persisted routes, JSON): not applied again if the controller sends the same.

    Static stability: while the controller is unreachable the running config stays in
    force, however long. Each (re)connect asks for the current config (after=-1) and
    applies it if its content differs from the running one, whatever its version: a
    restarted controller numbers its versions from 1 again, and a change made while it
    was away must still arrive."""
    log = log or get_logger("nodeagent.configstream.client")
    backoff = backoff or Backoff(initial=0.2, maximum=10.0)
    # A controller we cannot reach (connection refused, no route, the tunnel's stream to
    # it refused) spent nothing on us: retry within a second, so a watch is back within
    # ~1 s of the controller's return however long it was away (tunnel/backoff.py says
    # the same of the tunnel's own dials). A controller that answered and failed us
    # (TLS, HTTP status, a bad line) backs off to `backoff`'s maximum.
    unreachable = Backoff(initial=min(backoff.initial, UNREACHABLE_MAXIMUM),
                          maximum=UNREACHABLE_MAXIMUM)
    async with trio.open_nursery() as nursery:
        silence = _Silence(idle_timeout)
        nursery.start_soon(silence.guard)
        await _watch(open_stream=open_stream, host=host, path=path, model=model,
                     apply=apply, status=status, token=token, tls=tls, backoff=backoff,
                     unreachable=unreachable, silence=silence, log=log, running=running)
        raise AssertionError("unreachable")  # pragma: no cover


class _Silence:
    """Ends a connection on which the controller sent nothing for `timeout` seconds while
    the watch waited for it (`waiting` to `heard`): one task per watch, `guard`, looks
    at the time once per timeout. A timeout per receive cost every line a cancel scope
    and a deadline in trio's heap; at a fan-out that is every watch's line at once
    (`python -m scripts.bench.config_fanout`, profiled in the watchers)."""

    def __init__(self, timeout: float) -> None:
        self.default = timeout  # until the controller announces its heartbeat
        self.timeout = timeout
        self.since: float | None = None  # when the current wait for bytes began
        self.scope = trio.CancelScope()  # the current connection's reading
        self.expired = False

    def connection(self) -> trio.CancelScope:
        """A new connection's scope, for `guard` to cancel."""
        self.timeout, self.since, self.expired = self.default, None, False
        self.scope = trio.CancelScope()
        return self.scope

    def waiting(self) -> None:
        self.since = trio.current_time()

    def heard(self) -> None:
        self.since = None

    async def guard(self) -> None:
        while True:
            since = self.since
            if since is None:  # not waiting for bytes (connecting, applying): later
                await trio.sleep(self.timeout)
            elif trio.current_time() >= since + self.timeout:
                self.since, self.expired = None, True
                self.scope.cancel()
            else:
                await trio.sleep_until(since + self.timeout)


async def _watch(
    *, open_stream: Callable[[], Awaitable[trio.abc.Stream]], host: str, path: str,
    model: type[M], apply: Callable[[M], Awaitable[None]], status: WatchStatus,
    token: Callable[[], str] | None, tls: Callable[[], ssl.SSLContext] | None,
    backoff: Backoff, unreachable: Backoff, silence: _Silence, log: StructuredLogger,
    running: dict[str, Any] | None,
) -> None:
    failed_version = -1
    # The running config's line, parsed again only to compare with a reconnect's first
    # line (keeping the line, not its parsed document: the servers' holds 10,000 routes).
    running_line: bytes | None = None
    while True:
        status.state = "connecting"
        try:
            stream: trio.abc.Stream = await open_stream()
            if tls is not None:
                # The tunnel's TLSStream: it hands over every record a read brought in
                # one receive_some (trio.SSLStream hands over one 16 KiB record per
                # call, which made a fan-out's large configs CPU-bound in the watchers:
                # python -m scripts.bench.config_propagation measures it).
                stream = TLSStream(stream, tls(), server_hostname=host)
        except Exception as exc:  # any reason the controller is unreachable right now
            await _pause(status, unreachable, log, f"cannot reach the controller: {exc}")
            continue
        try:
            async with stream:
                if isinstance(stream, TLSStream):
                    with trio.move_on_after(HANDSHAKE_TIMEOUT) as handshake:
                        await stream.do_handshake()
                    if handshake.cancelled_caught:
                        raise WatchError(f"no TLS handshake with the controller within "
                                         f"{HANDSHAKE_TIMEOUT:g}s")
                conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_LINE)
                after = -1  # the current config at once (see the docstring)
                first = True
                headers = [("host", host), ("accept", "application/x-ndjson")]
                if token is not None:
                    headers.append(("authorization", f"Bearer {token()}"))
                request = h11.Request(method="GET", target=f"{path}?after={after}",
                                      headers=headers)
                await stream.send_all(conn.send(request) + conn.send(h11.EndOfMessage()))
                with silence.connection():
                    async for line in _lines(conn, stream, silence):
                        status.state = "watching"
                        backoff.reset()
                        unreachable.reset()
                        # A valid config line is validated from its bytes at once; anything
                        # else (a heartbeat, a bad line or config) is read as a document,
                        # which says what is wrong with it.
                        valid = parse_config_line(line, model)
                        doc: dict[str, Any] = {}
                        if valid is None:
                            doc = _document(line)
                            if not doc:
                                continue  # heartbeat
                            version = doc.get("version")
                            if not isinstance(version, int):
                                raise WatchError(f"line without a version: {str(doc)[:200]}")
                        else:
                            version = valid[0]
                        status.received_version = version
                        fresh, first = first, False
                        if fresh and (running is not None or running_line is not None):
                            if running_line is not None:
                                running = _document(running_line).get("config")
                                running_line = None
                            if (doc or _document(line)).get("config") == running:
                                status.applied_version = version  # the same content renumbered
                                continue
                        if not fresh and (version <= status.applied_version
                                          or version == failed_version):
                            continue
                        try:
                            if valid is not None:
                                config = valid[1]
                            else:
                                config = parse_config(model, doc.get("config"),
                                                      f"controller {path}")
                                config = config.model_copy(update={"version": version})
                            await apply(config)
                            running, running_line = None, line
                        except Exception as exc:
                            failed_version = version
                            status.last_error = str(exc)
                            log.error("config from the controller not applied; keeping the "
                                      "running config", version=version, error=str(exc),
                                      kind=type(exc).__name__)
                            continue
                        status.applied_version = version
                        status.last_error = None
                        log.info("config applied", version=version)
                if silence.expired:
                    raise WatchError(f"nothing from the controller for "
                                     f"{silence.timeout:g}s")
        except (WatchError, ConfigError, h11.ProtocolError, trio.BrokenResourceError,
                trio.ClosedResourceError, OSError, ssl.SSLError) as exc:
            await _pause(status, backoff, log, _describe(exc))
            continue
        await _pause(status, backoff, log, "the controller ended the watch")


def _describe(exc: BaseException) -> str:
    """One line for the log and the debug socket. trio wraps TLS failures (a controller
    certificate that does not verify: a server in the middle) in a BrokenResourceError
    with no message of its own: say what is underneath."""
    parts: list[str] = []
    seen: BaseException | None = exc
    while seen is not None and len(parts) < 3:
        text = str(seen).strip()
        if text and text not in parts:
            parts.append(text if not isinstance(seen, ssl.SSLError)
                         else f"TLS: {text}")
        seen = seen.__cause__ or seen.__context__
    return ": ".join(parts) or type(exc).__name__


async def _pause(status: WatchStatus, backoff: Backoff, log: StructuredLogger,
                 reason: str) -> None:
    status.state = "backoff"
    status.last_error = reason
    delay = backoff.next_delay()
    log.warning("config watch interrupted; retrying", reason=reason, delay=f"{delay:.2f}s")
    await trio.sleep(delay)


def _document(line: bytes) -> dict[str, Any]:
    try:
        return parse_line(line)
    except LineError as exc:
        raise WatchError(str(exc)) from None


async def _lines(conn: h11.Connection, stream: trio.abc.Stream, silence: _Silence
                 ) -> AsyncIterator[bytes]:
    """The response body's lines, without their newline. `silence` times each wait for
    bytes (its guard cancels the connection's scope)."""
    buffer = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            silence.waiting()
            data = await stream.receive_some(65536)
            silence.heard()
            conn.receive_data(bytes(data))
            continue
        if isinstance(event, h11.Response):
            if event.status_code != 200:
                body = await _body(conn, stream)
                raise WatchError(f"controller answered {event.status_code}: {body.strip()}")
            silence.timeout = announced_idle_timeout(event.headers, silence.timeout)
            continue
        if isinstance(event, h11.Data):
            buffer += bytes(event.data)
            if len(buffer) > MAX_LINE:
                raise WatchError("a config line exceeds the size limit")
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                yield line
            continue
        if isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
            return


def announced_idle_timeout(headers: Iterable[tuple[bytes, bytes]], default: float) -> float:
    """Three heartbeat intervals, as the controller announces them; `default` when it
    does not (an older one sends every 15 s) or says something out of bounds."""
    for name, value in headers:
        if name.lower() == HEARTBEAT_HEADER:
            try:
                heartbeat = float(value)
            except ValueError:
                return default
            return 3 * heartbeat if 0 < heartbeat <= 600 else default
    return default


async def _body(conn: h11.Connection, stream: trio.abc.Stream) -> str:
    out = b""
    with trio.move_on_after(5):
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(bytes(await stream.receive_some(65536)))
                continue
            if isinstance(event, h11.Data):
                out += bytes(event.data)
                continue
            break
    return out.decode(errors="replace")[:300]


def controller_address(url: str) -> tuple[str, int]:
    """(host, port) of `https://host:port` (the controller's TLS stream) or, in tests,
    `http://host:port`."""
    try:
        return controller_url_address(url)
    except ValueError as exc:
        raise ConfigError(f"--controller {exc}") from None


def token_reader(path: Path) -> Callable[[], str]:
    """Reads the token file at each (re)connect: a rotated Secret takes effect."""
    def read() -> str:
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {path}: {exc.strerror}") from None
    read()  # fail at start, not at the first watch
    return read


def read_ca_file(path: Path) -> bytes:
    """The cluster CA bundle given as --ca-file, checked to hold certificates; a
    ConfigError naming the flag otherwise."""
    try:
        ca_pem = path.read_bytes()
        tlscontext.ca_text(ca_pem)  # ssl alone: no cryptography on an agent's path
    except (OSError, ValueError) as exc:
        raise ConfigError(f"flags: --ca-file: {path}: {exc}") from None
    return ca_pem


class PostError(Exception):
    """A report to the controller failed (unreachable, TLS, HTTP): the caller retries."""


async def post_json(*, open_stream: Callable[[], Awaitable[trio.abc.Stream]], host: str,
                    path: str, body: bytes, tls: ssl.SSLContext | None,
                    answer_within: float = 10.0) -> tuple[int, dict[str, Any]]:
    """One POST to the controller on a connection of its own (a watch occupies the other):
    (status, the JSON object answered). PostError for anything that is not an answer."""
    try:
        with trio.fail_after(answer_within):
            stream: trio.abc.Stream = await open_stream()
            if tls is not None:
                stream = TLSStream(stream, tls, server_hostname=host)
            async with stream:
                if isinstance(stream, TLSStream):
                    await stream.do_handshake()
                conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_LINE)
                request = h11.Request(method="POST", target=path, headers=[
                    ("host", host), ("content-type", "application/json"),
                    ("content-length", str(len(body))), ("connection", "close")])
                await stream.send_all(conn.send(request) + conn.send(h11.Data(data=body))
                                      + conn.send(h11.EndOfMessage()))
                status = 0
                data = b""
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(bytes(await stream.receive_some(65536)))
                    elif isinstance(event, h11.Response):
                        status = event.status_code
                    elif isinstance(event, h11.Data):
                        data += bytes(event.data)
                        if len(data) > 65536:
                            raise PostError("the controller's answer is too long")
                    else:
                        break
    except PostError:
        raise
    except trio.TooSlowError:
        raise PostError(f"no answer from the controller within {answer_within:g}s") from None
    except (h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError,
            ssl.SSLError) as exc:
        raise PostError(_describe(exc)) from None
    except Exception as exc:  # open_stream's own failure: the controller is unreachable
        raise PostError(f"cannot reach the controller: {exc}") from None
    try:
        doc = parse_line(data) if data.strip() else {}
    except LineError as exc:
        raise PostError(f"controller answered {status}: {exc}") from None
    return status, doc
