"""The single stream's per-read work, counted: a tunnel read's frames for one socket go
out in one sendmsg; a socket waited on for writability alone is not read; a splice loop
round's 256 KiB goes out from the loop itself, and after a full read the loop looks
before it waits; TLS encrypts the frames where they lie, in the records a join would
make. Each with real sockets and every byte checked (`scripts.bench.splice_bulk
--syscalls` measures the same per 128 MiB)."""

from __future__ import annotations

import hashlib
import os
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest
import trio

from nodeagent.testing import memtls
from nodeagent.trust import pki
from tests.tunnel import test_endpoint
from tests.tunnel.test_endpoint import T, linked
from tests.tunnel.test_spliceloop import recv_exactly, send_then_eof, tcp_pairs
from tunnel.endpoint import IncomingStream
from tunnel.relay import relay_incoming
from tunnel.splice import SpliceResult
from tunnel.spliceloop import CHUNK
from tunnel.stream import TunnelStream
from tunnel.transports import tls as tls_module

FRAME = 64 * 1024  # the default max_frame_size: one DATA frame's payload at most


# ------------------------------------------------------------------ counting socket calls


@contextmanager
def counting(monkeypatch: pytest.MonkeyPatch, peer: tuple[str, int]
             ) -> Iterator[dict[str, list[int]]]:
    """Calls of socket.socket's send, sendmsg and recv_into on the socket whose peer is
    `peer` (the relay's end of a target connection): per call, the bytes (send,
    recv_into) or the number of buffers (sendmsg)."""
    calls: dict[str, list[int]] = {"send": [], "sendmsg": [], "recv_into": []}
    send, sendmsg, recv_into = socket.socket.send, socket.socket.sendmsg, \
        socket.socket.recv_into

    def ours(sock: socket.socket) -> bool:
        try:
            return bool(sock.getpeername() == peer)
        except OSError:
            return False

    def counted_send(self: socket.socket, data: Any, *args: Any) -> int:
        if ours(self):
            calls["send"].append(len(data))
        return send(self, data, *args)

    def counted_sendmsg(self: socket.socket, buffers: Any, *args: Any) -> int:
        buffers = list(buffers)
        if ours(self):
            calls["sendmsg"].append(len(buffers))
        return sendmsg(self, buffers, *args)

    def counted_recv_into(self: socket.socket, buffer: Any, *args: Any) -> int:
        if ours(self):
            calls["recv_into"].append(len(buffer))
        return recv_into(self, buffer, *args)

    monkeypatch.setattr(socket.socket, "send", counted_send)
    monkeypatch.setattr(socket.socket, "sendmsg", counted_sendmsg)
    monkeypatch.setattr(socket.socket, "recv_into", counted_recv_into)
    yield calls


@asynccontextmanager
async def relayed(*, small_buffers: bool = False, buffers: int = 4096
                  ) -> AsyncIterator[tuple[TunnelStream, socket.socket, list[SpliceResult]]]:
    """A linked pair whose acceptor hands its one stream over to a real TCP target (the
    agent's way); yields (the dialer's stream, the target's non-blocking socket, the
    splice's result once it ended). `small_buffers`: the kernel buffers between the
    relay and the target shrunk to `buffers`, so a write that does not fit is soon
    felt."""
    results: list[SpliceResult] = []
    targets: list[socket.socket] = []
    with tcp_pairs() as made:
        async def handler(incoming: IncomingStream) -> None:
            async def open_target() -> trio.abc.HalfCloseableStream:
                listener = socket.create_server(("127.0.0.1", 0))
                relay = socket.socket()
                if small_buffers:
                    relay.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffers)
                relay.connect(listener.getsockname())
                relay.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as dialed
                target, _ = listener.accept()
                listener.close()
                if small_buffers:
                    target.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffers)
                target.setblocking(False)
                made.append(target)
                targets.append(target)
                return trio.SocketStream(trio.socket.from_stdlib_socket(relay))

            await relay_incoming(incoming, open_target, on_finished=results.append)

        async with linked(acceptor_handler=handler) as link:
            stream = await link.dialer.open_stream(T)
            await stream.send_all(b"go")
            assert await recv_exactly(targets[0], 2) == b"go"
            yield stream, targets[0], results


async def drain(sock: socket.socket, size: int, *, chunk: int = 1024 * 1024,
                pause: float = 0.0) -> bytes:
    """`size` bytes from a non-blocking socket, `chunk` at a time, sleeping `pause`
    between reads (a slow reader)."""
    data = bytearray()
    with trio.fail_after(60):
        while len(data) < size:
            await trio.lowlevel.wait_readable(sock)
            got = sock.recv(min(chunk, size - len(data)))
            assert got, f"EOF after {len(data)} of {size} bytes"
            data += got
            if pause:
                await trio.sleep(pause)
    return bytes(data)


