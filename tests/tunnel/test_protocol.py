"""The sans-IO protocol core, driven without sockets."""

from __future__ import annotations

import struct

import pytest

from tests.tunnel.pair import handshake, received_bytes
from tunnel import protocol as p
from tunnel.protocol import (
    FEATURE_RETRY_AFTER,
    FLAG_FIN,
    FLAG_RETRY_AFTER,
    HEADER,
    MAGIC,
    ConnectionDraining,
    ConnectionTerminated,
    DataReceived,
    ErrorCode,
    FlowControlBlocked,
    FrameType,
    GoAwayReceived,
    HandshakeCompleted,
    Hello,
    HelloReceived,
    LocalProtocolError,
    PingAcked,
    Role,
    Settings,
    StreamAccepted,
    StreamClosedError,
    StreamEnded,
    StreamLimitReached,
    StreamOpened,
    StreamReason,
    StreamRefused,
    StreamReset,
    Target,
    WindowUpdated,
)
from tunnel.protocol import Connection as Conn

T = Target("127.0.0.1", 8080)


def frame(ftype: int, stream_id: int, payload: bytes = b"", flags: int = 0) -> bytes:
    return HEADER.pack(len(payload) << 8 | ftype, flags, stream_id) + payload


def open_accepted(pair, opener="dialer"):  # type: ignore[no-untyped-def]
    a = getattr(pair, opener)
    b = pair.acceptor if opener == "dialer" else pair.dialer
    sid = a.open_stream(T, {"origin": "10.0.0.1:1234"})
    pair.pump()
    b.accept_stream(sid)
    pair.pump()
    return sid, a, b


def terminated(events):  # type: ignore[no-untyped-def]
    return [e for e in events if isinstance(e, ConnectionTerminated)]


# ------------------------------------------------------------------- handshake


def test_handshake_exchanges_identity_settings_and_version() -> None:
    d = Conn(Role.DIALER, Settings(max_streams=7))
    a = Conn(Role.ACCEPTOR)
    d.start(Hello(identity={"node": "edge-1", "token": "t"}, features=("udp",)))
    (ev,) = a.receive_data(d.data_to_send())
    assert isinstance(ev, HelloReceived)
    assert ev.hello.identity == {"node": "edge-1", "token": "t"}
    # The core adds the features it implements itself (DATAGRAM frames).
    assert ev.hello.features == ("udp", "datagram")
    assert ev.hello.settings.max_streams == 7
    assert not a.is_open  # the acceptor decides first
    a.accept_handshake(Hello(identity={"server": "s"}))
    (done,) = d.receive_data(a.data_to_send())
    assert isinstance(done, HandshakeCompleted) and done.version == 1
    assert a.remote_settings.max_streams == 7 and d.is_open and a.is_open


def test_acceptor_refuses_handshake_with_reason() -> None:
    d, a = Conn(Role.DIALER), Conn(Role.ACCEPTOR)
    d.start(Hello(identity={"node": "edge-1", "token": "wrong"}))
    a.receive_data(d.data_to_send())
    a.close(ErrorCode.UNAUTHORIZED, "token does not match node edge-1")
    (ev,) = d.receive_data(a.data_to_send())
    assert ev == ConnectionTerminated(ErrorCode.UNAUTHORIZED,
                                      "token does not match node edge-1", by_peer=True)
    assert d.is_closed


def test_overloaded_refusal_carries_retry_after_to_a_dialer_that_announces_it() -> None:
    d, a = Conn(Role.DIALER), Conn(Role.ACCEPTOR)
    d.start(Hello(identity={"node": "edge-1"}, features=(FEATURE_RETRY_AFTER,)))
    a.receive_data(d.data_to_send())
    a.refuse_handshake(ErrorCode.OVERLOADED, "admitting 200 handshakes/s", retry_after=2.345)
    assert a.is_closed
    wire = a.data_to_send()
    _, flags, _ = HEADER.unpack_from(wire)
    assert flags & FLAG_RETRY_AFTER
    (ev,) = d.receive_data(wire)
    assert ev == ConnectionTerminated(ErrorCode.OVERLOADED, "admitting 200 handshakes/s",
                                      by_peer=True, retry_after=2.345)
    assert d.is_closed


