"""The HTTP/2 session without sockets: an `h2` client connection and `H2Session` trade
bytes in memory. Each attack of record ends the connection with GOAWAY, and the test
counts what the session spent (streams opened, bytes buffered, frames handled)."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import hpack
import hyperframe.frame as hf
import pytest

from nodeagent.http import grpcstatus
from nodeagent.http.h2heads import h1_view, h2_request, is_grpc, split_response
from nodeagent.http.h2session import (
    DataIn,
    EndIn,
    H2Refused,
    H2Session,
    H2Settings,
    HeadersIn,
    ResetIn,
    TrailersIn,
)

REQUEST = [(b":method", b"POST"), (b":scheme", b"http"), (b":authority", b"app.test"),
           (b":path", b"/svc/Call"), (b"content-type", b"application/grpc"),
           (b"te", b"trailers")]


def pair(settings: H2Settings | None = None) -> tuple[h2.connection.H2Connection, H2Session]:
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                                  header_encoding=None))
    server = H2Session(client_side=False, settings=settings)
    client.initiate_connection()
    server.start()
    server.receive(client.data_to_send())
    client.receive_data(server.data_to_send())
    server.receive(client.data_to_send())  # the SETTINGS ack
    return client, server


def goaway_code(client: h2.connection.H2Connection, data: bytes) -> int | None:
    for ev in client.receive_data(data):
        if isinstance(ev, h2.events.ConnectionTerminated):
            return int(ev.error_code or 0)
    return None


def test_a_request_with_body_and_trailers_then_the_response() -> None:
    client, server = pair()
    client.send_headers(1, REQUEST)
    client.send_data(1, b"\x00\x00\x00\x00\x02hi")
    client.send_headers(1, [(b"x-end", b"1")], end_stream=True)
    events = server.receive(client.data_to_send())
    assert [type(e) for e in events] == [HeadersIn, DataIn, TrailersIn, EndIn]
    head = events[0]
    assert isinstance(head, HeadersIn) and head.headers[:4] == REQUEST[:4] and not head.ended
    data = events[1]
    assert isinstance(data, DataIn) and data.flow_length == 7
    server.acknowledge(1, data.flow_length)
    server.send_headers(1, [(b":status", b"200"), (b"content-type", b"application/grpc")])
    server.send_data(1, b"\x00\x00\x00\x00\x00")
    server.send_headers(1, grpcstatus.status_trailers(grpcstatus.OK, ""), end=True)
    got = client.receive_data(server.data_to_send())
    kinds = [type(e).__name__ for e in got]
    assert "ResponseReceived" in kinds and "TrailersReceived" in kinds and "StreamEnded" in kinds


def test_the_request_head_as_the_http11_policy_reads_it() -> None:
    req = h1_view([*REQUEST, (b"cookie", b"a=1"), (b"cookie", b"b=2"), (b"host", b"other")])
    assert req.method == b"POST" and req.target == b"/svc/Call" and req.grpc
    assert req.fields[0] == (b"host", b"app.test") and req.te_trailers
    assert (b"cookie", b"a=1; b=2") in req.fields
    assert not any(n == b"te" or n.startswith(b":") for n, _ in req.fields)
    up = h2_request(b"POST", b"/x", [(b"host", b"app.test"), (b"transfer-encoding", b"chunked"),
                                      (b"x-a", b"1")], te_trailers=True)
    assert up == [(b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/x"),
                  (b":authority", b"app.test"), (b"x-a", b"1"), (b"te", b"trailers")]
    assert split_response([(b":status", b"204"), (b"x", b"y")]) == (204, [(b"x", b"y")])
    assert is_grpc(b"application/grpc+proto") and not is_grpc(b"application/grpcx")
    # Cookie crumbs come out of the session as they came (h2's inbound normalisation is
    # off) and h1_view joins them (RFC 9113 §8.2.3).
    client, server = pair()
    client.send_headers(1, [*REQUEST, (b"cookie", b"a=1"), (b"cookie", b"b=2")],
                        end_stream=True)
    head = server.receive(client.data_to_send())[0]
    assert isinstance(head, HeadersIn)
    assert (b"cookie", b"a=1; b=2") in h1_view(head.headers).fields


def test_grpc_status_helpers() -> None:
    assert grpcstatus.parse_timeout(b"100m") == pytest.approx(0.1)
    assert grpcstatus.parse_timeout(b"2S") == 2.0
    assert grpcstatus.parse_timeout(b"123456789S") is None  # over 8 digits
    assert grpcstatus.parse_timeout(b"1x") is None
    assert grpcstatus.code_for_http(503) == grpcstatus.UNAVAILABLE
    assert grpcstatus.code_for_http(404) == grpcstatus.UNIMPLEMENTED
    only = grpcstatus.trailers_only(14, "node edge-1 is not connected: 50%")
    assert only[0] == (b":status", b"200") and (b"grpc-status", b"14") in only
    assert (b"grpc-message", b"node edge-1 is not connected: 50%25") in only


def test_a_client_reset_is_an_event() -> None:
    client, server = pair()
    client.send_headers(1, REQUEST)
    client.reset_stream(1, h2.errors.ErrorCodes.CANCEL)
    events = server.receive(client.data_to_send())
    assert isinstance(events[-1], ResetIn) and events[-1].code == h2.errors.ErrorCodes.CANCEL


def test_rapid_reset_ends_the_connection() -> None:
    """CVE-2023-44487: open a stream and reset it at once, forever. Allowed: resets up to
    `max_client_resets` plus half the streams opened; the rest is GOAWAY."""
    client, server = pair(H2Settings(max_client_resets=50))
    sid = 1
    with pytest.raises(H2Refused) as info:
        for _ in range(1000):
            client.send_headers(sid, REQUEST)
            client.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
            sid += 2
            server.receive(client.data_to_send())
    assert info.value.reason == "rapid_reset"
    assert server.streams_opened <= 101  # what it spent before refusing
    assert goaway_code(client, server.data_to_send()) == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM


def test_cancelling_some_calls_is_not_an_attack() -> None:
    client, server = pair(H2Settings(max_client_resets=50))
    sid = 1
    for i in range(600):
        client.send_headers(sid, REQUEST, end_stream=True)
        if i % 3 == 0:
            client.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        else:
            server.receive(client.data_to_send())
            server.send_headers(sid, grpcstatus.trailers_only(0, ""), end=True)
            client.receive_data(server.data_to_send())
        server.receive(client.data_to_send())
        sid += 2


def test_ping_and_settings_floods_end_the_connection() -> None:
    for flood in ("ping", "settings"):
        client, server = pair(H2Settings(max_control_frames=100))
        with pytest.raises(H2Refused) as info:
            for i in range(10_000):
                if flood == "ping":
                    client.ping(b"%08d" % i)
                else:
                    client.update_settings({h2.settings.SettingCodes.ENABLE_PUSH: 0})
                server.receive(client.data_to_send())
        assert info.value.reason == "control_flood"
        assert server.control_frames <= 102


def test_too_many_concurrent_streams() -> None:
    _client, server = pair(H2Settings(max_concurrent_streams=10))
    raw = b""
    enc = hpack.Encoder()
    for sid in range(1, 24, 2):  # 12 streams, never ended, past a limit of 10
        frame = hf.HeadersFrame(sid)
        frame.data = enc.encode(REQUEST)
        frame.flags.add("END_HEADERS")
        raw += frame.serialize()
    with pytest.raises(H2Refused) as info:
        server.receive(raw)
    assert info.value.reason in ("too_many_streams", "protocol_error")
    assert server.streams_opened <= 10


@pytest.mark.parametrize("frame_size", [16_000, 256 * 1024 - 100])
def test_continuation_flood_is_bounded(frame_size: int) -> None:
    """2024's CONTINUATION flood: a header block that never ends. `h2` would hold 64
    CONTINUATION frames of one block (16 MiB of the 256 KiB frames clients may send)
    before refusing; the session refuses once the block held is over the header list size
    (64 KiB), what it would refuse once decoded anyway."""
    _client, server = pair()
    assert server.conn.max_inbound_frame_size == 256 * 1024
    frame = hf.HeadersFrame(1)
    frame.data = hpack.Encoder().encode(REQUEST)
    raw = frame.serialize()
    fed = 0
    with pytest.raises(H2Refused) as info:
        for _ in range(10_000):
            cont = hf.ContinuationFrame(1)
            cont.data = b"\x00" * frame_size
            raw += cont.serialize()
            fed += len(raw)
            server.receive(raw)
            raw = b""
            assert server.pending_header_block() <= 64 * 1024
    assert info.value.reason == "header_list_too_large"
    assert server.streams_opened == 0
    # Refused within the header list size and one frame, not after 64 frames.
    assert fed <= 64 * 1024 + frame_size + 100, fed


def test_a_header_block_within_the_limit_in_continuations_passes() -> None:
    """The header block bound counts what `h2` holds (`pending_header_block` sees it): a
    legitimate head split over CONTINUATION frames, under the limit, is taken."""
    _client, server = pair()
    block = hpack.Encoder().encode([*REQUEST, (b"x-big", b"v" * 40_000)])
    frame = hf.HeadersFrame(1)
    frame.data = block[:20_000]
    server.receive(frame.serialize())
    assert server.pending_header_block() == 20_000
    cont = hf.ContinuationFrame(1)
    cont.data = block[20_000:]
    cont.flags.add("END_HEADERS")
    events = server.receive(cont.serialize())
    assert [type(e) for e in events] == [HeadersIn] and server.pending_header_block() == 0


def test_a_client_may_send_256_kib_frames_and_no_larger() -> None:
    """Clients may send DATA frames of up to 256 KiB (`H2Settings.max_frame_size`); a frame
    announcing more is refused as soon as more than one largest frame is held, not when
    its announced length has arrived."""
    client, server = pair()
    assert client.max_outbound_frame_size == 256 * 1024
    client.send_headers(1, REQUEST)
    client.send_data(1, b"d" * 256 * 1024)
    raw = client.data_to_send()
    assert len(raw) < 256 * 1024 + 200  # one DATA frame
    events = server.receive(raw)
    assert sum(len(e.data) for e in events if isinstance(e, DataIn)) == 256 * 1024
    over = (256 * 1024 + 1).to_bytes(3, "big") + b"\x00\x00" + (3).to_bytes(4, "big")
    with pytest.raises(H2Refused) as info:
        for _ in range(100):
            server.receive(over + b"\x00" * 8191 if over else b"\x00" * 8192)
            over = b""
    assert info.value.reason == "frame_too_large"
    assert server.pending_input() <= 256 * 1024 + 9 + 8192


def test_hpack_bomb_is_refused() -> None:
    """A small header block that decodes to far more than the header list limit: one
    large indexed field repeated."""
    _client, server = pair(H2Settings(max_header_list_size=16 * 1024))
    enc = hpack.Encoder()
    block = enc.encode([*REQUEST, (b"x-bomb", b"a" * 4000)])
    # Then the same field by index (one byte each) 1000 times: ~4 MB decoded.
    frame = hf.HeadersFrame(1)
    frame.data = block + bytes([0x80 | 62]) * 1000
    frame.flags.add("END_HEADERS")
    with pytest.raises(H2Refused) as info:
        server.receive(frame.serialize())
    assert info.value.reason in ("header_list_too_large", "protocol_error")
    assert server.streams_opened == 0


def test_sending_past_the_window_is_a_flow_control_error() -> None:
    """A client may not make us buffer more than its window: data past it is refused."""
    client, server = pair(H2Settings(stream_window=65535, connection_window=65535 * 4))
    client.send_headers(1, REQUEST)
    server.receive(client.data_to_send())
    frame = hf.DataFrame(1)
    frame.data = b"x" * 16384
    raw = frame.serialize() * 5  # 80 KiB into a 64 KiB window, never acknowledged
    with pytest.raises(H2Refused) as info:
        server.receive(raw)
    assert info.value.reason == "flow_control"


def test_frame_reprs_for_h2s_trace_log_stay_hyperframes_and_are_cheap() -> None:
    """`h2` builds `repr(frame)` for every frame received; the front's `_raw_data_repr`
    replaces hyperframe's (which hexlified whole bodies) with the same output."""
    import binascii

    from nodeagent.http import h2session

    assert hf._raw_data_repr is h2session._raw_data_repr  # type: ignore[attr-defined]

    def hyperframes(data: bytes) -> str:  # hyperframe 6.1's, as it was
        if not data:
            return "None"
        r = binascii.hexlify(data).decode("ascii")
        return "<hex:" + (r[:20] + "..." if len(r) > 20 else r) + ">"

    for size in (0, 1, 9, 10, 11, 16384):
        data = bytes(range(256)) * 64
        assert h2session._raw_data_repr(data[:size]) == hyperframes(data[:size])
    frame = hf.DataFrame(1, data=b"\x01" * 16384)
    assert repr(frame).endswith("<hex:01010101010101010101...>")
    # DATA frames' bodies: what hyperframe's Frame._body_repr shows (the serialized body),
    # padded or not, short or long, without serializing them.
    assert hf.DataFrame._body_repr is h2session._data_body_repr  # type: ignore[attr-defined]
    for size in (0, 1, 9, 10, 11, 16384):
        for pad in (None, 0, 3, 20):
            frame = hf.DataFrame(1, data=bytes(range(256))[:size] * (1 + size // 256))
            frame.data = frame.data[:size]
            if pad is not None:
                frame.flags.add("PADDED")
                frame.pad_length = pad
            assert frame._body_repr() == hyperframes(frame.serialize_body()), (size, pad)


def test_hpacks_per_field_debug_logging_is_off() -> None:
    """hpack's module loggers (a debug line per header field and integer) are replaced by
    one that drops debug lines: a head still encodes and decodes, and hpack's debug
    calls go nowhere even with debug logging on."""
    import logging

    import hpack.hpack
    import hpack.table

    from nodeagent.http import h2session

    assert isinstance(hpack.hpack.log, h2session._NoDebugLog)  # type: ignore[attr-defined]
    assert isinstance(hpack.table.log, h2session._NoDebugLog)  # type: ignore[attr-defined]
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep(logging.DEBUG)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        block = hpack.Encoder().encode(REQUEST)
        assert hpack.Decoder().decode(block, raw=True) == REQUEST
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    assert not [r for r in records if r.name.startswith("hpack")]
    assert hpack.hpack.log.isEnabledFor(logging.WARNING)  # other levels: hpack's logger


def test_a_backends_goaway_among_frames_split_anywhere() -> None:
    """Client side, the backend's GOAWAY is taken out of the bytes before `h2` sees them
    (a drain: streams up to its last id go on), wherever the reads cut the frames."""

    def connected() -> tuple[H2Session, bytes]:
        backend = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding=None))
        front = H2Session(client_side=True)
        backend.initiate_connection()
        front.start()
        backend.receive_data(front.data_to_send())
        front.receive(backend.data_to_send())
        backend.receive_data(front.data_to_send())
        front.send_headers(1, REQUEST, end=True)
        backend.receive_data(front.data_to_send())
        backend.send_headers(1, [(b":status", b"200")])
        backend.send_data(1, b"a" * 16384)
        backend.send_data(1, b"a" * 3616)
        goaway = hf.GoAwayFrame(0)
        goaway.last_stream_id = 1
        stream = backend.data_to_send() + goaway.serialize()
        backend.send_data(1, b"b" * 100, end_stream=True)
        return front, stream + backend.data_to_send()

    _, stream = connected()
    for cut in (1, 7, 9, 10, 4096, 16393, 16402, len(stream) - 1, len(stream)):
        session, stream = connected()
        events = session.receive(stream[:cut]) + session.receive(stream[cut:])
        body = b"".join(e.data for e in events if isinstance(e, DataIn))
        assert body == b"a" * 20000 + b"b" * 100, cut
        assert [type(e).__name__ for e in events if type(e).__name__ in
                ("GoawayIn", "EndIn")] == ["GoawayIn", "EndIn"], cut
        assert session.goaway_received and session.pending_input() == 0
    for step in (1, 5, 1000, 7000):  # frames cut across many reads, GOAWAY's too
        session, stream = connected()
        events = []
        for at in range(0, len(stream), step):
            events += session.receive(stream[at:at + step])
        body = b"".join(e.data for e in events if isinstance(e, DataIn))
        assert body == b"a" * 20000 + b"b" * 100, step
        assert [type(e).__name__ for e in events if type(e).__name__ in
                ("GoawayIn", "EndIn")] == ["GoawayIn", "EndIn"], step


