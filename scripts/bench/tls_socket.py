"""The tunnel's TLS on an `ssl.SSLSocket` against its `TLSStream`, CPU per GB per side.

`TLSStream` runs an `ssl.SSLObject` over memory BIOs. A measured prototype, not product
code: `SocketTLSStream` below is `TLSStream` with its socket I/O handed to OpenSSL (a
non-blocking `SSLSocket` on the TCP socket's descriptor, records decrypted straight into
the shared plaintext buffer, `SSLWantWriteError` retried with the same bytes), so no
bytes cross a `MemoryBIO`. Two ways of running it:

    .venv/bin/python -m scripts.bench.tls_socket --rounds 8       # TLS alone, ~1 min
    .venv/bin/python -m scripts.bench.tls_socket --splice --rounds 4  # the tunnel, ~6 min

Without `--splice`: a sender process (`send_all` of 256 KiB) and a receiver process
(`receive_shared` of 1 MiB) over loopback, per variant and round (the order reversed
every other round): `bio` (TLSStream), `socket` (the prototype), `socket+ra` (OpenSSL's
read-ahead into a 256 KiB buffer: one read(2) per socket read instead of two per record;
Python's ssl has no API for it, so it is set through ctypes on the SSL*: measuring
only), `socket+ra+cork` (also TCP_CORK around a multi-record send, so 16 KiB records
leave as large segments). Each process reports its user and system CPU per GB
(getrusage); printed: per variant and side the median [min-max] and the ratio to `bio`
in the same round.

With `--splice`: `scripts.bench.splice_bulk`'s server and agent (its `Pair`), each round
once with TLSStream and once with the prototype (`--variant`, default `socket`), the
order alternating (ABBA), the prototype installed by a sitecustomize first on the
endpoints' PYTHONPATH; `--instructions` adds splice_bulk's callgrind count per MiB.
Prints each run, then one JSON object: per variant, direction and side the median
[min-max] and the ratios to TLSStream per round.
See docs/performance.md, "TLS on an `ssl.SSLSocket`, measured".
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import operator
import os
import resource
import select
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import trio

from tunnel.transports import tls as tls_module
from tunnel.transports.base import STREAM_RECEIVE_SIZE
from tunnel.transports.tls import TLS_RECORD_SIZE, TLSStream

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {"bio": {}, "socket": {}, "socket+ra": {"TLS_SOCKET_READ_AHEAD": "262144"},
            "socket+ra+cork": {"TLS_SOCKET_READ_AHEAD": "262144", "TLS_SOCKET_CORK": "1"}}
_WRITE_CHUNK = 256 * 1024


def _read_ahead(engine: Any, context: ssl.SSLContext, fd: int, size: int) -> None:
    """OpenSSL's read-ahead with a `size` read buffer on the SSL* under `engine` (an
    `_ssl._SSLSocket`): SSL_set_read_ahead and SSL_set_default_read_buffer_len, which
    Python's ssl does not expose. The SSL* is found at CPython 3.11's offset in the
    object and checked (its SSL_CTX and descriptor) before anything is set."""
    libssl = ctypes.CDLL("libssl.so.3")
    libssl.SSL_get_SSL_CTX.restype = ctypes.c_void_p
    libssl.SSL_get_SSL_CTX.argtypes = [ctypes.c_void_p]
    libssl.SSL_get_fd.argtypes = [ctypes.c_void_p]
    libssl.SSL_ctrl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
    libssl.SSL_ctrl.restype = ctypes.c_long
    libssl.SSL_set_default_read_buffer_len.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    ssl_ptr = ctypes.c_void_p.from_address(id(engine) + 24).value  # after Socket
    ctx_ptr = ctypes.c_void_p.from_address(id(context) + 16).value  # after the header
    if libssl.SSL_get_SSL_CTX(ssl_ptr) != ctx_ptr or libssl.SSL_get_fd(ssl_ptr) != fd:
        raise RuntimeError("not CPython 3.11's _ssl layout: no read-ahead")
    libssl.SSL_ctrl(ssl_ptr, 41, 1, None)  # SSL_CTRL_SET_READ_AHEAD
    libssl.SSL_set_default_read_buffer_len(ssl_ptr, size)


class SocketTLSStream(TLSStream):
    """TLSStream whose OpenSSL reads and writes the TCP socket itself.

    An `ssl.SSLSocket` on the same descriptor as trio's socket, non-blocking; trio's
    socket stays its one owner (closing it closes the connection), the SSLSocket is
    detached when this stream is closed or freed, never closed, and nothing touches the
    descriptor once trio's socket is closed (its number may be another file's by then).
    Same contract as TLSStream (the conformance test passes with it): one checkpoint per
    receive before the shared buffer is filled, close_notify on aclose (not under a
    cancelled scope), ragged EOFs are errors, a send cut short breaks the stream."""

    def __init__(self, transport_stream: trio.abc.Stream, ssl_context: ssl.SSLContext, *,
                 server_side: bool = False, server_hostname: str | None = None,
                 receive_size: int = STREAM_RECEIVE_SIZE) -> None:
        if not isinstance(transport_stream, trio.SocketStream):
            raise TypeError("SocketTLSStream needs a trio.SocketStream")
        super().__init__(transport_stream, ssl_context, server_side=server_side,
                         server_hostname=server_hostname, receive_size=receive_size)
        raw = transport_stream.socket
        plain = socket.socket(raw.family, raw.type, raw.proto, fileno=raw.fileno())
        plain.settimeout(0.0)
        try:
            sock = ssl_context.wrap_socket(
                plain, server_side=server_side, server_hostname=server_hostname,
                do_handshake_on_connect=False, suppress_ragged_eofs=False)
        except BaseException:
            plain.detach()
            raise
        self._detach: Callable[[], object] = weakref.finalize(self, sock.detach)
        self._sock, self._raw, self._fd = sock, raw, raw.fileno()
        self._engine: Any = cast(Any, sock)._sslobj  # read(n, buffer), write(), shutdown()
        self.ssl_object = cast(Any, sock)  # getpeercert, version, cipher, ALPN
        self._unwritten: bytes | memoryview = b""  # an SSL_write to finish, same bytes
        self._cork = os.environ.get("TLS_SOCKET_CORK") == "1"
        read_ahead = int(os.environ.get("TLS_SOCKET_READ_AHEAD", "0"))
        if read_ahead and self._engine is not None:
            _read_ahead(self._engine, ssl_context, self._fd, read_ahead)

    def _engine_now(self) -> Any:
        if self._raw.fileno() != self._fd:
            raise trio.ClosedResourceError("the socket was closed")
        if self._engine is None:  # it was not connected when it was wrapped
            raise self._fail(OSError("the socket is not connected"))
        return self._engine

    async def do_handshake(self) -> None:
        self._check()
        waited = False
        try:
            while True:
                try:
                    self._sock.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await trio.lowlevel.wait_readable(self._fd)
                except ssl.SSLWantWriteError:
                    await trio.lowlevel.wait_writable(self._fd)
                waited = True
        except (ssl.SSLError, trio.BrokenResourceError, trio.ClosedResourceError,
                OSError) as exc:
            raise self._fail(exc) from exc
        if not waited:
            await trio.lowlevel.checkpoint()
        self._handshake_done = True

    async def _read_into(self, out: memoryview, max_bytes: int) -> int:
        """Decrypt what the socket holds into `out`, after waiting for a record if there
        is none; 0 at the peer's close_notify. Its checkpoint comes before the fill."""
        self._check()
        if not self._handshake_done:
            raise RuntimeError("TLSStream: do_handshake() first")
        if self._zero_return:
            await trio.lowlevel.checkpoint()
            return 0
        await trio.lowlevel.checkpoint()
        engine = self._engine_now()
        if self.on_receive is not None and select.select([self._fd], [], [], 0)[0]:
            # TLSStream calls it before each socket read; OpenSSL's reads are not seen
            # here, so: a read of bytes already waiting, and below each wait for more
            # (tunnel.dial counts them to know that the server's first flight was
            # taken). Checked after the checkpoint: nothing of ours runs before the read.
            self.on_receive()
        total = 0
        while True:
            try:
                size: int = engine.read(max_bytes - total, out[total:])
            except ssl.SSLWantReadError:
                if total:
                    return total
                if self.on_receive is not None:
                    self.on_receive()
                await trio.lowlevel.wait_readable(self._fd)
                engine = self._engine_now()
                continue
            except ssl.SSLWantWriteError:  # reading made OpenSSL answer into a full socket
                if total:
                    return total
                try:
                    await trio.lowlevel.wait_writable(self._fd)
                except trio.BusyResourceError:  # a sender waits on it: it will drain
                    await trio.sleep(0.01)
                engine = self._engine_now()
                continue
            except ssl.SSLZeroReturnError:
                self._zero_return = True
                return total
            except (ssl.SSLError, OSError) as exc:
                if total:  # hand out what came before it; the next call raises it
                    self._remember_failure(exc)
                    return total
                raise self._fail(exc) from exc
            if not size:
                self._zero_return = True
                return total
            total += size
            if total >= max_bytes:
                return total

    async def _receive_some(self, max_bytes: int | None) -> bytes:
        size = self._receive_size if max_bytes is None else operator.index(max_bytes)
        if size < 1:
            raise ValueError("max_bytes must be >= 1")
        out = tls_module._PLAIN_BUFFER.view(size)
        return bytes(out[:await self._read_into(out, size)])

    async def _receive_shared(self, max_bytes: int) -> memoryview:
        out = tls_module._PLAIN_BUFFER.view(max_bytes)
        return out[:await self._read_into(out, max_bytes)]

    async def _write(self, data: bytes | memoryview) -> bool:
        """Encrypt and write all of `data`; whether it waited. Cut short (an error, a
        cancellation), a record may be half-sent: the stream is broken."""
        waited = False
        try:
            while True:
                try:
                    self._engine_now().write(data)
                    return waited
                except ssl.SSLWantWriteError:  # OpenSSL finishes with the same bytes
                    await trio.lowlevel.wait_writable(self._fd)
                    waited = True
        except (ssl.SSLError, OSError) as exc:
            raise self._fail(exc) from exc
        except BaseException as exc:
            self._remember_failure(exc)
            raise

    async def _send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._check()
        if not self._handshake_done:
            raise RuntimeError("TLSStream: do_handshake() first")
        view = memoryview(data).cast("B")
        async with self._out_lock:
            waited = False
            if self._unwritten:
                left, self._unwritten = self._unwritten, b""
                waited = await self._write(left)
            cork = self._cork and len(view) > TLS_RECORD_SIZE
            if cork:
                self._raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 1)
            try:
                for offset in range(0, len(view), _WRITE_CHUNK):
                    self._check()
                    if await self._write(view[offset:offset + _WRITE_CHUNK]):
                        waited = True
            finally:
                if cork and self._raw.fileno() == self._fd:
                    self._raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, 0)
            if not waited:
                await trio.lowlevel.checkpoint()

    def can_send_nowait(self) -> bool:
        return (self._handshake_done and not self._sending and not self._closed
                and self._failed is None and not self._out_lock.locked()
                and not self._unwritten)

    def send_nowait(self, data: bytes | bytearray | memoryview) -> bool:
        assert self.can_send_nowait()
        try:
            self._engine_now().write(data)
        except ssl.SSLWantWriteError:  # part written; the same bytes finish it later
            self._unwritten = bytes(data)
            return False
        except (ssl.SSLError, OSError, trio.ClosedResourceError) as exc:
            self._fail(exc)
            return False  # the next send_all() raises it
        return True

    async def aclose(self) -> None:
        if self._closed:
            await trio.lowlevel.checkpoint()
            return
        self._closed = True
        try:
            if (self._handshake_done and self._failed is None and not self._unwritten
                    and not self._out_lock.locked()):
                await trio.lowlevel.checkpoint_if_cancelled()  # forcefully: no goodbye
                with contextlib.suppress(ssl.SSLError, OSError, trio.ClosedResourceError):
                    while True:
                        try:
                            self._engine_now().shutdown()
                            break
                        except ssl.SSLWantReadError:  # sent; the peer's is not awaited
                            break
                        except ssl.SSLWantWriteError:
                            await trio.lowlevel.wait_writable(self._fd)
        finally:
            self._detach()
            await self.transport_stream.aclose()