def test_retry_after_is_only_words_for_a_dialer_that_does_not_announce_it() -> None:
    """Backward compatible: a dialer without the feature (an older agent) ignores GOAWAY
    flags and would read the four retry-after bytes as text, so it gets none; an older
    agent also maps the new OVERLOADED code to INTERNAL_ERROR (ErrorCode.from_wire)."""
    d, a = Conn(Role.DIALER), Conn(Role.ACCEPTOR)
    d.start(Hello(identity={"node": "edge-1"}))
    a.receive_data(d.data_to_send())
    a.refuse_handshake(ErrorCode.OVERLOADED, "busy", retry_after=1.5)
    wire = a.data_to_send()
    _, flags, _ = HEADER.unpack_from(wire)
    assert flags == 0
    (ev,) = d.receive_data(wire)
    assert ev == ConnectionTerminated(ErrorCode.OVERLOADED, "busy (retry after 1.5s)",
                                      by_peer=True, retry_after=None)
    assert ErrorCode.from_wire(11) is ErrorCode.OVERLOADED  # and 13 from a newer peer:
    assert ErrorCode.from_wire(13) is ErrorCode.INTERNAL_ERROR


def test_retry_after_from_the_wire_is_checked_and_clamped() -> None:
    def refusal(flags: int, body: bytes) -> list:  # type: ignore[type-arg]
        d = Conn(Role.DIALER)
        d.start(Hello(features=(FEATURE_RETRY_AFTER,)))
        d.data_to_send()
        return d.receive_data(frame(FrameType.GOAWAY, 0, body, flags))

    head = struct.pack("!IB", 0, ErrorCode.OVERLOADED)
    (ev,) = refusal(FLAG_RETRY_AFTER, head + b"\x00\x01")
    assert isinstance(ev, ConnectionTerminated) and ev.code is ErrorCode.PROTOCOL_ERROR
    assert "no retry-after" in ev.message and not ev.by_peer
    (ev,) = refusal(FLAG_RETRY_AFTER, head + struct.pack("!I", 2**32 - 1) + b"slow")
    assert ev.retry_after == 3600.0 and ev.message == "slow"  # clamped to MAX_RETRY_AFTER
    (ev,) = refusal(0, head + b"plain")
    assert ev.retry_after is None and ev.message == "plain"


def test_refuse_handshake_misuse_is_a_local_error() -> None:
    d, a = Conn(Role.DIALER), Conn(Role.ACCEPTOR)
    with pytest.raises(LocalProtocolError):
        a.refuse_handshake(ErrorCode.OVERLOADED, "no HELLO yet")
    d.start(Hello(features=(FEATURE_RETRY_AFTER,)))
    a.receive_data(d.data_to_send())
    with pytest.raises(LocalProtocolError):
        a.refuse_handshake(ErrorCode.NO_ERROR, "not a refusal")
    with pytest.raises(LocalProtocolError):
        a.refuse_handshake(ErrorCode.OVERLOADED, "too long", retry_after=-1)
    with pytest.raises(LocalProtocolError):
        d.refuse_handshake(ErrorCode.OVERLOADED, "dialers do not refuse")
    a.accept_handshake(Hello())
    with pytest.raises(LocalProtocolError):
        a.refuse_handshake(ErrorCode.OVERLOADED, "after accepting")


def test_wrong_version_gets_unsupported_version() -> None:
    d, a = Conn(Role.DIALER), Conn(Role.ACCEPTOR)
    d.start(Hello(min_version=2, max_version=3))
    (ev,) = a.receive_data(d.data_to_send())
    assert isinstance(ev, ConnectionTerminated) and ev.code is ErrorCode.UNSUPPORTED_VERSION
    assert "versions 2-3" in ev.message
    (back,) = d.receive_data(a.data_to_send())
    assert isinstance(back, ConnectionTerminated)
    assert back.code is ErrorCode.UNSUPPORTED_VERSION and back.by_peer