def test_body_frames_queued_together_are_joined_up_to_a_limit() -> None:
    """`Inbox.join_data`: the data queued behind a frame, up to the limit, with its window;
    never past trailers or the end, whose order must stay."""
    from nodeagent.http.h2wire import Inbox

    inbox = Inbox()
    for piece in (b"b" * 10, b"c" * 10, b"d" * 10):
        inbox.items.append(DataIn(1, piece, len(piece) + 1))
    inbox.items.append(TrailersIn(1, [(b"x", b"1")]))
    inbox.items.append(DataIn(1, b"e", 1))
    assert inbox.join_data(b"a" * 10, 35) == (b"a" * 10 + b"b" * 10 + b"c" * 10, 22)
    assert inbox.join_data(b"", 100) == (b"d" * 10, 11)
    assert inbox.join_data(b"z", 100) == (b"z", 0)  # trailers next: nothing joined
    assert [type(e) for e in inbox.items] == [TrailersIn, DataIn]


def test_h2s_frame_trace_line_is_built_only_when_a_logger_formats_it() -> None:
    """`h2.connection`'s `repr` is the front's `_frame_as_is`: a frame received builds no
    repr with the front's configuration (no logger), and a configured logger's trace line
    still reads as `h2`'s, `repr(frame)` and all."""
    from nodeagent.http import h2session

    assert h2.connection.repr is h2session._frame_as_is  # type: ignore[attr-defined]
    built = []

    class Counted(hf.PingFrame):
        def __repr__(self) -> str:
            built.append(1)
            return super().__repr__()

    session = H2Session(client_side=False)
    session.start()
    session.conn._frame_dispatch_table[Counted] = (  # type: ignore[attr-defined]
        session.conn._receive_ping_frame)
    session.conn._receive_frame(Counted(0, opaque_data=b"12345678"))
    assert built == []  # no logger: no repr

    lines: list[str] = []

    class TraceLog:
        def debug(self, fmt: str, *args: object, **kwargs: object) -> None:
            pass

        def trace(self, fmt: str, *args: object, **kwargs: object) -> None:
            lines.append(fmt % args)

    conn = h2.connection.H2Connection(h2.config.H2Configuration(
        client_side=False, header_encoding=None, logger=TraceLog()))
    conn.initiate_connection()
    frame = hf.DataFrame(1, data=b"\x01" * 40, flags=["END_STREAM"])
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True,
                                                                  header_encoding=None))
    client.initiate_connection()
    client.send_headers(1, REQUEST)
    client.send_data(1, frame.data, end_stream=True)
    conn.receive_data(client.data_to_send())
    assert f"Received frame: {frame!r}" in lines  # as h2's own line reads
    received = [line for line in lines if line.startswith("Received frame: ")]
    assert len(received) == 3  # SETTINGS, HEADERS, DATA
    assert all("Frame(stream_id=" in line for line in received)


