"""TLS for the tunnel: `TLSStream`, a trio Stream built for bulk transfer, and the phrasing
of native network errors (`describe_error`, `is_tls_error`) shared by every transport.

`TLSStream` replaces trio.SSLStream on the tunnel's sockets because trio's hands out one
16 KiB record per `receive_some`, with a scheduler round trip each: most of its CPU cost
in bulk. It passes trio's own stream conformance check, `trio.testing.check_two_way_stream`
(tests/tunnel/test_transport_conformance.py).
"""

from __future__ import annotations

import contextlib
import copy
import operator
import os
import ssl
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import trio

from tunnel.buffers import SharedBuffer
from tunnel.transports.base import STREAM_RECEIVE_SIZE

__all__ = ["TLS_RECORD_SIZE", "TLSStream", "describe_error", "is_tls_error"]


def describe_error(exc: BaseException | None) -> str:
    """A short human phrase for a native network error (for messages and logs)."""
    if exc is None:
        return "unknown error"
    if isinstance(exc, trio.BrokenResourceError) and exc.__cause__ is not None:
        return describe_error(exc.__cause__)
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"tls: certificate verify failed: {exc.verify_message}"
    if isinstance(exc, ssl.SSLError):
        return f"tls: {exc.reason or exc}".lower() if exc.reason else f"tls: {exc}"
    if isinstance(exc, ConnectionResetError):
        return "connection reset by peer"
    if isinstance(exc, BrokenPipeError):
        return "broken pipe"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def is_tls_error(exc: BaseException | None) -> bool:
    """Whether a native error (or what caused it) came from TLS."""
    while exc is not None:
        if isinstance(exc, ssl.SSLError):
            return True
        exc = exc.__cause__
    return False


def _detached(exc: BaseException, depth: int = 0) -> BaseException:
    """A copy of `exc` with no traceback (its causes copied the same way), to keep. A
    copy is a new object built from the args and `__dict__`: it has no traceback and no
    context of its own; only the cause is carried over, itself detached."""
    try:
        copied = copy.copy(exc)
    except Exception:  # a type whose args cannot rebuild it
        copied = None
    if not isinstance(copied, BaseException) or copied is exc:
        copied = trio.BrokenResourceError(f"{type(exc).__name__}: {describe_error(exc)}")
    cause = exc.__cause__
    copied.__cause__ = _detached(cause, depth + 1) if cause is not None and depth < 3 else None
    return copied


TLS_RECORD_SIZE = 16 * 1024  # largest TLS record payload
_TLS_WRITE_CHUNK = 256 * 1024  # encrypt at most this much before sending it
# What a socket read lands in before the BIO copies it (see tunnel.buffers), and what
# receive_shared() decrypts into, valid until the next receive_shared() of any TLSStream.
_READ_BUFFER = SharedBuffer(STREAM_RECEIVE_SIZE)
_PLAIN_BUFFER = SharedBuffer(STREAM_RECEIVE_SIZE)


def _encrypt_pieces(write: Callable[[bytes | bytearray | memoryview], int],
                    pieces: Iterable[bytes | bytearray | memoryview]) -> None:
    """`write` (SSLObject.write: a record per TLS_RECORD_SIZE, then one for the rest)
    the concatenation of `pieces` in the records one write of their join would make,
    without the join: whole records straight from a piece, pieces shorter than a record
    gathered (joined) into one."""
    run: list[bytes | bytearray | memoryview] = []  # less than a record, to be joined
    run_size = 0
    for piece in pieces:
        size = len(piece)
        if run_size + size < TLS_RECORD_SIZE:
            run.append(piece)
            run_size += size
            continue
        view = memoryview(piece)
        offset = 0
        if run:  # the run and the piece's head make a record
            offset = TLS_RECORD_SIZE - run_size
            run.append(view[:offset])
            write(b"".join(run))
            run = []
            run_size = 0
        whole = (size - offset) // TLS_RECORD_SIZE * TLS_RECORD_SIZE
        if whole:
            write(view[offset:offset + whole])
            offset += whole
        if offset < size:
            run.append(view[offset:])
            run_size = size - offset
    if run:
        write(run[0] if len(run) == 1 else b"".join(run))