def test_garbage_instead_of_hello_is_a_protocol_error() -> None:
    a = Conn(Role.ACCEPTOR)
    (ev,) = a.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert isinstance(ev, ConnectionTerminated) and ev.code in (
        ErrorCode.PROTOCOL_ERROR, ErrorCode.FRAME_SIZE_ERROR)
    assert a.is_closed
    assert a.receive_data(b"more") == []


def test_hello_with_bad_magic_or_json() -> None:
    a = Conn(Role.ACCEPTOR)
    (ev,) = a.receive_data(frame(FrameType.HELLO, 0, b"nope"))
    assert isinstance(ev, ConnectionTerminated) and "does not speak" in ev.message
    a = Conn(Role.ACCEPTOR)
    (ev,) = a.receive_data(frame(FrameType.HELLO, 0, MAGIC + struct.pack("!HH", 1, 1) + b"{"))
    assert isinstance(ev, ConnectionTerminated) and "JSON" in ev.message
    a = Conn(Role.ACCEPTOR)
    body = b'{"settings":{"max_frame_size":1}}'
    (ev,) = a.receive_data(frame(FrameType.HELLO, 0, MAGIC + struct.pack("!HH", 1, 1) + body))
    assert isinstance(ev, ConnectionTerminated) and "max_frame_size" in ev.message


def test_dialer_must_not_send_before_acceptor_answers() -> None:
    d, a = Conn(Role.DIALER), Conn(Role.ACCEPTOR)
    d.start(Hello())
    a.receive_data(d.data_to_send())
    (ev,) = a.receive_data(frame(FrameType.PING, 0, b"12345678"))
    assert isinstance(ev, ConnectionTerminated) and "before the handshake" in ev.message


# ------------------------------------------------------------------- streams


def test_streams_both_directions_with_ids_by_parity() -> None:
    pair = handshake()
    s1, _, _ = open_accepted(pair, "dialer")
    s2, _, _ = open_accepted(pair, "acceptor")
    s3, _, _ = open_accepted(pair, "dialer")
    assert (s1, s2, s3) == (1, 2, 3)
    opened = [e for e in pair.acceptor_events if isinstance(e, StreamOpened)]
    assert opened[0].target == T and opened[0].metadata == {"origin": "10.0.0.1:1234"}


def test_data_flows_and_half_close_is_distinct_from_reset() -> None:
    pair = handshake()
    sid, d, a = open_accepted(pair)
    d.send_data(sid, b"hello ")
    d.send_data(sid, b"world", end_stream=True)
    _, ev = pair.pump()
    assert received_bytes(ev, sid) == b"hello world"
    assert isinstance(ev[-1], StreamEnded)
    # Half-closed: the other direction still works.
    a.send_data(sid, b"reply")
    dev, _ = pair.pump()
    assert received_bytes(dev, sid) == b"reply"
    a.end_stream(sid)
    dev, _ = pair.pump()
    assert isinstance(dev[-1], StreamEnded)
    assert not d.has_stream(sid) and not a.has_stream(sid)
    # A reset, unlike FIN, kills both directions at once and carries a reason.
    sid2, d, a = open_accepted(pair)
    d.reset_stream(sid2, StreamReason.CANCELLED, "client went away")
    _, ev = pair.pump()
    assert ev == [StreamReset(sid2, StreamReason.CANCELLED, "client went away")]
    with pytest.raises(StreamClosedError):
        a.send_data(sid2, b"x")


@pytest.mark.parametrize("reason", list(StreamReason))
def test_refusal_carries_each_reason(reason: StreamReason) -> None:
    pair = handshake()
    sid = pair.dialer.open_stream(T)
    pair.pump()
    pair.acceptor.refuse_stream(sid, reason, f"because {reason.name}")
    dev, _ = pair.pump()
    assert dev == [StreamRefused(sid, reason, f"because {reason.name}")]
    assert not pair.dialer.has_stream(sid)