class _Chooser(TLSStream):
    """What `install` puts in place of TLSStream: the prototype on a TCP socket,
    TLSStream on any other stream (the tests' memory pairs)."""

    def __new__(  # type: ignore[misc]
            cls, transport_stream: trio.abc.Stream, *args: Any, **kwargs: Any) -> TLSStream:
        if isinstance(transport_stream, trio.SocketStream):
            return SocketTLSStream(transport_stream, *args, **kwargs)
        return TLSStream(transport_stream, *args, **kwargs)


def install() -> None:
    """Make the prototype the TLSStream that `tunnel.transports` hands out in this
    process (the tunnel's dial and accept, splice_bulk's endpoints, the tests)."""
    import tunnel.transports
    tunnel.transports.TLSStream = _Chooser  # type: ignore[misc]


# ------------------------------------------------------------------ TLS alone


async def _receiver(port: int, certs: Path, cls: type[TLSStream]) -> None:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certs / "cert.pem", certs / "key.pem")
    listener = trio.socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    await listener.bind(("127.0.0.1", port))
    listener.listen()
    print("listening", flush=True)
    sock, _ = await listener.accept()
    tls = cls(trio.SocketStream(sock), ctx, server_side=True)
    await tls.do_handshake()
    total = 0
    before = resource.getrusage(resource.RUSAGE_SELF)
    while view := await tls.receive_shared(STREAM_RECEIVE_SIZE):
        total += len(view)
    _report(before, total)
    await tls.aclose()