def _verdict(check: object, headers: list[tuple[bytes, bytes]],
             flags: object = None) -> object:
    """What a header check makes of `headers` (a request head's, unless `flags` say
    otherwise): the fields it passes, or its error's text."""
    import h2.exceptions
    import h2.utilities

    if flags is None:
        flags = h2.utilities.HeaderValidationFlags(is_client=False, is_trailer=False,
                                                   is_response_header=False,
                                                   is_push_promise=False)
    try:
        return list(check(headers, flags))  # type: ignore[operator]
    except h2.exceptions.ProtocolError as exc:
        return ("refused", str(exc))


def test_inbound_field_check_gives_h2s_verdicts_on_every_byte_and_random_fields() -> None:
    """The front's inbound validation checks characters with two patterns (in C) where
    `h2`'s walks every byte in Python: on every byte value at the start, middle and end
    of a name and of a value, and on 20,000 random fields of the bytes that matter, it
    passes the same fields as `h2`'s and refuses the same ones with the same error.
    Trailers, so that no pseudo-field rule decides first and a head the patterns pass
    comes back from the one pass itself. A malformed head from a client is refused as
    before."""
    import random

    import h2.utilities

    from nodeagent.http import h2session

    ours = h2session._validate_headers
    theirs = h2session._h2_validate_headers
    trailers = h2.utilities.HeaderValidationFlags(is_client=False, is_trailer=True,
                                                  is_response_header=False,
                                                  is_push_promise=False)
    cases: list[list[tuple[bytes, bytes]]] = []
    for byte in range(256):
        b = bytes([byte])
        for name in (b, b + b"ab", b"ab" + b, b"a" + b + b"b", b":" + b, b"::" + b):
            cases.append([(b"x-ok", b"1"), (name, b"v")])
        for value in (b, b + b"ab", b"ab" + b, b"a" + b + b"b", b + b"\n", b"\n" + b):
            cases.append([(b"x-ok", b"1"), (b"x-v", value)])
    alphabet = b"aZ:\0\r\n \t\x7f\x80\xff-1~!@[{"
    rng = random.Random(21)
    for _ in range(20_000):
        cases.append([(bytes(rng.choices(alphabet, k=rng.randint(0, 4))),
                       bytes(rng.choices(alphabet, k=rng.randint(0, 4))))
                      for _ in range(rng.randint(1, 3))])
    refused = 0
    for headers in cases:
        expected = _verdict(theirs, headers, trailers)
        assert _verdict(ours, headers, trailers) == expected, headers
        refused += isinstance(expected, tuple)
    assert 1_000 < refused < len(cases)  # both verdicts were exercised

    # Through a session: a client's head with a CR in a value still ends the connection
    # with h2's GOAWAY(PROTOCOL_ERROR) and its message.
    client, server = pair()
    client.send_headers(1, [*REQUEST, (b"x-bad", b"a\rb")], end_stream=True)
    with pytest.raises(H2Refused) as info:
        server.receive(client.data_to_send())
    assert info.value.reason == "protocol_error"
    assert str(info.value) == "Illegal character '\r' in header value: b'a\\rb'"
    reply = client.receive_data(server.data_to_send())
    assert any(isinstance(e, h2.events.ConnectionTerminated)
               and e.error_code == h2.errors.ErrorCodes.PROTOCOL_ERROR for e in reply)


