"""The syntax of one HTTP routing rule — host pattern, path, path type — with Kubernetes
Ingress semantics, shared by whatever builds rules: the controller's Ingress translation
checks each Ingress path with it (so a bad path is a Problem on that Ingress, not a failed
route table), and the HTTP route table accepts the same forms.

Pure and dependency-free on purpose: the Ingress translation must not import the
data-plane HTTP front to learn what a valid rule is.
"""

from __future__ import annotations

import re
from typing import Literal

PathType = Literal["Exact", "Prefix", "ImplementationSpecific"]
PATH_TYPES: tuple[PathType, ...] = ("Exact", "Prefix", "ImplementationSpecific")

_LABEL = r"[a-z0-9]([-a-z0-9_]{0,61}[a-z0-9])?"
_BAD_PATH = re.compile(r"[ ?#\r\n\t]")
_HOST_RE = re.compile(rf"(\*\.)?{_LABEL}(\.{_LABEL})*|\[[0-9a-f:.]+\]")  # fullmatch only


def check_rule_host(host: str) -> str:
    """A rule's host as matched: lowercase, no final dot. Exact (`app.example.com`) or a
    wildcard of one label (`*.example.com`); ValueError otherwise."""
    name = host.lower()
    if name.endswith("."):
        name = name[:-1]
    if not _HOST_RE.fullmatch(name) or len(name) > 253:
        raise ValueError(f"host {host!r}: not a DNS name or a wildcard '*.' followed by one")
    return name


def check_rule_path(path: str) -> str:
    """A rule's path: absolute, and without what a request path cannot contain unescaped
    (spaces, '?', '#', control whitespace); ValueError otherwise."""
    if not path.startswith("/"):
        raise ValueError(f"path {path!r}: must start with '/'")
    if _BAD_PATH.search(path):
        raise ValueError(f"path {path!r}: must not contain spaces, '?' or '#'")
    return path