async def _sender(port: int, certs: Path, cls: type[TLSStream], mib: int) -> None:
    ctx = ssl.create_default_context(cafile=certs / "cert.pem")
    tls = cls(await trio.open_tcp_stream("127.0.0.1", port), ctx,
              server_hostname="localhost")
    await tls.do_handshake()
    chunk = b"x" * _WRITE_CHUNK
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(mib * 1024 * 1024 // _WRITE_CHUNK):
        await tls.send_all(chunk)
    _report(before, mib * 1024 * 1024)
    await tls.aclose()


def _report(before: resource.struct_rusage, size: int) -> None:
    after = resource.getrusage(resource.RUSAGE_SELF)
    gb = size / 1e9
    print(json.dumps({"user": (after.ru_utime - before.ru_utime) / gb,
                      "sys": (after.ru_stime - before.ru_stime) / gb}), flush=True)


def _child(role: str, port: int, certs: Path, variant: str, mib: int) -> None:
    cls = TLSStream if variant == "bio" else SocketTLSStream
    if role == "receive":
        trio.run(_receiver, port, certs, cls)
    else:
        trio.run(_sender, port, certs, cls, mib)


def _run_pair(variant: str, certs: Path, mib: int) -> dict[str, dict[str, float]]:
    from scripts.bench.splice_bulk import _free_port
    port = _free_port()
    env = {**os.environ, **VARIANTS[variant], "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-P", "-m", "scripts.bench.tls_socket", "--child"]
    receiver = subprocess.Popen([*cmd, "receive", str(port), str(certs), variant, "0"],
                                env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert receiver.stdout is not None
    assert receiver.stdout.readline().strip() == "listening"
    sent = subprocess.run([*cmd, "send", str(port), str(certs), variant, str(mib)],
                          env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    received, _ = receiver.communicate(timeout=120)
    return {"send": json.loads(sent.stdout), "receive": json.loads(received)}


def _tls_alone(rounds: int, mib: int, variants: list[str]) -> None:
    from scripts.bench.splice_bulk import _certs
    runs: dict[str, list[dict[str, dict[str, float]]]] = {
        v: [] for v in ["bio", *(v for v in variants if v != "bio")]}
    with tempfile.TemporaryDirectory() as tmp:
        certs = Path(tmp)
        _certs(certs)
        for rnd in range(rounds):
            names = list(runs)  # the order reversed every other round
            for variant in names if rnd % 2 == 0 else names[::-1]:
                r = _run_pair(variant, certs, mib)
                runs[variant].append(r)
                print(f"round {rnd + 1} {variant:15} " + " ".join(
                    f"{side}: user={r[side]['user']:.3f} sys={r[side]['sys']:.3f}"
                    for side in ("send", "receive")), file=sys.stderr, flush=True)
    summary: dict[str, object] = {"load_average": os.getloadavg()}
    spread = _spread
    for variant, rs in runs.items():
        for side in ("send", "receive"):
            total = [r[side]["user"] + r[side]["sys"] for r in rs]
            entry = {"cpu_s_per_gb": spread(total),
                     "user": spread([r[side]["user"] for r in rs]),
                     "sys": spread([r[side]["sys"] for r in rs])}
            if variant != "bio":
                entry["ratio_to_bio"] = spread([
                    t / (b[side]["user"] + b[side]["sys"])
                    for t, b in zip(total, runs["bio"], strict=True)])
            summary[f"{variant} {side}"] = entry
    print(json.dumps(summary))


# ------------------------------------------------------------------ the tunnel


def _splice(variant: str, rounds: int, mib: int, instructions: bool) -> None:
    """splice_bulk's server and agent (its `Pair`), each round once with TLSStream and
    once with the prototype, in the order ABBA... (the first of a round ran slower in
    A/A checks): each endpoint's PYTHONPATH starts with a directory whose sitecustomize
    installs the prototype, or an empty one. The variant's settings are in the
    environment the endpoints inherit."""
    from scripts.bench.splice_bulk import BUF, Pair, _certs
    os.environ.update(VARIANTS[variant])
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        certs = Path(tmp, "certs")
        certs.mkdir()
        _certs(certs)
        trees = {"bio": Path(tmp, "bio"), variant: Path(tmp, "socket")}
        for tree in trees.values():
            tree.mkdir()
        (trees[variant] / "sitecustomize.py").write_text(
            "from scripts.bench.tls_socket import install\ninstall()\n")
        for rnd in range(rounds):
            order = list(trees.items())
            for name, tree in order if rnd % 2 == 0 else order[::-1]:
                grind = Path(tempfile.mkdtemp(dir=tmp)) if instructions else None
                pair = Pair(tree, certs, grind)
                try:
                    pair.transfer("up", (4 if grind else 64) * BUF)  # warm up
                    for direction in ("up", "down"):
                        r = pair.transfer(direction, mib * BUF)
                        runs.setdefault(f"{name} {direction}", []).append(r)
                        print(f"round {rnd + 1} {name:15} {direction:4} "
                              + " ".join(f"{k}={v:.3f}" for k, v in r.items()),
                              file=sys.stderr, flush=True)
                finally:
                    pair.close()
    summary: dict[str, object] = {"load_average": os.getloadavg()}
    for key, rs in runs.items():
        summary[key] = {k: _spread([r[k] for r in rs]) for k in rs[0]}
    ratios = {}
    for direction in ("up", "down"):
        proto, bio = runs[f"{variant} {direction}"], runs[f"bio {direction}"]
        for k in proto[0]:
            ratios[f"{direction} {k}"] = _spread(
                [a[k] / b[k] for a, b in zip(proto, bio, strict=True)])
    summary[f"{variant}/bio, per round (median, min, max)"] = ratios
    print(json.dumps(summary))


def _spread(xs: list[float]) -> list[float]:
    return [round(statistics.median(xs), 3), round(min(xs), 3), round(max(xs), 3)]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.tls_socket",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, help="MiB per transfer (256; with --splice "
                        "splice_bulk's 1024)")
    parser.add_argument("--splice", action="store_true",
                        help="splice_bulk's endpoints, TLSStream against one prototype")
    parser.add_argument("--variant", choices=[v for v in VARIANTS if v != "bio"],
                        action="append", help="which prototypes (default: all; with "
                        "--splice one, default socket)")
    parser.add_argument("--instructions", action="store_true",
                        help="with --splice: splice_bulk's callgrind count (use --mib 32)")
    args = parser.parse_args()
    variants = args.variant or [v for v in VARIANTS if v != "bio"]
    if args.splice:
        if args.variant is None:
            variants = ["socket"]
        if len(variants) != 1:
            parser.error("--splice compares one --variant with TLSStream")
        _splice(variants[0], args.rounds, args.mib or 1024, args.instructions)
    else:
        _tls_alone(args.rounds, args.mib or 256, variants)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        role, port, certdir, variant, mib = sys.argv[2:]
        _child(role, int(port), Path(certdir), variant, int(mib))
    else:
        main()