def test_unknown_reason_code_from_newer_peer_is_tolerated() -> None:
    pair = handshake()
    sid = pair.dialer.open_stream(T)
    pair.pump()
    (ev,) = pair.dialer.receive_data(frame(FrameType.REFUSE, sid, bytes([200]) + b"new"))
    assert ev == StreamRefused(sid, StreamReason.INTERNAL, "new")


def test_open_reset_by_the_peer_before_the_answer_is_gone() -> None:
    # The opener gives up (RST) before we answer, and both frames arrive in one read: the
    # stream is gone, answering it is a StreamClosedError the caller can act on, and the
    # connection carries on (found by the fuzz test, which answered such a stream).
    pair = handshake()
    sid = pair.dialer.open_stream(T)
    pair.dialer.reset_stream(sid, StreamReason.CANCELLED, "gave up")
    events = pair.acceptor.receive_data(pair.dialer.data_to_send())
    assert [type(e) for e in events] == [StreamOpened, StreamReset]
    assert not pair.acceptor.has_stream(sid)
    with pytest.raises(StreamClosedError):
        pair.acceptor.accept_stream(sid)
    with pytest.raises(StreamClosedError):
        pair.acceptor.refuse_stream(sid, StreamReason.REFUSED)
    assert pair.acceptor.data_to_send() == b""
    assert pair.acceptor.is_open
    sid2, d, a = open_accepted(pair)
    d.send_data(sid2, b"still fine")
    (got,) = a.receive_data(d.data_to_send())
    assert isinstance(got, DataReceived) and bytes(got.data) == b"still fine"


def test_data_before_accept_is_refused_locally() -> None:
    pair = handshake()
    sid = pair.dialer.open_stream(T)
    with pytest.raises(Exception, match="not accepted"):
        pair.dialer.send_data(sid, b"early")


def test_data_after_fin_is_a_protocol_error() -> None:
    pair = handshake()
    sid, d, a = open_accepted(pair)
    d.end_stream(sid)
    pair.pump()
    ev = a.receive_data(frame(FrameType.DATA, sid, b"late"))
    (t,) = terminated(ev)
    assert t.code is ErrorCode.PROTOCOL_ERROR and "after FIN" in t.message


def test_frames_for_never_opened_streams_are_errors_but_closed_ones_are_ignored() -> None:
    pair = handshake()
    sid, d, _a = open_accepted(pair)
    d.reset_stream(sid)
    pair.pump()
    # In-flight data for the stream we reset: dropped quietly.
    assert d.receive_data(frame(FrameType.DATA, sid, b"in flight")) == []
    assert d.receive_data(frame(FrameType.WINDOW, sid, struct.pack("!I", 5))) == []
    # A stream that never existed: protocol error.
    (t,) = terminated(d.receive_data(frame(FrameType.DATA, 99, b"?")))
    assert "never opened" in t.message


def test_open_id_rules() -> None:
    pair = handshake()
    open_payload = b'{"host":"a","port":1}'
    (t,) = terminated(pair.acceptor.receive_data(frame(FrameType.OPEN, 2, open_payload)))
    assert "parity" in t.message
    pair = handshake()
    pair.acceptor.receive_data(frame(FrameType.OPEN, 5, open_payload))
    (t,) = terminated(pair.acceptor.receive_data(frame(FrameType.OPEN, 3, open_payload)))
    assert "ids must increase" in t.message


@pytest.mark.parametrize("payload,needle", [
    (b"not json", "JSON"),
    (b"[]", "object"),
    (b'{"host":"a","port":0}', "port"),
    (b'{"host":"a","port":70000}', "port"),
    (b'{"host":"","port":1}', "host"),
    (b'{"host":"a b","port":1}', "whitespace"),
    (b'{"host":"a\\tb","port":1}', "whitespace"),
    ('{"host":"a\u00a0b","port":1}'.encode(), "whitespace"),
    ('{"host":"a\u2028b","port":1}'.encode(), "whitespace"),
    (b'{"host":"a\\u001cb","port":1}', "whitespace"),
    (b'{"host":"a","port":1,"proto":"sctp"}', "protocol"),
    (b'{"host":"a","port":true}', "integer"),
    (b'{"host":"a","port":1,"meta":{"k":1}}', "meta"),
])
def test_malformed_open_is_a_protocol_error(payload: bytes, needle: str) -> None:
    pair = handshake()
    (t,) = terminated(pair.acceptor.receive_data(frame(FrameType.OPEN, 1, payload)))
    assert needle in t.message


