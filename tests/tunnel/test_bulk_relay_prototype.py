"""scripts.bench.bulk_parity's prototypes do the work docs/performance.md says they do, so
its figures are of working relays: the C per-read path (`bulk_relay.c`, as a program and
as a library under trio) moves a stream's bytes intact both ways, at once, with the
tunnel's windows smaller than the transfer; and
the measuring-only TLS 1.3 suite choice (ctypes, CPython 3.11's layout) really changes the
suite a handshake negotiates."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
import sys
import threading
from pathlib import Path

import pytest

from scripts.bench.splice_bulk import Pair, _certs, set_tls13_ciphersuites

HEADERS = Path("/usr/include/openssl/ssl.h")


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext) -> str:
    """A TLS handshake between two contexts over memory BIOs; the negotiated suite."""
    bios = [ssl.MemoryBIO() for _ in range(4)]
    server = server_ctx.wrap_bio(bios[0], bios[1], server_side=True)
    client = client_ctx.wrap_bio(bios[2], bios[3], server_hostname="localhost")
    for _ in range(10):
        for obj in (client, server):
            try:
                obj.do_handshake()
            except ssl.SSLWantReadError:
                pass
        bios[0].write(bios[3].read())
        bios[2].write(bios[1].read())
    cipher = client.cipher()
    assert cipher is not None
    return cipher[0]


def _contexts(tmp_path: Path) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    _certs(tmp_path)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    client = ssl.create_default_context(cafile=tmp_path / "cert.pem")
    return server, client


def test_the_tunnel_negotiates_aes_256_gcm_unless_the_bench_sets_the_suites(
        tmp_path: Path) -> None:
    server, client = _contexts(tmp_path)
    assert _handshake(server, client) == "TLS_AES_256_GCM_SHA384"
    set_tls13_ciphersuites(server, "TLS_AES_128_GCM_SHA256")
    set_tls13_ciphersuites(client, "TLS_AES_128_GCM_SHA256")
    assert _handshake(server, client) == "TLS_AES_128_GCM_SHA256"
    with pytest.raises(ValueError, match="refused"):
        set_tls13_ciphersuites(client, "TLS_NO_SUCH_SUITE")


def _pump(sock: socket.socket, data: bytes, got: list[bytes]) -> None:
    """Send `data` and half-close while a thread reads all the peer sends."""
    def read() -> None:
        chunks = []
        while chunk := sock.recv(1 << 20):
            chunks.append(chunk)
        got.append(b"".join(chunks))
    reader = threading.Thread(target=read)
    reader.start()
    view = memoryview(data)
    while view:
        # Odd sizes: reads that do not line up with frames or TLS records.
        view = view[sock.send(view[:77_777]):]
    sock.shutdown(socket.SHUT_WR)
    reader.join(timeout=120)
    assert not reader.is_alive()


@pytest.mark.slow
@pytest.mark.needs("gcc")
@pytest.mark.skipif(not HEADERS.exists(), reason="needs libssl-dev (OpenSSL's headers)")
@pytest.mark.parametrize(("driver", "suites"), [("program", ""),
                                               ("program", "TLS_AES_128_GCM_SHA256"),
                                               ("trio", "")])
def test_the_c_relay_moves_both_directions_intact(tmp_path: Path, driver: str,
                                                  suites: str) -> None:
    """`program`: bulk_relay's own poll loop; `trio`: the library under a trio loop."""
    from scripts.bench import bulk_parity

    relay = bulk_parity.build_relay(tmp_path)
    (tmp_path / "certs").mkdir()
    _certs(tmp_path / "certs")
    command = [str(relay)] if driver == "program" else [
        sys.executable, "-P", bulk_parity.__file__, "--trio-endpoint",
        str(tmp_path / "bulk_relay.so")]
    pair = Pair(None, tmp_path / "certs", command=command,
                env={"BULK_CIPHERSUITES": suites, "PYTHONPATH": str(bulk_parity.ROOT)})
    try:
        # Streams one after another on one tunnel (a new one once the last has ended at
        # both ends): a stream ending early, cutting the other way short, showed in about
        # one in six.
        for _ in range(6):
            # 9 MiB each way at once: more than a stream's 2 MiB window and the
            # connection's 8 MiB, so credit has to come back in WINDOW frames.
            up, down = os.urandom(9 << 20), os.urandom(9 << 20)
            client = socket.create_connection(("127.0.0.1", pair.up_port), timeout=120)
            pair.sink.settimeout(30)
            target, _ = pair.sink.accept()
            target.settimeout(120)
            at_target: list[bytes] = []
            at_client: list[bytes] = []
            thread = threading.Thread(target=_pump, args=(target, down, at_target))
            thread.start()
            _pump(client, up, at_client)
            thread.join(timeout=120)
            client.close()
            target.close()
            assert len(at_target) == 1 and len(at_client) == 1
            assert hashlib.sha256(at_target[0]).digest() == hashlib.sha256(up).digest()
            assert hashlib.sha256(at_client[0]).digest() == hashlib.sha256(down).digest()
    finally:
        pair.close()