class TLSStream(trio.abc.Stream):
    """TLS over a byte stream (the tunnel's TCP socket), built for bulk transfer.

    Like trio.SSLStream it runs an `ssl.SSLObject` over memory BIOs, but it reads the
    socket in large chunks and returns every complete record already received in one
    `receive_some` (a TLS record holds at most 16 KiB, and trio.SSLStream hands them out
    one at a time, with a scheduler round trip each — most of its CPU cost in bulk).
    Renegotiation is not supported (the contexts disable it); the handshake is done
    explicitly, once, before the stream is shared between tasks; after it, one task may
    receive while another sends (a second receiver or sender gets BusyResourceError).
    """

    def __init__(self, transport_stream: trio.abc.Stream, ssl_context: ssl.SSLContext, *,
                 server_side: bool = False, server_hostname: str | None = None,
                 receive_size: int = STREAM_RECEIVE_SIZE) -> None:
        self.transport_stream = transport_stream
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self.ssl_object = ssl_context.wrap_bio(self._incoming, self._outgoing,
                                               server_side=server_side,
                                               server_hostname=server_hostname)
        self._receive_size = receive_size
        # The last socket read took all there was (less than asked): the next one waits
        # for readability first (see _read_raw_socket).
        self._drained = False
        # One writer to the socket at a time; whoever holds it sends all queued output.
        self._out_lock = trio.StrictFIFOLock()
        self._handshake_done = False
        self._failed: BaseException | None = None
        self._closed = False
        self._zero_return = False
        # Called before each read from the socket (tunnel.dial uses it to notice that the
        # server's post-handshake flight was processed).
        self.on_receive: Callable[[], None] | None = None
        # One task in receive_some, one in send_all/wait_send_all_might_not_block at a
        # time (trio's Stream contract: a second one gets BusyResourceError).
        self._receiving = False
        self._sending = False
        # Encrypted bytes send_nowait() could not write at once: they go first on the
        # next flush (the TLS records are whole in here, so nothing is ever half-sent).
        # A view of what the BIO gave: the rest of a bulk write is not copied.
        self._unsent: bytes | memoryview = b""

    # Attributes people look at after the handshake.
    def getpeercert(self, binary_form: bool = False) -> Any:
        return self.ssl_object.getpeercert(binary_form)

    def version(self) -> str | None:
        return self.ssl_object.version()

    def cipher(self) -> tuple[str, str, int] | None:
        return self.ssl_object.cipher()

    def selected_alpn_protocol(self) -> str | None:
        return self.ssl_object.selected_alpn_protocol()

    def _check(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("TLS stream is closed")
        if self._failed is not None:
            raise trio.BrokenResourceError("TLS stream is broken") from self._failed

    def _remember_failure(self, exc: BaseException) -> None:
        # A copy without traceback: the traceback's frames hold this stream (`self`), so
        # keeping `exc` itself made a reference cycle, and every broken connection's TLS
        # buffers (its BIOs, ~0.5 MB under bulk) waited for a full GC collection, which
        # a quiet agent makes a few times an hour: the soak's agent grew by that much per
        # path flap until one came.
        if self._failed is None:
            self._failed = _detached(exc)

    def _fail(self, exc: BaseException) -> trio.BrokenResourceError:
        self._remember_failure(exc)
        err = trio.BrokenResourceError(describe_error(exc))
        err.__cause__ = exc
        return err

    async def _flush_locked(self) -> None:
        if self._unsent:
            data, self._unsent = self._unsent, b""
            try:
                await self.transport_stream.send_all(data)
            except BaseException as exc:
                self._remember_failure(exc)
                raise
        while self._outgoing.pending:
            data = self._outgoing.read()
            try:
                await self.transport_stream.send_all(data)
            except BaseException as exc:
                # A partial record on the wire: nothing more can be sent.
                self._remember_failure(exc)
                raise

    async def _flush_if_idle(self) -> None:
        """Send what reading produced (alerts, key updates) unless a sender is busy; it
        sends everything queued before it lets go of the lock. Not while send_nowait()
        left bytes: those are the sender's to flush (after them, these), and a reader
        blocked writing bulk would stop reading (two such peers deadlock)."""
        if self._outgoing.pending and not self._unsent and not self._out_lock.locked():
            async with self._out_lock:
                await self._flush_locked()

    async def _read_socket(self) -> None:
        if self.on_receive is not None:
            self.on_receive()
        stream = self.transport_stream
        if isinstance(stream, trio.SocketStream):
            await self._read_raw_socket(stream.socket)
            return
        data = await stream.receive_some(self._receive_size)
        if data:
            self._incoming.write(data)
        else:
            self._incoming.write_eof()

    async def _read_raw_socket(self, sock: trio.socket.SocketType) -> None:
        """One read of the socket into the shared buffer, copied into the BIO before
        anything else runs; a checkpoint, as trio's receive_some is. After a read that
        drained the socket it waits for readability before it reads: a read tried first
        there mostly fails (a syscall and an exception for EAGAIN, twice a connection's
        few frames), where after a full read more is likely waiting."""
        waited = False
        while True:
            fd = sock.fileno()
            if fd < 0:
                raise trio.ClosedResourceError("the socket was closed")
            if self._drained and not waited:
                await trio.lowlevel.wait_readable(sock)
                waited = True
                continue  # closed meanwhile? (the check above)
            try:
                size = os.readv(fd, (_READ_BUFFER.view(self._receive_size),))
                break
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                waited = True
            except OSError as exc:
                raise trio.BrokenResourceError(f"socket read failed: {exc}") from exc
        self._drained = size < self._receive_size
        if size:
            with _READ_BUFFER.view(size) as view:
                self._incoming.write(view)
        else:
            self._incoming.write_eof()
        if not waited:
            await trio.lowlevel.checkpoint()

    async def do_handshake(self) -> None:
        """The TLS handshake; raises trio.BrokenResourceError (cause: the ssl error)."""
        self._check()
        try:
            while True:
                try:
                    self.ssl_object.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    async with self._out_lock:
                        await self._flush_locked()
                    await self._read_socket()
        except ssl.SSLError as exc:
            # Tell the peer why (the engine queued an alert), briefly and best-effort.
            with trio.move_on_after(1), contextlib.suppress(Exception):
                async with self._out_lock:
                    await self._flush_locked()
            raise self._fail(exc) from exc
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise self._fail(exc) from exc
        async with self._out_lock:  # our last flight (and a server's session tickets)
            try:
                await self._flush_locked()
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise self._fail(exc) from exc
        self._handshake_done = True

    def _readable(self) -> bool:
        """Whether a read() of the engine may return something: a record (or part of
        one) waits in the incoming BIO, the BIO is at its EOF, or decrypted bytes wait.
        Otherwise read() would raise SSLWantReadError (~4 µs with its exception), twice a
        receive: before the socket read and after the last record. OpenSSL reads no
        further ahead than the record it decrypts (no read-ahead), so whole records wait
        in the BIO and a partial one needs the socket anyway."""
        incoming = self._incoming
        return bool(incoming.pending or incoming.eof or self.ssl_object.pending())

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this stream")
        self._receiving = True
        try:
            return await self._receive_some(max_bytes)
        finally:
            self._receiving = False

    async def _receive_some(self, max_bytes: int | None) -> bytes:
        self._check()
        if not self._handshake_done:
            raise RuntimeError("TLSStream: do_handshake() first")
        if max_bytes is None:
            max_bytes = self._receive_size
        else:
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError("max_bytes must be >= 1")
        if self._zero_return:
            await trio.lowlevel.checkpoint()
            return b""
        waited = False
        while True:
            if not self._readable():
                await self._flush_if_idle()
                await self._read_socket()
                waited = True
                continue
            try:
                first = self.ssl_object.read(min(max_bytes, TLS_RECORD_SIZE))
                if not first:  # Python reports the peer's close_notify as b""
                    self._zero_return = True
                break
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLZeroReturnError:
                # The peer's close_notify: a clean end.
                self._zero_return = True
                first = b""
                break
            except ssl.SSLError as exc:
                raise self._fail(exc) from exc
            await self._flush_if_idle()
            await self._read_socket()
            waited = True
        parts = [first]
        total = len(first)
        while first and total < max_bytes and self._readable():
            try:
                more = self.ssl_object.read(min(max_bytes - total, TLS_RECORD_SIZE))
            except ssl.SSLZeroReturnError:
                self._zero_return = True
                break
            except ssl.SSLError:
                break  # want-read, or an error the next call reports
            if not more:
                self._zero_return = True
                break
            parts.append(more)
            total += len(more)
        if self._outgoing.pending:
            await self._flush_if_idle()
        elif not waited:
            await trio.lowlevel.checkpoint()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def receive_shared(self, max_bytes: int) -> memoryview:
        """receive_some() without a bytes object per record and the join of them: the
        records are decrypted into one buffer of the process, returned as a view that is
        valid until the next receive_shared() of any TLSStream, so only for a caller that
        uses it before it awaits anything and copies what it keeps (the tunnel's reader:
        the protocol core copies each frame it hands out)."""
        if self._receiving:
            raise trio.BusyResourceError("another task is already receiving on this stream")
        self._receiving = True
        try:
            return await self._receive_shared(max_bytes)
        finally:
            self._receiving = False

    async def _receive_shared(self, max_bytes: int) -> memoryview:
        self._check()
        if not self._handshake_done:
            raise RuntimeError("TLSStream: do_handshake() first")
        if self._zero_return:
            await trio.lowlevel.checkpoint()
            return memoryview(b"")
        out = _PLAIN_BUFFER.view(max_bytes)
        # With a buffer, read() fills it and returns the count (typeshed says bytes).
        read = cast(Callable[[int, memoryview], int], self.ssl_object.read)
        # Nothing may run between filling the shared buffer and returning it: the
        # checkpoint is the socket read's (it always yields), before the fill.
        waited = False
        while True:
            if not self._readable():
                await self._flush_if_idle()
                await self._read_socket()
                waited = True
                continue
            try:
                size = read(min(max_bytes, TLS_RECORD_SIZE), out)
                if not size:  # the peer's close_notify
                    self._zero_return = True
                break
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLZeroReturnError:
                self._zero_return = True
                size = 0
                break
            except ssl.SSLError as exc:
                raise self._fail(exc) from exc
            await self._flush_if_idle()
            await self._read_socket()
            waited = True
        total = size
        while size and total < max_bytes and self._readable():
            try:
                size = read(min(max_bytes - total, TLS_RECORD_SIZE), out[total:])
            except ssl.SSLZeroReturnError:
                self._zero_return = True
                break
            except ssl.SSLError:
                break  # want-read, or an error the next call reports
            if not size:
                self._zero_return = True
                break
            total += size
        if self._outgoing.pending or not waited:
            # Rare: a key update's answer to flush, or records left from an earlier read
            # (no socket read, so no checkpoint yet): both await, so a copy is returned.
            kept = memoryview(out[:total].tobytes())
            if self._outgoing.pending:
                await self._flush_if_idle()
            else:
                await trio.lowlevel.checkpoint()
            return kept
        return out[:total]

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._sending_now():
            await self._send_all(data)

    @contextlib.contextmanager
    def _sending_now(self) -> Iterator[None]:
        if self._sending:
            raise trio.BusyResourceError("another task is already sending on this stream")
        self._sending = True
        try:
            yield
        finally:
            self._sending = False

    async def _send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._check()
        if not self._handshake_done:
            raise RuntimeError("TLSStream: do_handshake() first")
        view = memoryview(data).cast("B")
        if not len(view):
            if self._unsent:  # an empty send flushes what send_nowait() left
                async with self._out_lock:
                    await self._flush_locked()
            else:
                await trio.lowlevel.checkpoint()
            return
        async with self._out_lock:
            for offset in range(0, len(view), _TLS_WRITE_CHUNK):
                self._check()
                try:
                    self.ssl_object.write(view[offset:offset + _TLS_WRITE_CHUNK])
                except ssl.SSLError as exc:
                    raise self._fail(exc) from exc
                await self._flush_locked()

    async def send_pieces(self, pieces: list[bytes | memoryview]) -> None:
        """send_all() of the pieces' concatenation without joining them (see
        send_pieces_nowait): up to _TLS_WRITE_CHUNK at a time encrypted where it lies,
        then sent, as send_all() does. `pieces` is emptied as it goes: a group's buffers
        are let go before its encrypted bytes are taken out of the BIO."""
        with self._sending_now():
            self._check()
            if not self._handshake_done:
                raise RuntimeError("TLSStream: do_handshake() first")
            if not pieces:
                await self._send_all(b"")  # flushes what send_nowait() left
                return
            async with self._out_lock:
                start = size = 0
                last = len(pieces) - 1
                for i, piece in enumerate(pieces):
                    size += len(piece)
                    if size < _TLS_WRITE_CHUNK and i < last:
                        continue
                    self._check()
                    group = pieces[start:i + 1]
                    pieces[start:i + 1] = [b""] * len(group)
                    try:
                        _encrypt_pieces(self.ssl_object.write, group)
                    except ssl.SSLError as exc:
                        raise self._fail(exc) from exc
                    del group
                    start, size = i + 1, 0
                    await self._flush_locked()
                pieces.clear()

    def can_send_nowait(self) -> bool:
        """Whether send_nowait() may be called now: no send in progress or left over."""
        return (self._handshake_done and not self._sending and not self._closed
                and self._failed is None and not self._out_lock.locked()
                and not self._unsent and not self._outgoing.pending
                and isinstance(self.transport_stream, trio.SocketStream))

    def send_nowait(self, data: bytes | bytearray | memoryview) -> bool:
        """Encrypt all of `data` and write what the socket takes without blocking, in
        the calling task, with no scheduler round trip (only when can_send_nowait()).
        True: all of it is on the wire. False: the rest waits here, whole records, for
        the next send_all() (an empty one will do), which also reports any error. It
        never awaits, so a cancelled caller cannot leave a record half-written."""
        return self.send_pieces_nowait([data if isinstance(data, bytes) else memoryview(data)])

    def send_pieces_nowait(self, pieces: list[bytes | memoryview]) -> bool:
        """send_nowait() of the pieces' concatenation without joining them (the tunnel's
        frames: a header, then a payload that is a view of a read): each full record
        is encrypted from where its bytes lie, and only a record that spans pieces is
        assembled (at most 16 KiB copied per such record, where a join copied all and
        took a fresh buffer of that size per write, whose pages the C heap often had to
        fault in anew). The records are the join's: full ones, then the rest. `pieces`
        is emptied before the encrypted bytes are taken out of the BIO, so the buffers
        it held are free for that allocation to reuse."""
        sock = self.transport_stream
        assert isinstance(sock, trio.SocketStream) and self.can_send_nowait()
        try:
            _encrypt_pieces(self.ssl_object.write, pieces)
        except ssl.SSLError as exc:
            self._fail(exc)
            return False  # the next send_all() raises it
        finally:
            pieces.clear()
        out = self._outgoing.read()
        try:
            sent = os.write(sock.socket.fileno(), out)
        except OSError:  # would block, or broken: the next send_all() sees which
            sent = 0
        if sent < len(out):
            self._unsent = memoryview(out)[sent:]
            return False
        return True

    async def wait_send_all_might_not_block(self) -> None:
        with self._sending_now():
            await self.transport_stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        """Send close_notify (unless a send is in progress or the stream is broken), then
        close the socket. Does not wait for the peer's close_notify."""
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        try:
            if self._handshake_done and self._failed is None and not self._out_lock.locked():
                with contextlib.suppress(ssl.SSLError):
                    self.ssl_object.unwrap()
                async with self._out_lock:
                    with contextlib.suppress(trio.BrokenResourceError,
                                             trio.ClosedResourceError, OSError):
                        await self._flush_locked()
        finally:
            await self.transport_stream.aclose()