# ------------------------------------------------------------------ tunnel → socket


async def test_a_reads_frames_for_one_socket_go_out_together(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The frames of one tunnel read reach the target in one sendmsg, not a send each:
    far fewer calls than frames, and every byte in order."""
    payload = os.urandom(16 * FRAME)
    async with relayed() as (stream, target, _):
        with counting(monkeypatch, target.getsockname()) as calls:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.send_all, payload)
                got = await drain(target, len(payload))
    assert got == payload
    writes = len(calls["send"]) + len(calls["sendmsg"])
    # 16 frames: the memory transport's reads hold 3-4 each, so 4-6 writes; a send
    # per frame would be 16.
    assert writes <= 8, calls
    assert calls["sendmsg"] and max(calls["sendmsg"]) >= 3, calls


async def test_small_frames_are_written_at_once_not_batched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames under spliceloop._BATCH_FROM (requests, responses) go to the socket as
    they come, a send each, as before the batching (whose deque and second call cost a
    request/response more); every byte in order."""
    pieces = [os.urandom(1024) for _ in range(24)]
    async with relayed() as (stream, target, _):
        with counting(monkeypatch, target.getsockname()) as calls:
            async with trio.open_nursery() as nursery:
                async def send() -> None:
                    for piece in pieces:
                        await stream.send_all(piece)
                nursery.start_soon(send)
                got = await drain(target, 24 * 1024)
    assert got == b"".join(pieces)
    assert calls["sendmsg"] == [], calls
    assert len(calls["send"]) == 24, calls


async def test_many_tiny_frames_behind_a_full_socket_arrive_whole_and_in_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A target that does not read while thousands of frames queue for it (more than a
    sendmsg takes: IOV_MAX buffers): once it reads, every byte arrives in order, the
    queue written 1,024 buffers at a time; the sender stopped at the stream's window."""
    big = os.urandom(512 * 1024)
    tiny = [b"%07d," % i for i in range(3000)]
    expected = big + b"".join(tiny)
    async with relayed(small_buffers=True, buffers=16384) as (stream, target, _):
        with counting(monkeypatch, target.getsockname()) as calls:
            await stream.send_all(big)  # more than the kernel buffers take
            for piece in tiny:  # a frame each
                await stream.send_all(piece)
            await trio.sleep(0.2)  # all delivered to the splice, waiting for the socket
            got = await drain(target, len(expected), chunk=4096)
    assert got == expected
    assert max(calls["sendmsg"]) == 1024, max(calls["sendmsg"])


async def test_a_socket_written_to_is_not_read_on_writability_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A slow target that never sends: the loop waits on its socket for writability
    again and again (small buffers) while it also waits for input; it writes when
    writable and never tries a read that could only fail (EAGAIN)."""
    payload = os.urandom(4 * 1024 * 1024)
    async with relayed(small_buffers=True, buffers=65536) as (stream, target, _):
        with counting(monkeypatch, target.getsockname()) as calls:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.send_all, payload)
                got = await drain(target, len(payload), chunk=32768, pause=0.001)
    assert got == payload
    # Many writes the socket cut short (each then waited for writability)...
    assert len(calls["send"]) + len(calls["sendmsg"]) > 20, calls
    # ...and not one read: the target sent nothing.
    assert calls["recv_into"] == []


@pytest.mark.parametrize("wire", ["memory", "tls"])
async def test_frames_lent_by_the_reader_are_written_in_place_and_kept_as_copies(
        monkeypatch: pytest.MonkeyPatch, wire: str) -> None:
    """Over TLS the reader decrypts into one buffer of the process and lends the DATA
    payloads as views of it: the batch goes to the socket from there (sendmsg of views,
    no copy per frame), and what a slow target's socket did not take is copied before
    the next read overwrites the buffer: every byte arrives, in order."""
    monkeypatch.setattr(test_endpoint, "_WIRE", wire)
    payload = os.urandom(8 * 1024 * 1024)
    kinds: set[type] = set()
    sendmsg = socket.socket.sendmsg

    def recording(self: socket.socket, buffers: Any, *args: Any) -> int:
        buffers = list(buffers)
        kinds.update(type(b) for b in buffers)
        return sendmsg(self, buffers, *args)

    async with relayed(small_buffers=True, buffers=65536) as (stream, target, _):
        monkeypatch.setattr(socket.socket, "sendmsg", recording)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.send_all, payload)
            got = await drain(target, len(payload), chunk=65536, pause=0.0005)
    assert got == payload
    if wire == "tls":
        assert memoryview in kinds, kinds


# ------------------------------------------------------------------ socket → tunnel


async def test_a_loop_rounds_bulk_goes_out_from_the_loop_and_it_looks_before_it_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over TLS, a target sending bulk: the loop's rounds (256 KiB reads) are encrypted
    and written by the loop itself (send_pieces_nowait of more than 64 KiB, no writer
    wake-up), and after a full read it polls its sockets before it waits in trio (far
    fewer waits than full reads); every byte arrives."""
    monkeypatch.setattr(test_endpoint, "_WIRE", "tls")
    nowait_sizes: list[int] = []
    nowait = tls_module.TLSStream.send_pieces_nowait

    def counted(self: tls_module.TLSStream, pieces: list[Any]) -> bool:
        nowait_sizes.append(sum(map(len, pieces)))
        return nowait(self, pieces)

    monkeypatch.setattr(tls_module.TLSStream, "send_pieces_nowait", counted)
    loop_waits = 0
    wait_readable = trio.lowlevel.wait_readable

    async def counted_wait(fd: Any) -> None:
        nonlocal loop_waits
        if isinstance(fd, int):  # the splice loop waits on its epoll descriptor
            loop_waits += 1
        await wait_readable(fd)

    payload = os.urandom(16 * 1024 * 1024)
    async with relayed() as (stream, target, _):
        target.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * 1024 * 1024)
        with counting(monkeypatch, target.getsockname()) as calls:
            monkeypatch.setattr(trio.lowlevel, "wait_readable", counted_wait)
            got = hashlib.sha256()
            size = 0
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_then_eof, target, memoryview(payload), 0,
                                   4 * 1024 * 1024)
                with trio.fail_after(60):
                    while chunk := await stream.receive_some():
                        got.update(chunk)
                        size += len(chunk)
            monkeypatch.setattr(trio.lowlevel, "wait_readable", wait_readable)
    assert size == len(payload) and got.digest() == hashlib.sha256(payload).digest()
    assert max(nowait_sizes) > 64 * 1024, max(nowait_sizes)
    full_reads = sum(1 for n in calls["recv_into"] if n == CHUNK)
    assert full_reads >= 32
    # A wait per round would be one per full read (66 for 67 reads here); looking first,
    # 5-16 in runs on a 2-core machine.
    assert loop_waits <= full_reads // 2, (loop_waits, full_reads)


