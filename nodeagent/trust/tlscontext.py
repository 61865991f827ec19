"""TLS contexts from PEM files with the `ssl` module alone.

An agent or a server started from files needs TLS only to load a CA bundle, a certificate
and a key: `ssl` loads all of that itself. `cryptography` (pki.py) costs ~9 MiB of RSS at
start, so this path does not import it; pki's context functions convert their
certificate and key objects to PEM and come here.

Each unusable input raises TlsInputError saying which input and why, in the words pki
uses for the server side ("/x/ca.key: not a PEM certificate (it holds a private key)"),
decided from the PEM armour and from what OpenSSL refused.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

PemSource = bytes | str | os.PathLike[str]  # a path, or PEM text or bytes

_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
_PRIVATE_KEY = b"PRIVATE KEY-----"


class TlsInputError(ValueError):
    """A certificate, key or CA given for a TLS context that cannot be used.

    `which` says which input failed: "cert", "key", "ca", or "pair" (a certificate and a
    key that each load but do not belong together); `path` is its file, when it was one;
    the message says what is wrong in words ("/x/k.key: not a PEM private key"), so the
    caller only adds which config field named that input.
    """

    def __init__(self, which: str, problem: str, path: str | None = None) -> None:
        super().__init__(f"{path}: {problem}" if path else problem)
        self.which = which
        self.problem = problem
        self.path = path


def is_path(source: object) -> bool:
    if isinstance(source, str):
        return not source.lstrip().startswith("-----BEGIN")
    return isinstance(source, os.PathLike)


def input_bytes(source: PemSource, which: str) -> tuple[bytes, str | None]:
    """The PEM bytes of one input and its path (None for in-memory PEM)."""
    if isinstance(source, bytes):
        return source, None
    if not is_path(source):
        return str(source).encode(), None
    path = str(os.fspath(source))
    try:
        return Path(path).read_bytes(), path
    except FileNotFoundError:
        problem = "no such file"
    except PermissionError:
        problem = "permission denied (cannot read it)"
    except IsADirectoryError:
        problem = "is a directory, not a file"
    except OSError as exc:
        problem = (exc.strerror or str(exc)).lower()
    raise TlsInputError(which, problem, path)


def harden(ctx: ssl.SSLContext, alpn: Sequence[str] | None) -> None:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2  # 1.3 is negotiated whenever both can
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION
    # A TCP FIN without close_notify is a truncation, not a clean end. Some Python builds
    # (Debian's 3.11.2) set OP_IGNORE_UNEXPECTED_EOF by default, and TLS then reports a
    # cut connection as a clean EOF: always clear it.
    ctx.options &= ~ssl.OP_IGNORE_UNEXPECTED_EOF
    if alpn:
        ctx.set_alpn_protocols(list(alpn))


def _not_a_certificate(data: bytes) -> str:
    holds = " (it holds a private key)" if _PRIVATE_KEY in data else ""
    return f"not a PEM certificate{holds}"


def ca_text(ca: PemSource) -> str:
    """The PEM text of the CA bundle `ca` (one or more certificates), checked to load."""
    data, path = input_bytes(ca, "ca")
    if _CERTIFICATE not in data:
        raise TlsInputError("ca", _not_a_certificate(data), path)
    if not _loads_as_certificate(data):
        raise TlsInputError("ca", "not a PEM certificate", path)
    return data.decode("ascii")


def _key_problem(data: bytes) -> str | None:
    if _PRIVATE_KEY not in data:
        holds = " (it holds a certificate)" if _CERTIFICATE in data else ""
        return f"not a PEM private key{holds}"
    if b"ENCRYPTED" in data:  # PKCS#8 "ENCRYPTED PRIVATE KEY" or "Proc-Type: 4,ENCRYPTED"
        return "an encrypted private key; nodeagent needs it without a passphrase"
    return None


def load_chain(ctx: ssl.SSLContext, cert: PemSource, key: PemSource | None) -> None:
    """Present `cert` (a chain, leaf first) with `key` (None: the key is in `cert`'s
    file too)."""
    cert_data, cert_path = input_bytes(cert, "cert")
    key_data, key_path = input_bytes(key, "key") if key is not None else (cert_data, cert_path)
    if _CERTIFICATE not in cert_data:
        raise TlsInputError("cert", _not_a_certificate(cert_data), cert_path)
    if (problem := _key_problem(key_data)) is not None:
        raise TlsInputError("key", problem, key_path)
    with _as_files(cert, cert_data, key, key_data) as (cert_file, key_file):
        try:
            # The password callback: an encrypted key we did not recognise fails here
            # instead of prompting on the terminal.
            ctx.load_cert_chain(cert_file, key_file, password=lambda: b"")
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                names = [p for p in (cert_path, key_path if key is not None else None) if p]
                where = " and ".join(names)
                raise TlsInputError("pair", f"{where}: certificate and key do not match"
                                    if where else "certificate and key do not match"
                                    ) from None
            if not _loads_as_certificate(cert_data):
                raise TlsInputError("cert", "not a PEM certificate", cert_path) from None
            raise TlsInputError("key", "not a PEM private key", key_path) from None


def _loads_as_certificate(data: bytes) -> bool:
    try:
        ssl.create_default_context(cadata=data.decode("ascii"))
    except (ssl.SSLError, UnicodeDecodeError, ValueError):
        return False
    return True


@contextlib.contextmanager
def _as_files(cert: PemSource, cert_data: bytes, key: PemSource | None,
              key_data: bytes) -> Iterator[tuple[str, str | None]]:
    """ssl loads certificate chains only from files: the paths given, or in-memory PEM
    written to a private temporary directory that is removed straight after."""
    if is_path(cert) and (key is None or is_path(key)):
        yield os.fsdecode(cert), os.fsdecode(key) if key is not None else None
        return
    with tempfile.TemporaryDirectory(prefix="nodeagent-tls-") as tmp:  # mode 0700
        cert_file = os.path.join(tmp, "cert.pem")
        Path(cert_file).write_bytes(cert_data)
        key_file = os.path.join(tmp, "key.pem")
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(key_data)
        yield cert_file, key_file


def server_ssl_context(cert: PemSource, key: PemSource | None,
                       client_ca: PemSource | None = None, require_client_cert: bool = False,
                       *, alpn: Sequence[str] | None = None) -> ssl.SSLContext:
    """TLS 1.2+ server context. With `client_ca`, clients may present a certificate
    signed by it (verified; mutual TLS); `require_client_cert` makes that mandatory. An
    input that cannot be used raises TlsInputError saying which and why."""
    if require_client_cert and client_ca is None:
        raise ValueError("require_client_cert needs client_ca to verify clients against")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    harden(ctx, alpn)
    ctx.options |= ssl.OP_SINGLE_ECDH_USE | ssl.OP_CIPHER_SERVER_PREFERENCE
    load_chain(ctx, cert, key)
    if client_ca is not None:
        ctx.load_verify_locations(cadata=ca_text(client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_OPTIONAL
    # TLS 1.3 clients learn that their certificate was accepted from the session tickets
    # that follow it (tunnel.dial waits for them); keep sending some.
    ctx.num_tickets = max(ctx.num_tickets, 1)
    return ctx


def client_ssl_context(ca: PemSource | None = None, cert: PemSource | None = None,
                       key: PemSource | None = None, *,
                       alpn: Sequence[str] | None = None) -> ssl.SSLContext:
    """TLS 1.2+ client context verifying the server against `ca` (the system trust store
    if None), with hostname checks; `cert` + `key` are our client certificate (paths or
    PEM). An input that cannot be used raises TlsInputError saying which and why."""
    if key is not None and cert is None:
        raise ValueError("a client key needs its certificate")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH,
                                     cadata=ca_text(ca) if ca is not None else None)
    harden(ctx, alpn)
    if cert is not None:
        load_chain(ctx, cert, key)
    return ctx
