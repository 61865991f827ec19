"""`nodeagent certs ...`: the files standalone TLS needs, made with the PKI the controller
uses (pki.py), so they carry exactly what the server checks.

- `ca`: a CA certificate (agents' `tls.ca_file`; the server's `tls.client_ca_file` for
  mutual TLS) and its key, which signs the rest and should stay on the machine that runs
  these commands.
- `server`: the tunnel server's certificate for the names and addresses agents dial.
- `node NAME`: a node's client certificate: URI SAN `nodeagent://node/NAME` and clientAuth
  usage, which is all the server reads (agentauth.py; the CN is for people).
- `token NAME`: a random token for one node (token authentication, no certificate).

Keys and tokens are written mode 0600, certificates 0644, each atomically. An existing file
is never replaced without `--force`: a new CA key would orphan every certificate signed by
the old one. Every error is one `CertFilesError` line; nothing is written when one is raised.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nodeagent.config import valid_node_name
from nodeagent.trust import pki

DAY = dt.timedelta(days=1)
# A token of 32 hex characters: 128 random bits (the config asks for at least 16 characters).
TOKEN_BYTES = 16


class CertFilesError(Exception):
    """Why a `nodeagent certs` command wrote nothing: one line a user can act on."""


@dataclass
class Written:
    """What a command wrote, with a line on each file's use, for the user to read."""

    files: list[tuple[Path, str]] = field(default_factory=list)
    next_steps: list[str] = field(default_factory=list)

    def report(self) -> str:
        lines = [f"wrote {path}  ({what})" for path, what in self.files]
        return "\n".join(lines + self.next_steps) + "\n"


def _refuse_existing(paths: Sequence[Path], force: bool) -> None:
    existing = [str(p) for p in paths if p.exists() or p.is_symlink()]
    if existing and not force:
        verb = "exists" if len(existing) == 1 else "exist"
        raise CertFilesError(f"{', '.join(existing)} already {verb}; nothing written "
                             "(--force replaces them)")
    missing_dirs = sorted({str(p.parent) for p in paths if not p.parent.is_dir()})
    if missing_dirs:
        raise CertFilesError(f"no such directory: {', '.join(missing_dirs)}")


def _valid_server_name(name: str) -> bool:
    """A DNS name, or a wildcard `*.name`, in any case (certificates carry it lower-case)."""
    name = name.lower()
    return valid_node_name(name[2:] if name.startswith("*.") else name)


def _load_ca(cert: Path, key: Path) -> pki.CertificateAuthority:
    for path in (cert, key):
        if not path.exists():
            raise CertFilesError(f"no CA at {path}: run `nodeagent certs ca` first, or give "
                                 "--ca FILE --ca-key FILE")
    try:
        return pki.CertificateAuthority.load(cert, key)
    except (OSError, ValueError, TypeError) as exc:
        raise CertFilesError(f"cannot use the CA {cert} / {key}: {exc}") from None


def _days(days: float, what: str) -> dt.timedelta:
    if not 0 < days <= 36500:
        raise CertFilesError(f"--days {days:g}: give 1 to 36500 days for the {what}")
    return days * DAY


def make_ca(directory: Path, *, name: str, days: float, force: bool) -> Written:
    cert, key = directory / "ca.crt", directory / "ca.key"
    validity = _days(days, "CA")
    _refuse_existing([cert, key], force)
    ca = pki.create_ca(name, valid_for=validity)
    ca.write(cert, key)
    return Written(
        [(cert, "the CA certificate: agents' tls.ca_file; the server's tls.client_ca_file "
                "for mutual TLS"),
         (key, "mode 0600: signs the certificates below; keep it here, off servers and "
               "nodes")],
        ["next: nodeagent certs server --name HOST (the name agents dial)"])


def make_server(directory: Path, *, names: Sequence[str], ips: Sequence[str], out: str,
                ca_cert: Path | None, ca_key: Path | None, days: float,
                force: bool) -> Written:
    if not names and not ips:
        raise CertFilesError("give the names agents dial: --name HOST and/or --ip ADDRESS "
                             "(each repeatable)")
    for ip in ips:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise CertFilesError(f"--ip {ip!r} is not an IP address (names go in --name)"
                                 ) from None
    for name in names:
        try:
            ipaddress.ip_address(name)
        except ValueError:
            if not _valid_server_name(name):
                raise CertFilesError(f"--name {name!r} is not a DNS name") from None
        else:
            raise CertFilesError(f"--name {name!r} is an IP address: give it as --ip {name}")
    validity = _days(days, "server certificate")
    cert, key = directory / f"{out}.crt", directory / f"{out}.key"
    ca = _load_ca(ca_cert or directory / "ca.crt", ca_key or directory / "ca.key")
    _refuse_existing([cert, key], force)
    issued = pki.issue_server_certificate(ca, [n.lower() for n in names], ips,
                                          valid_for=validity)
    issued.write(cert, key)
    sans = ", ".join([*names, *ips])
    return Written(
        [(cert, f"the server's tls.cert_file, for {sans}"),
         (key, "mode 0600: the server's tls.key_file")],
        [f"agents dial it as tls://{(names or ips)[0]}:PORT with tls.ca_file: "
         f"{ca_cert or directory / 'ca.crt'}"])


def make_node(directory: Path, node: str, *, ca_cert: Path | None, ca_key: Path | None,
              days: float, force: bool) -> Written:
    if not valid_node_name(node):
        raise CertFilesError(f"invalid node name {node[:64]!r}: a node name is a lower-case "
                             "DNS name (as Kubernetes names nodes)")
    validity = _days(days, "node certificate")
    cert, key = directory / f"{node}.crt", directory / f"{node}.key"
    ca = _load_ca(ca_cert or directory / "ca.crt", ca_key or directory / "ca.key")
    _refuse_existing([cert, key], force)
    pki.issue_client_certificate(ca, node, valid_for=validity).write(cert, key)
    return Written(
        [(cert, f"node {node}'s client certificate (URI SAN {pki.NODE_URI_PREFIX}{node}, "
                "clientAuth): the agent's tls.cert_file"),
         (key, "mode 0600: the agent's tls.key_file; copy both to the node")],
        ["the server accepts it with tls.client_ca_file: the CA certificate"])


def make_token(directory: Path, node: str, *, force: bool) -> Written:
    if not valid_node_name(node) and node != "*":
        raise CertFilesError(f"invalid node name {node[:64]!r}: a node name is a lower-case "
                             "DNS name (as Kubernetes names nodes)")
    path = directory / f"{'shared' if node == '*' else node}.token"
    _refuse_existing([path], force)
    _write_secret(path, secrets.token_hex(TOKEN_BYTES) + "\n")
    return Written(
        [(path, f"mode 0600: node {node}'s token: the server's tokens[].token_file and the "
                "agent's token_file; copy it to the node")])


def _write_secret(path: Path, text: str) -> None:
    """Mode 0600 from the start (never briefly readable), replacing atomically."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