# ------------------------------------------------------------------ TLS records


def _tls_pair() -> memtls.MemoryTLS:
    """A client and a server end in memory, handshake done."""
    ca = pki.create_ca("records CA")
    cert = pki.issue_server_certificate(ca, ["localhost"], [])
    return memtls.handshake(pki.server_ssl_context(cert.certificate_pem, cert.key_pem),
                            pki.client_ssl_context(ca.certificate_pem))


def _records(wire: bytes) -> list[int]:
    """The lengths of the TLS records in `wire` (application data, all whole)."""
    lengths = []
    i = 0
    while i < len(wire):
        assert wire[i] == 23, wire[i]  # application_data
        size = int.from_bytes(wire[i + 3:i + 5], "big")
        lengths.append(size)
        i += 5 + size
    assert i == len(wire)
    return lengths


@pytest.mark.parametrize("sizes", [
    [9, FRAME, 9, FRAME, 9, FRAME, 9, FRAME],  # a splice round's four DATA frames
    [9, 100, 9, 17, 9, 3, 5000],  # small frames: one record, as the join made
    [16384, 16384, 1, 16383, 40000, 9, 9, 9, 200_000, 7],
    [9, FRAME - 7, 9, 16375, 9, 1],
])
def test_pieces_are_encrypted_in_the_records_a_join_makes(sizes: list[int]) -> None:
    pieces: list[bytes | bytearray | memoryview] = []
    for i, size in enumerate(sizes):
        data = os.urandom(size)
        pieces.append(data if i % 3 == 0 else memoryview(data) if i % 3 == 1
                      else bytearray(data))
    joined = b"".join(pieces)
    tls = _tls_pair()
    tls.client.write(joined)
    by_join = tls.client_out.read()
    tls_module._encrypt_pieces(tls.client.write, list(pieces))
    by_pieces = tls.client_out.read()
    assert _records(by_pieces) == _records(by_join)
    tls.server_in.write(by_join + by_pieces)
    plain = bytearray()
    while len(plain) < 2 * len(joined):
        plain += tls.server.read(1024 * 1024)
    assert bytes(plain) == joined + joined
