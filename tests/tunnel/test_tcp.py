"""tunnel.tcp.connect_tcp, the one TCP dialer: causes, reasons, marks, deadlines."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable

import pytest
import trio

from tunnel import protocol as p
from tunnel.tcp import (
    KEEPALIVE_COUNT,
    KEEPALIVE_IDLE,
    KEEPALIVE_INTERVAL,
    SO_MARK,
    DialFailed,
    connect_tcp,
)


async def test_connects_with_nodelay_keepalive_and_mark() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    mark = 0x4E41 if os.geteuid() == 0 else None
    stream = await connect_tcp("127.0.0.1", port, connect_timeout=5, mark=mark)
    sock = stream.socket
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == KEEPALIVE_INTERVAL
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE_COUNT
    if mark is not None:
        assert stream.socket.getsockopt(socket.SOL_SOCKET, SO_MARK) == mark
    await stream.aclose()
    await listeners[0].aclose()


async def test_refused_keeps_every_attempt() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    with pytest.raises(DialFailed) as info:
        await connect_tcp("127.0.0.1", port, connect_timeout=5)
    exc = info.value
    assert (exc.cause, exc.reason, exc.outcome) == ("refused", p.StreamReason.REFUSED, "refused")
    assert [address for address, _ in exc.attempts] == [f"127.0.0.1:{port}"]
    assert isinstance(exc.attempts[0][1], ConnectionRefusedError)


async def test_unresolvable_name_is_dns() -> None:
    with pytest.raises(DialFailed) as info:
        await connect_tcp("no-such-host.invalid", 80, connect_timeout=5)
    assert info.value.cause == "dns" and info.value.reason is p.StreamReason.UNREACHABLE
    assert "no-such-host.invalid" in info.value.message


async def test_deadline_is_timeout_and_none_leaves_it_to_the_caller() -> None:
    # A full listen backlog: SYNs to it go unanswered, so connect() hangs.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(0)
    port = sock.getsockname()[1]
    fillers = []
    try:
        for _ in range(8):
            filler = socket.socket()
            filler.setblocking(False)
            try:
                filler.connect(("127.0.0.1", port))
            except BlockingIOError:
                pass
            fillers.append(filler)
        with pytest.raises(DialFailed) as info:
            await connect_tcp("127.0.0.1", port, connect_timeout=0.3)
        assert info.value.cause == "timeout" and "0.3s" in info.value.message
        # connect_timeout=None: only the caller's cancel scope ends it, and it is not
        # turned into a DialFailed (the caller's deadline is the caller's to report).
        with trio.move_on_after(0.3) as scope:
            await connect_tcp("127.0.0.1", port, connect_timeout=None)
        assert scope.cancelled_caught
    finally:
        for filler in fillers:
            filler.close()
        sock.close()


NOBODY = 65534
CAP_NET_ADMIN = 12


def _holds_net_admin() -> bool:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_NET_ADMIN & 1)
    return False


def run_unprivileged(check: Callable[[], None]) -> None:
    """Run `check` as a user without CAP_NET_ADMIN. As root (CI), in a forked child that
    drops to nobody first (setresuid clears the capabilities; a fork needs no access to
    the interpreter's files, an exec would); its failure comes back as this test's."""
    if os.geteuid() != 0:
        if _holds_net_admin():
            pytest.skip("not root, yet holding CAP_NET_ADMIN: no user to drop to here")
        check()
        return
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setresgid(NOBODY, NOBODY, NOBODY)
            os.setresuid(NOBODY, NOBODY, NOBODY)
            assert not _holds_net_admin(), "dropping to nobody kept CAP_NET_ADMIN"
            check()
            status = 0
        except BaseException:
            os.write(write_end, traceback.format_exc().encode()[-4000:])
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        report = pipe.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"as user {NOBODY}:\n{report}"


def test_mark_without_privilege_is_a_clear_error() -> None:
    def check() -> None:
        async def dial_marked() -> None:
            with pytest.raises(DialFailed) as info:
                await connect_tcp("127.0.0.1", 9, connect_timeout=5, mark=1)
            assert info.value.cause == "mark" and "CAP_NET_ADMIN" in info.value.message

        trio.run(dial_marked)

    run_unprivileged(check)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
async def test_ip_literals_are_not_resolved(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_resolver(*args: object, **kwargs: object) -> None:
        raise AssertionError("getaddrinfo called for an IP literal")

    try:
        listeners = await trio.open_tcp_listeners(0, host=host)
    except OSError:
        pytest.skip(f"no {host} on this host")
    port = listeners[0].socket.getsockname()[1]
    monkeypatch.setattr(trio.socket, "getaddrinfo", no_resolver)
    stream = await connect_tcp(host, port, connect_timeout=5)
    assert stream.socket.getpeername()[:2] == (host, port)
    await stream.aclose()
    await listeners[0].aclose()
    with pytest.raises(AssertionError, match="getaddrinfo called"):
        await connect_tcp("localhost", port, connect_timeout=5)