def test_the_host_check_refuses_exactly_whitespace_and_control_characters() -> None:
    """Target.validate's one-pass check (isprintable, and no ASCII space) refuses the
    same characters as asking each one isspace() or not isprintable()."""
    whitespace = [c for c in map(chr, range(0x110000)) if c.isspace()]
    assert [c for c in whitespace if c.isprintable()] == [" "]
    for c in [*whitespace, "\x00", "\x7f", "\u200b", "\udc80"]:
        with pytest.raises(ValueError, match="whitespace or control"):
            p.Target(f"a{c}b", 1).validate()
    p.Target("node-1.example.\u00e9", 1).validate()


def test_oversized_open_metadata() -> None:
    pair = handshake()
    with pytest.raises(Exception, match="exceeds the peer's limit"):
        pair.dialer.open_stream(T, {"x": "y" * 10_000})
    big = b'{"host":"a","port":1,"meta":{"x":"' + b"y" * 9000 + b'"}}'
    (t,) = terminated(pair.acceptor.receive_data(frame(FrameType.OPEN, 1, big)))
    assert t.code is ErrorCode.LIMIT_EXCEEDED


def test_too_many_streams_are_refused_as_overloaded() -> None:
    pair = handshake(acceptor_settings=Settings(max_streams=3))
    # The dialer respects the announced limit locally...
    for _ in range(3):
        pair.dialer.open_stream(T)
    with pytest.raises(StreamLimitReached):
        pair.dialer.open_stream(T)
    pair.pump()
    # ...and a peer that ignores it gets OVERLOADED refusals, not a crash.
    ev = pair.acceptor.receive_data(frame(FrameType.OPEN, 7, b'{"host":"a","port":1}'))
    assert ev == []
    out = pair.acceptor.data_to_send()
    word, _, sid = HEADER.unpack_from(out)
    assert (word & 0xFF, sid, out[HEADER.size]) == (
        FrameType.REFUSE, 7, StreamReason.OVERLOADED)
    assert pair.acceptor.stats.streams_refused_over_limit == 1
    assert pair.acceptor.open_streams == 3


def test_the_acceptor_may_allow_fewer_streams_on_one_connection() -> None:
    """A connection trusted less (an anonymous bootstrap) gets a lower stream cap than the
    settings the acceptor was made with: announced in its HELLO, enforced like any cap."""
    d = Conn(Role.DIALER)
    a = Conn(Role.ACCEPTOR, Settings(max_streams=100))
    d.start(p.Hello())
    a.receive_data(d.data_to_send())
    with pytest.raises(LocalProtocolError):
        a.limit_remote_streams(101)  # only lower
    a.limit_remote_streams(2)
    a.accept_handshake(p.Hello())
    d.receive_data(a.data_to_send())
    assert d.remote_settings.max_streams == 2 and a.local_settings.max_streams == 2
    with pytest.raises(LocalProtocolError):
        a.limit_remote_streams(1)  # the HELLO is out: too late
    d.open_stream(T)
    d.open_stream(T)
    with pytest.raises(StreamLimitReached):
        d.open_stream(T)
    a.receive_data(d.data_to_send())
    # A dialer that ignores the cap gets OVERLOADED.
    assert a.receive_data(frame(FrameType.OPEN, 5, b'{"host":"a","port":1}')) == []
    out = a.data_to_send()
    word, _, sid = HEADER.unpack_from(out)
    assert (word & 0xFF, sid, out[HEADER.size]) == (
        FrameType.REFUSE, 5, StreamReason.OVERLOADED)
    assert a.stats.streams_refused_over_limit == 1 and a.open_streams == 2