def test_literal_values_go_out_without_huffman_coding_and_decode() -> None:
    """The front's sessions send literal field values as they are (no Huffman coding, a
    Python loop per byte in hpack): a value new to the table appears verbatim in the
    frames, and the peer decodes the head as sent, the first time and once indexed."""
    client, server = pair()
    client.send_headers(1, REQUEST, end_stream=True)
    server.receive(client.data_to_send())
    head = [(b":status", b"200"), (b"content-type", b"application/grpc"),
            (b"x-call", b"29999123u-unique")]
    server.send_headers(1, head)
    server.send_headers(1, [(b"grpc-status", b"0")], end=True)
    raw = server.data_to_send()
    assert b"29999123u-unique" in raw and b"x-call" in raw
    got = client.receive_data(raw)
    assert [list(e.headers) for e in got if isinstance(e, h2.events.ResponseReceived)] == [
        head]
    client.send_headers(3, REQUEST, end_stream=True)
    server.receive(client.data_to_send())
    server.send_headers(3, head, end=True)
    raw = server.data_to_send()
    assert b"29999123u-unique" not in raw  # indexed now
    got = client.receive_data(raw)
    assert [list(e.headers) for e in got if isinstance(e, h2.events.ResponseReceived)] == [
        head]


def test_inbound_validation_gives_h2s_verdicts_on_random_heads_of_each_kind() -> None:
    """The front's one-pass `_validate_headers` stands where `h2.stream` called `h2`'s
    chain of checks: on random heads of fields that trip each check (pseudo-fields in
    and out of order, duplicated, unknown, missing; `te`, connection-specific fields,
    `host` against `:authority`, empty names and paths, bad characters), as requests,
    responses and trailers, both pass the same heads and refuse the others with the same
    error; well-formed heads take the one pass (the list comes back as it is)."""
    import random

    import h2.utilities

    from nodeagent.http import h2session

    assert vars(h2.stream)["validate_headers"] is h2session._validate_headers
    names = [b":method", b":scheme", b":path", b":authority", b":status", b":protocol",
             b":foo", b"host", b"te", b"connection", b"keep-alive", b"content-type",
             b"x-a", b"", b"X-Up", b"a:b", b"proxy-connection"]
    values = [b"GET", b"CONNECT", b"POST", b"", b"trailers", b"TRAILERS", b"gzip",
              b"a.test", b"b.test", b" x", b"x\r", b"/p", b"200", b"websocket", b"http"]
    valid = {
        "request": [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/p"),
                    (b":authority", b"a.test"), (b"te", b"trailers"), (b"x-a", b"1")],
        "response": [(b":status", b"200"), (b"content-type", b"x"), (b"x-a", b"")],
        "trailers": [(b"grpc-status", b"0"), (b"x-a", b"1")],
    }
    kinds = {
        "request": h2.utilities.HeaderValidationFlags(False, False, False, False),
        "response": h2.utilities.HeaderValidationFlags(True, False, True, False),
        "trailers": h2.utilities.HeaderValidationFlags(True, True, False, False),
        "request trailers": h2.utilities.HeaderValidationFlags(False, True, False, False),
    }
    rng = random.Random(21)
    verdicts = {"same list": 0, "refused": 0}
    for kind, flags in kinds.items():
        base = valid.get(kind, valid["trailers"])
        heads = [list(base), [(b":method", b"CONNECT"), (b":authority", b"a.test")],
                 [(b":method", b"CONNECT"), (b":protocol", b"websocket"),
                  (b":scheme", b"http"), (b":path", b"/"), (b":authority", b"a.test")],
                 [*base, (b"host", b"a.test")], [*base, (b"host", b"b.test")],
                 [*base, (b"host", b"a.test"), (b"host", b"a.test")]]
        for _ in range(6_000):
            head = list(base)
            for _ in range(rng.randint(0, 3)):  # a few faults (or none) in a good head
                pick = rng.random()
                field = (rng.choice(names), rng.choice(values))
                if pick < 0.4 and head:
                    head[rng.randrange(len(head))] = field
                elif pick < 0.7:
                    head.insert(rng.randint(0, len(head)), field)
                elif head:
                    del head[rng.randrange(len(head))]
            heads.append(head)
        for _ in range(2_000):  # and heads of random fields
            heads.append([(rng.choice(names), rng.choice(values))
                          for _ in range(rng.randint(0, 6))])
        for head in heads:
            theirs = _verdict(h2.utilities.validate_headers, head, flags)
            ours = _verdict(h2session._validate_headers, head, flags)
            assert ours == theirs, (kind, head)
            if isinstance(theirs, tuple):
                verdicts["refused"] += 1
            else:
                copy = list(head)
                verdicts["same list"] += h2session._validate_headers(copy, flags) is copy
    assert verdicts["refused"] > 5_000 and verdicts["same list"] > 5_000, verdicts


