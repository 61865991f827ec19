"""Write kubeconfig files pointing at a fake API server (inline `*-data`, as kubeadm does)."""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

import yaml


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def write_kubeconfig(path: str | os.PathLike[str], server: str, *,
                     token: str | None = None, token_file: str | os.PathLike[str] | None = None,
                     ca_pem: bytes | None = None, client_cert_pem: bytes | None = None,
                     client_key_pem: bytes | None = None, namespace: str | None = None,
                     insecure: bool = False, context: str = "fakekube") -> Path:
    cluster: dict[str, Any] = {"server": server}
    if ca_pem:
        cluster["certificate-authority-data"] = _b64(ca_pem)
    if insecure:
        cluster["insecure-skip-tls-verify"] = True
    user: dict[str, Any] = {}
    if token:
        user["token"] = token
    if token_file:
        user["tokenFile"] = os.fspath(token_file)
    if client_cert_pem and client_key_pem:
        user["client-certificate-data"] = _b64(client_cert_pem)
        user["client-key-data"] = _b64(client_key_pem)
    ctx: dict[str, Any] = {"cluster": context, "user": context}
    if namespace:
        ctx["namespace"] = namespace
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": context, "cluster": cluster}],
        "users": [{"name": context, "user": user}],
        "contexts": [{"name": context, "context": ctx}],
        "current-context": context,
        "preferences": {},
    }
    out = Path(path)
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    out.chmod(0o600)
    return out