def test_unknown_frame_type() -> None:
    pair = handshake()
    (t,) = terminated(pair.acceptor.receive_data(frame(0x42, 0, b"")))
    assert "unknown frame type 0x42" in t.message
    # The peer learns why: a GOAWAY with the code is queued.
    (back,) = pair.dialer.receive_data(pair.acceptor.data_to_send())
    assert back == ConnectionTerminated(ErrorCode.PROTOCOL_ERROR,
                                        "unknown frame type 0x42", by_peer=True)


def test_oversized_frame_is_a_frame_size_error_before_buffering_it() -> None:
    pair = handshake()
    header = HEADER.pack((1 << 20) << 8 | FrameType.DATA, 0, 1)
    (t,) = terminated(pair.acceptor.receive_data(header))  # the header alone is enough
    assert t.code is ErrorCode.FRAME_SIZE_ERROR


# ------------------------------------------------------------------- flow control


def test_sender_cannot_exceed_stream_window_and_credit_returns_on_ack() -> None:
    pair = handshake(acceptor_settings=Settings(initial_stream_window=100_000))
    sid, d, a = open_accepted(pair)
    assert d.send_window(sid) == 100_000
    d.send_data(sid, b"x" * 100_000)
    assert d.send_window(sid) == 0
    with pytest.raises(FlowControlBlocked):
        d.send_data(sid, b"y")
    _, ev = pair.pump()
    assert len(received_bytes(ev, sid)) == 100_000
    a.acknowledge_received_data(sid, 30_000)  # below half the window: batched
    assert not a.data_to_send()
    a.acknowledge_received_data(sid, 30_000)
    dev, _ = pair.pump()
    assert WindowUpdated(sid) in dev
    assert d.send_window(sid) == 60_000


def test_peer_exceeding_the_window_gets_flow_control_error() -> None:
    pair = handshake(acceptor_settings=Settings(initial_stream_window=20_000))
    sid, _d, a = open_accepted(pair)
    raw = frame(FrameType.DATA, sid, b"z" * 20_001)
    (t,) = terminated(a.receive_data(raw))
    assert t.code is ErrorCode.FLOW_CONTROL_ERROR


def test_window_overflow_and_zero_increment() -> None:
    pair = handshake()
    sid, d, _a = open_accepted(pair)
    (t,) = terminated(d.receive_data(frame(FrameType.WINDOW, sid, struct.pack("!I", 2**31 - 1))))
    assert t.code is ErrorCode.FLOW_CONTROL_ERROR
    pair = handshake()
    (t,) = terminated(pair.dialer.receive_data(frame(FrameType.WINDOW, 0, struct.pack("!I", 0))))
    assert "increment of 0" in t.message


def test_a_stalled_reader_does_not_stall_other_streams() -> None:
    """One stream's reader never reads; the sibling keeps flowing at full speed."""
    settings = Settings(initial_stream_window=256 * 1024, connection_window=1024 * 1024)
    pair = handshake(acceptor_settings=settings)
    stalled, d, a = open_accepted(pair)
    busy, _, _ = open_accepted(pair)
    d.send_data(stalled, b"s" * d.send_window(stalled))  # fills its window, never read
    pair.pump()
    moved = 0
    for _ in range(200):  # 200 x 128 KiB = 25 MiB through the busy stream
        chunk = min(128 * 1024, d.send_window(busy))
        assert chunk > 0, "the busy stream was starved by the stalled one"
        d.send_data(busy, b"b" * chunk)
        _, ev = pair.pump()
        got = len(received_bytes(ev, busy))
        a.acknowledge_received_data(busy, got)
        pair.pump()
        moved += got
    assert moved >= 25 * 1024 * 1024
    assert a.unacked_bytes == 256 * 1024  # only the stalled stream's window is held