def test_the_events_the_session_reads_by_exact_type_have_no_subclasses() -> None:
    """`H2Session.receive` tells `h2`'s events apart by exact type: a subclass of one
    (in a later `h2`) would be dropped as an event it ignores."""
    import h2.events

    for cls in (h2.events.DataReceived, h2.events.RequestReceived,
                h2.events.ResponseReceived, h2.events.StreamEnded,
                h2.events.TrailersReceived, h2.events.StreamReset, h2.events.WindowUpdated,
                h2.events.RemoteSettingsChanged, h2.events.PingReceived,
                h2.events.ConnectionTerminated):
        assert cls.__subclasses__() == [], cls


def test_peer_max_streams_follows_the_peers_settings() -> None:
    """The upstream side's `peer_max_streams` (the pool's room on a connection) is the
    peer's SETTINGS_MAX_CONCURRENT_STREAMS as each SETTINGS frame arrives, and `h2`'s
    unlimited default before the first."""
    backend = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False,
                                                                   header_encoding=None))
    up = H2Session(client_side=True)
    assert up.peer_max_streams == int(up.conn.remote_settings.max_concurrent_streams)
    assert up.peer_max_streams > 1000
    up.start()
    backend.initiate_connection()
    backend.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 3})
    up.receive(backend.data_to_send())
    assert up.peer_max_streams == 3
    backend.receive_data(up.data_to_send())
    backend.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 7})
    up.receive(backend.data_to_send())
    assert up.peer_max_streams == 7



