"""The one TCP dialer, for the real targets of streams: node-local services (agent) and direct
backends (server). Failures become the tunnel's refusal reasons, so the opener learns
whether the target refused, was unreachable or timed out (502 vs 504 at the HTTP front).
"""

from __future__ import annotations

import errno
import socket

import trio

from tunnel.errors import StreamFailed
from tunnel.protocol import StreamReason

_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EADDRNOTAVAIL, errno.ENETDOWN,
                errno.EHOSTDOWN}


class DialFailed(StreamFailed):
    """Connecting to the target failed: refused, unreachable or timed out."""


async def connect_tcp(host: str, port: int, *, connect_timeout: float,
                      mark: int | None = None) -> trio.SocketStream:
    """Connect to host:port (trying each resolved address in turn) within `connect_timeout`.

    `mark` sets SO_MARK before connecting: the agent's netfilter rules skip that mark,
    so its own upstream connections are never intercepted (no uid-based tricks).
    """
    with trio.move_on_after(connect_timeout) as scope:
        try:
            infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise DialFailed(StreamReason.UNREACHABLE,
                             f"cannot resolve {host}: {exc.strerror}") from None
        last: DialFailed | None = None
        for family, type_, proto, _, address in infos:
            sock = trio.socket.socket(family, type_, proto)
            try:
                if mark is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_MARK, mark)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await sock.connect(address)
            except ConnectionRefusedError:
                sock.close()
                last = DialFailed(StreamReason.REFUSED, f"{host}:{port} refused the connection")
                continue
            except OSError as exc:
                sock.close()
                reason = (StreamReason.UNREACHABLE if exc.errno in _UNREACHABLE
                          else StreamReason.REFUSED)
                last = DialFailed(reason, f"{host}:{port}: {exc.strerror or exc}")
                continue
            except BaseException:
                sock.close()
                raise
            return trio.SocketStream(sock)
        assert last is not None
        raise last
    assert scope.cancelled_caught
    raise DialFailed(StreamReason.TIMEOUT, f"connecting to {host}:{port} timed out "
                     f"after {connect_timeout:g}s")