def test_memory_is_bounded_when_many_readers_stall() -> None:
    """Unread data beyond the budget stops connection credit: the peer must stop."""
    settings = Settings(initial_stream_window=128 * 1024, connection_window=512 * 1024)
    pair = handshake(acceptor_settings=settings, receive_budget=1024 * 1024)
    d, a = pair.dialer, pair.acceptor
    sids = [open_accepted(pair)[0] for _ in range(40)]  # 40 x 128 KiB = 5 MiB of windows
    for _ in range(3):
        for sid in sids:
            n = d.send_window(sid)
            if n:
                d.send_data(sid, b"m" * n)
        pair.pump()
    # Never more than budget + connection window buffered, however the peer pushes.
    assert a.unacked_bytes <= 1024 * 1024 + 512 * 1024
    assert all(d.send_window(s) == 0 for s in sids)
    # Reading drains it and credit flows again.
    for sid in sids:
        got = len(received_bytes(pair.acceptor_events, sid))
        a.acknowledge_received_data(sid, got)
    pair.pump()
    assert any(d.send_window(s) > 0 for s in sids)


def test_large_payload_is_split_into_frames_of_the_peer_max() -> None:
    pair = handshake(acceptor_settings=Settings(max_frame_size=16 * 1024))
    sid, d, _a = open_accepted(pair)
    d.send_data(sid, bytes(range(256)) * 256, end_stream=True)  # 64 KiB
    _, ev = pair.pump()
    chunks = [e for e in ev if isinstance(e, DataReceived)]
    assert len(chunks) == 4 and all(len(c.data) == 16 * 1024 for c in chunks)
    assert received_bytes(ev, sid) == bytes(range(256)) * 256


def test_byte_at_a_time_delivery() -> None:
    pair = handshake()
    sid, d, a = open_accepted(pair)
    d.send_data(sid, b"slow and steady", end_stream=True)
    events = []
    for byte in d.data_to_send():
        events += a.receive_data(bytes([byte]))
    assert received_bytes(events, sid) == b"slow and steady"
    assert isinstance(events[-1], StreamEnded)


# ------------------------------------------------------------------- ping, goaway


def test_ping_is_answered_with_the_same_payload() -> None:
    pair = handshake()
    pair.dialer.ping(b"\x00\x01\x02\x03\x04\x05\x06\x07")
    dev, aev = pair.pump()
    assert aev == [] and dev == [PingAcked(b"\x00\x01\x02\x03\x04\x05\x06\x07")]


def test_goaway_drains_running_streams_and_refuses_new_ones() -> None:
    pair = handshake()
    running, d, a = open_accepted(pair)
    late = d.open_stream(T)  # crosses the GOAWAY on the wire
    a.goaway("rolling update")
    dev = d.receive_data(a.data_to_send())
    assert GoAwayReceived(running, ErrorCode.NO_ERROR, "rolling update") in dev
    assert StreamRefused(late, StreamReason.DRAINING, "peer is draining: rolling update") in dev
    with pytest.raises(ConnectionDraining):
        d.open_stream(T)
    # The acceptor refuses the crossing OPEN as DRAINING too (the peer may retry).
    a.receive_data(d.data_to_send())
    assert a.stats.streams_refused_draining == 1
    # The running stream still completes.
    d.send_data(running, b"finish", end_stream=True)
    a.send_data(running, b"done", end_stream=True)
    dev, aev = pair.pump()
    assert received_bytes(aev, running) == b"finish"
    assert received_bytes(dev, running) == b"done"
    assert d.open_streams == 0 and a.open_streams == 0


def test_close_terminates_peer_with_code() -> None:
    pair = handshake()
    open_accepted(pair)
    pair.acceptor.close(ErrorCode.REPLACED, "edge-1 connected again from 10.0.0.9")
    dev, _ = pair.pump()
    assert dev == [ConnectionTerminated(ErrorCode.REPLACED,
                                        "edge-1 connected again from 10.0.0.9", by_peer=True)]
    assert pair.dialer.open_streams == 0


def test_eof_mid_frame_is_reported() -> None:
    pair = handshake()
    pair.acceptor.receive_data(frame(FrameType.DATA, 1, b"abc")[:5])
    (t,) = pair.acceptor.receive_data(b"")
    assert t.by_peer and "middle of a frame" in t.message


def test_fin_flag_on_data_frame_wire_format() -> None:
    pair = handshake()
    sid, d, _ = open_accepted(pair)
    d.end_stream(sid)
    raw = d.data_to_send()
    assert raw == frame(FrameType.DATA, sid, b"", FLAG_FIN)
    assert StreamAccepted(sid) in pair.dialer_events


