"""Credentials: kubeconfig variants through the official loader, in-cluster, token rotation."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest

from nodeagent.kube import (
    NODES,
    CredentialsError,
    KubeClient,
    TokenFileAuth,
    Unauthorized,
    load_credentials,
    load_incluster,
    load_kubeconfig,
)
from nodeagent.kube import credentials as credentials_module
from nodeagent.testing.fakekube import FakeKube
from nodeagent.testing.fakekube.fixtures import ADMIN_TOKEN


async def can_list(credentials: object) -> None:
    async with KubeClient(credentials) as client:  # type: ignore[arg-type]
        await client.list(NODES)


async def test_kubeconfig_token_over_tls(fake_kube_tls: FakeKube, tmp_path: Path) -> None:
    path = fake_kube_tls.write_kubeconfig(tmp_path / "kc", namespace="nodeagent")
    creds = load_kubeconfig(path)
    assert creds.server == fake_kube_tls.url and creds.ssl_context is not None
    assert creds.namespace == "nodeagent"
    await can_list(creds)
    users = {r.user for r in fake_kube_tls.requests}
    assert users == {"admin"}


async def test_kubeconfig_client_certificate(fake_kube_tls: FakeKube, tmp_path: Path) -> None:
    path = fake_kube_tls.write_kubeconfig(tmp_path / "kc", client_cert=True,
                                          username="cert-user")
    await can_list(load_kubeconfig(path))
    assert {r.user for r in fake_kube_tls.requests} == {"cert-user"}


async def test_kubeconfig_with_untrusted_ca_fails_closed(fake_kube_tls: FakeKube,
                                                         tmp_path: Path) -> None:
    from nodeagent.testing.fakekube import CertificateAuthority, write_kubeconfig

    other_ca = CertificateAuthority("someone-else")
    path = write_kubeconfig(tmp_path / "kc", fake_kube_tls.url, token=ADMIN_TOKEN,
                            ca_pem=other_ca.cert_pem)
    from nodeagent.kube import ApiUnreachable

    with pytest.raises(ApiUnreachable):
        await can_list(load_kubeconfig(path))
    insecure = write_kubeconfig(tmp_path / "kc2", fake_kube_tls.url, token=ADMIN_TOKEN,
                                insecure=True)
    await can_list(load_kubeconfig(insecure))


async def test_kubeconfig_from_env_and_context(fake_kube: FakeKube, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = fake_kube.write_kubeconfig(tmp_path / "kc")
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    creds = load_credentials()
    assert creds.source.startswith("kubeconfig")
    await can_list(creds)
    with pytest.raises(CredentialsError):
        load_kubeconfig(path, context="no-such-context")
    with pytest.raises(CredentialsError):
        load_kubeconfig(tmp_path / "missing")


async def test_exec_plugin_token(fake_kube: FakeKube, tmp_path: Path) -> None:
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import json\n"
        "print(json.dumps({'apiVersion': 'client.authentication.k8s.io/v1beta1',"
        " 'kind': 'ExecCredential', 'status': {'token': 'exec-token'}}))\n")
    fake_kube.add_token("exec-token", username="exec-user")
    path = fake_kube.write_kubeconfig(tmp_path / "kc")
    text = path.read_text().replace(
        f"token: {ADMIN_TOKEN}",
        "exec:\n      apiVersion: client.authentication.k8s.io/v1beta1\n"
        f"      command: {sys.executable}\n      args: ['{plugin}']\n"
        "      interactiveMode: Never")
    path.write_text(text)
    await can_list(load_kubeconfig(path))
    assert {r.user for r in fake_kube.requests} == {"exec-user"}


async def test_kubeconfig_token_file_is_reread(fake_kube: FakeKube, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(ADMIN_TOKEN)
    path = fake_kube.write_kubeconfig(tmp_path / "kc", token_file=token_file)
    creds = load_kubeconfig(path)
    assert isinstance(creds.auth, TokenFileAuth)
    fake_kube.add_token("rotated", username="rotated-user")
    async with KubeClient(creds) as client:
        await client.list(NODES)
        token_file.write_text("rotated")
        fake_kube.revoke_token(ADMIN_TOKEN)
        await client.list(NODES)
    assert [r.status for r in fake_kube.requests] == [200, 401, 200]
    assert [r.user for r in fake_kube.requests if r.status == 200] == ["admin", "rotated-user"]


def service_account_dir(fake: FakeKube, tmp_path: Path, token: str) -> dict[str, Path]:
    assert fake.ca is not None
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    (sa / "token").write_text(token)
    (sa / "ca.crt").write_bytes(fake.ca.cert_pem)
    (sa / "namespace").write_text("nodeagent\n")
    return {"token_path": sa / "token", "ca_path": sa / "ca.crt",
            "namespace_path": sa / "namespace"}


async def test_in_cluster_rotation_on_401(fake_kube_tls: FakeKube, tmp_path: Path) -> None:
    fake = fake_kube_tls
    fake.add_service_account_token("sa-token-1", namespace="nodeagent",
                                   service_account="controller")
    paths = service_account_dir(fake, tmp_path, "sa-token-1")
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(fake.port)}
    creds = load_incluster(environ=env, **paths)  # type: ignore[arg-type]
    assert creds.server == f"https://127.0.0.1:{fake.port}" and creds.namespace == "nodeagent"
    auth = creds.auth
    assert isinstance(auth, TokenFileAuth)
    async with KubeClient(creds) as client:
        await client.list(NODES)
        # The kubelet swaps in a new token (atomically, via a symlink swap) and the old
        # one stops working.
        fake.add_service_account_token("sa-token-2", namespace="nodeagent",
                                       service_account="controller")
        new = paths["token_path"].with_name("token.new")
        new.write_text("sa-token-2")
        os.replace(new, paths["token_path"])
        fake.revoke_token("sa-token-1")
        await client.list(NODES)
        assert auth.reads == 2
        fake.revoke_token("sa-token-2")  # a token that stays bad is a real 401
        with pytest.raises(Unauthorized):
            await client.list(NODES)


async def test_token_file_reread_periodically(fake_kube: FakeKube, tmp_path: Path) -> None:
    now = [0.0]
    token_file = tmp_path / "token"
    token_file.write_text(ADMIN_TOKEN)
    auth = TokenFileAuth(token_file, refresh_period=60.0, clock=lambda: now[0])
    assert auth.token() == ADMIN_TOKEN
    token_file.write_text("next")
    now[0] = 59.0
    assert auth.token() == ADMIN_TOKEN and auth.reads == 1
    now[0] = 60.0
    assert auth.token() == "next" and auth.reads == 2


def test_in_cluster_needs_the_environment(tmp_path: Path) -> None:
    with pytest.raises(CredentialsError):
        load_incluster(environ={}, token_path=tmp_path / "t", ca_path=tmp_path / "c")


def test_in_cluster_is_preferred_inside_a_pod(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t")
    monkeypatch.setattr(credentials_module, "SERVICE_TOKEN_PATH", token)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    called = []
    monkeypatch.setattr(credentials_module, "load_incluster", lambda: called.append(1))
    load_credentials()
    assert called == [1]
    assert stat.S_ISREG(token.stat().st_mode)
