"""IdentityKeeper rides out every failure a peer can cause, however it arrives: bare or
wrapped in exception groups (a requester that holds its connection in a nursery, as the
agent's bootstrap connection does), and gives up only on what is not a peer's doing."""

from __future__ import annotations

import datetime as dt
import logging

import pytest
import trio

from nodeagent.trust import pki
from nodeagent.trust.enrollment import CertificateRefused, IdentityKeeper, IssuedIdentity


def _identity(key: pki.PrivateKey) -> IssuedIdentity:
    now = dt.datetime.now(dt.UTC)
    return IssuedIdentity(key=key, certificate_pem=b"", ca_pem=b"", not_before=now,
                          not_after=now + dt.timedelta(hours=1))


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, object]]] = []

    def __getattr__(self, level: str):  # type: ignore[no-untyped-def]
        return lambda message, **fields: self.lines.append((level, message, fields))


async def _nursery_wrapped(exc: Exception) -> None:
    # What an @asynccontextmanager that yields inside a nursery does to its body's error.
    async with trio.open_nursery():
        raise exc


@pytest.mark.parametrize("failure", [
    CertificateRefused(429, "rate_limited", "slow down"),
    CertificateRefused(401, "unauthenticated", "token rejected"),
    ConnectionResetError("reset by a rogue server"),
    trio.BrokenResourceError("TLS failure"),
])
async def test_a_failure_wrapped_in_a_nursery_is_retried(
        failure: Exception, autojump_clock: trio.testing.MockClock) -> None:
    attempts: list[int] = []

    async def request(key: pki.PrivateKey) -> IssuedIdentity:
        attempts.append(1)
        if len(attempts) < 3:
            await _nursery_wrapped(failure)
        return _identity(key)

    log = _Log()
    keeper = IdentityKeeper("node", request, log=log, retry_initial=0.5, retry_maximum=2.0)
    identity = await keeper.obtain()
    assert keeper.identity is identity and len(attempts) == 3
    assert keeper.failures == 2
    assert keeper.last_error is None  # cleared by the success
    warnings = [f for level, _, f in log.lines if level == "warning"]
    assert warnings and all(str(failure) in str(f) for f in warnings)


async def test_a_programming_error_is_not_retried_forever() -> None:
    async def request(key: pki.PrivateKey) -> IssuedIdentity:
        await _nursery_wrapped(TypeError("a bug, not a peer"))
        raise AssertionError("unreachable")

    keeper = IdentityKeeper("node", request, log=logging.getLogger("test"))
    with pytest.raises(BaseExceptionGroup):
        await keeper.obtain()


async def test_401_waits_the_maximum_before_the_next_attempt(
        autojump_clock: trio.testing.MockClock) -> None:
    times: list[float] = []

    async def request(key: pki.PrivateKey) -> IssuedIdentity:
        times.append(trio.current_time())
        if len(times) == 1:
            await _nursery_wrapped(CertificateRefused(401, "unauthenticated", "no"))
        return _identity(key)

    keeper = IdentityKeeper("node", request, log=_Log(), retry_initial=0.1,
                            retry_maximum=30.0)
    await keeper.obtain()
    assert times[1] - times[0] >= 15.0  # equal jitter: at least half the maximum