# ------------------------------------------------------------------- replicas


def test_server_announces_identity_and_replicas_and_dialer_names_held_servers() -> None:
    """Several replicas: the acceptor's HELLO carries its id and the replica count, the
    dialer's the ids it holds; both ride in identity, so an older peer ignores them."""
    d, a = Conn(Role.DIALER), Conn(Role.ACCEPTOR)
    ident = p.with_held_servers({"node": "edge-1"}, ["srv-b", "srv-a", "", "bad,id"])
    assert ident == {"node": "edge-1", "held_servers": "srv-a,srv-b"}
    d.start(Hello(identity=ident))
    (ev,) = a.receive_data(d.data_to_send())
    assert p.held_servers(ev.hello.identity) == {"srv-a", "srv-b"}
    a.accept_handshake(Hello(identity={"server": "srv-c", "replicas": "3"}))
    (done,) = d.receive_data(a.data_to_send())
    assert done.hello.identity["server"] == "srv-c"
    assert p.server_replicas(done.hello.identity) == 3


def test_replica_count_and_held_servers_from_the_wire_are_bounded() -> None:
    for raw in ("0", "-1", "2.5", "x", "", str(p.MAX_REPLICAS + 1), "1" * 40):
        assert p.server_replicas({"replicas": raw}) is None, raw
    assert p.server_replicas({}) is None  # an older server: hold one tunnel
    assert p.server_replicas({"replicas": "64"}) == 64
    many = ",".join(f"s{i}" for i in range(500))
    assert len(p.held_servers({"held_servers": many})) == p.MAX_HELD_SERVERS
    assert p.held_servers({"held_servers": ",,"}) == frozenset()
    assert p.with_held_servers({"held_servers": "old"}, []) == {}


def test_already_connected_refusal_reaches_the_dialer_and_reads_as_internal_when_old() -> None:
    d, a = Conn(Role.DIALER), Conn(Role.ACCEPTOR)
    d.start(Hello(identity={"node": "edge-1", "held_servers": "s"}))
    a.receive_data(d.data_to_send())
    a.refuse_handshake(ErrorCode.ALREADY_CONNECTED, "already connected to this server")
    (ev,) = d.receive_data(a.data_to_send())
    assert ev == ConnectionTerminated(ErrorCode.ALREADY_CONNECTED,
                                      "already connected to this server", by_peer=True)
    assert ErrorCode.from_wire(12) is ErrorCode.ALREADY_CONNECTED


def test_lent_payloads_are_views_of_what_was_fed_and_copies_otherwise() -> None:
    """receive_data(lend=True) (the tunnel's reader) hands DATA payloads out as views
    of the bytes fed (no copy per frame), a frame completed across two reads as a view
    of the reassembly buffer; without it every payload is bytes of its own."""
    pair = handshake()
    sid, d, a = open_accepted(pair)
    d.send_data(sid, b"a" * 5000)
    d.send_data(sid, b"b" * 3000)
    wire = bytearray(d.data_to_send())
    cut = len(wire) - 1000  # the second frame arrives in two reads
    events = (a.receive_data(memoryview(wire)[:cut], lend=True)
              + a.receive_data(memoryview(wire)[cut:], lend=True))
    payloads = [e.data for e in events if isinstance(e, DataReceived)]
    assert [bytes(x) for x in payloads] == [b"a" * 5000, b"b" * 3000]
    assert all(type(x) is memoryview for x in payloads)
    wire[9:14] = b"zzzzz"  # the caller reuses its buffer: the lent view shows it
    assert bytes(payloads[0][:5]) == b"zzzzz"
    assert bytes(payloads[1]) == b"b" * 3000  # the reassembled frame is not in `wire`
    d.send_data(sid, b"c" * 10)
    events = a.receive_data(d.data_to_send())
    assert [e.data for e in events if isinstance(e, DataReceived)] == [b"c" * 10]
    assert all(type(e.data) is bytes for e in events if isinstance(e, DataReceived))