def test_grpc_timeout_goes_as_a_literal_without_indexing() -> None:
    """`grpc-timeout` (a new value with every call) is sent as a literal without indexing:
    the peer reads every head as sent, and the table keeps only the fields that repeat
    (indexed once, then one byte each), where each timeout took an entry before."""
    from nodeagent.http import h2session

    encoder, decoder = h2session._PlainEncoder(), hpack.Decoder()
    fixed = [(b":method", b"POST"), (b":path", b"/svc/Call"), (b"user-agent", b"grpc/1.0"),
             (b"content-type", b"application/grpc")]
    sizes = []
    for call in range(300):
        head = [*fixed, (b"grpc-timeout", b"%du" % (29_999_000 - call))]
        block = encoder.encode(head)
        assert [tuple(h) for h in decoder.decode(block, raw=True)] == head
        assert b"\x00\x0cgrpc-timeout\x09" + head[-1][1] in block  # §6.2.2, new name
        sizes.append(len(block))
    assert [n for n, _ in encoder.header_table.dynamic_entries] == [
        b"content-type", b"user-agent", b":path"]
    assert sizes[-1] == sizes[1] == 4 + 1 + 1 + 12 + 1 + 9  # four indexed, the literal
    # A sensitive one stays never indexed (§6.2.3), as hpack sends it.
    block = encoder.encode([(b"grpc-timeout", b"1S", True)])
    assert block.startswith(b"\x10\x0cgrpc-timeout")
