"""free_port: ports the kernel does not hand out meanwhile (below its ephemeral range),
never one something listens on, never the same one twice in a process."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeagent.testing import standalone
from nodeagent.testing.standalone import free_port


def first_ephemeral() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_DGRAM])
def test_a_free_port_is_below_the_ephemeral_range_and_bindable(
        kind: socket.SocketKind) -> None:
    port = free_port(kind)
    assert standalone._LOWEST <= port < first_ephemeral()
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", port))


def test_a_port_in_use_or_already_given_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    busy, given, free = free_port(), free_port(), free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", busy))
        listener.listen()
        picks: Iterator[int] = iter([busy, given, free])
        monkeypatch.setattr(standalone.random, "randrange", lambda a, b: next(picks))
        standalone._given.discard((socket.SOCK_STREAM, free))
        assert free_port() == free


def test_a_port_in_time_wait_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    # The one a test's server closed a moment ago: a new process could bind it (it sets
    # SO_REUSEADDR) but a client's connections to the old one may still be around.
    port, free = free_port(), free_port()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", port))
        listener.listen()
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            accepted.close()  # this side closes first: it is the one in TIME_WAIT
    picks: Iterator[int] = iter([port, free])
    monkeypatch.setattr(standalone.random, "randrange", lambda a, b: next(picks))
    standalone._given.discard((socket.SOCK_STREAM, port))
    standalone._given.discard((socket.SOCK_STREAM, free))
    assert free_port() == free
