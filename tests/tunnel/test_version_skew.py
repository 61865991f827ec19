"""The version-skew policy of docs/kubernetes.md ("Upgrades and version skew"), where it
can be tested without two releases: what the tunnel's HELLO negotiates between an agent
and a server of neighbouring releases, that unknown features are ignored, and that a
config from a newer controller with fields an older agent or server does not know is
refused cleanly (the running config kept), which is why the controller upgrades last."""

from __future__ import annotations

import itertools

import pytest

from nodeagent import __version__
from nodeagent.config import ConfigError, NodeConfig, RoutesConfig, parse_config
from tunnel import protocol as p
from tunnel.protocol import Connection, ConnectionTerminated, Hello, Role
from tunnel.protocol.events import HandshakeCompleted, HelloReceived

# The tunnel protocol versions each release speaks (HELLO min_version..max_version). The
# policy: a release speaks the newest version of the release before it, so agents and
# servers one release apart always agree. Add a row when a release changes the range.
RELEASES: dict[str, tuple[int, int]] = {
    "0.1.0": (1, 1),
}


def test_this_release_is_in_the_table_with_its_range() -> None:
    assert RELEASES[__version__] == (p.MIN_VERSION, p.MAX_VERSION), (
        "tunnel/protocol/wire.py's range changed: add this release to RELEASES and keep "
        "the policy (docs/kubernetes.md)")


def test_each_release_speaks_the_newest_version_of_the_one_before() -> None:
    releases = list(RELEASES.values())
    for (_, previous_max), (minimum, maximum) in itertools.pairwise(releases):
        assert minimum <= previous_max <= maximum


def handshake(dialer_hello: Hello) -> tuple[list[p.Event], Connection, Connection]:
    """Today's acceptor (a server) answering `dialer_hello`; the dialer's events."""
    dialer, acceptor = Connection(Role.DIALER), Connection(Role.ACCEPTOR)
    dialer.start(dialer_hello)
    events = acceptor.receive_data(dialer.data_to_send())
    if any(isinstance(e, HelloReceived) for e in events):
        acceptor.accept_handshake(Hello())
    return dialer.receive_data(acceptor.data_to_send()), dialer, acceptor


def test_an_agent_of_the_next_release_connects_to_todays_server() -> None:
    events, dialer, acceptor = handshake(Hello(min_version=p.MAX_VERSION,
                                               max_version=p.MAX_VERSION + 1))
    assert [type(e) for e in events] == [HandshakeCompleted]
    assert dialer.version == acceptor.version == p.MAX_VERSION


def test_todays_agent_connects_to_a_server_of_the_next_release() -> None:
    """A newer server announces a wider range in its HELLO; today's dialer picks the
    newest version both speak."""
    dialer = Connection(Role.DIALER)
    dialer.start(Hello())
    newer = Hello(min_version=p.MAX_VERSION, max_version=p.MAX_VERSION + 1)
    acceptor = Connection(Role.ACCEPTOR)
    acceptor.receive_data(dialer.data_to_send())
    acceptor.accept_handshake(newer)
    framed = acceptor.data_to_send()
    (event,) = dialer.receive_data(framed)
    assert isinstance(event, HandshakeCompleted) and event.version == p.MAX_VERSION


def test_a_peer_two_versions_ahead_is_refused_with_a_clear_reason() -> None:
    events, _, _ = handshake(Hello(min_version=p.MAX_VERSION + 1,
                                   max_version=p.MAX_VERSION + 2))
    (event,) = events
    assert isinstance(event, ConnectionTerminated)
    assert event.code is p.ErrorCode.UNSUPPORTED_VERSION
    assert (f"peer speaks protocol versions {p.MAX_VERSION + 1}-{p.MAX_VERSION + 2}, this "
            f"side speaks {p.MIN_VERSION}-{p.MAX_VERSION}") in event.message


def test_features_a_side_does_not_know_are_ignored() -> None:
    events, _, _ = handshake(Hello(features=(p.FEATURE_RETRY_AFTER, "from-a-future-release")))
    assert [type(e) for e in events] == [HandshakeCompleted]


@pytest.mark.parametrize(("model", "path"), [
    (NodeConfig, "controller /v1/config/nodes/edge-1"),
    (RoutesConfig, "controller /v1/config/servers/s1"),
])
def test_a_newer_controllers_unknown_field_is_refused_in_one_line(model: type,
                                                                  path: str) -> None:
    """What an agent or server of the previous release does with a config carrying a
    field it does not know: a ConfigError (the watch logs it and keeps the running
    config), never a crash and never a silently half-applied config."""
    with pytest.raises(ConfigError) as info:
        parse_config(model, {"fieldFromANewerRelease": True}, path)
    assert str(info.value) == f"{path}: fieldFromANewerRelease: unknown field (typo?)"
