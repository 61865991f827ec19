"""pytest fixtures around FakeKube. Use them from a conftest.py:

    from nodeagent.testing.fakekube.fixtures import fake_kube, fake_kube_tls, kube  # noqa: F401

`fake_kube` is an authenticated plain-HTTP server (admin token `ADMIN_TOKEN`), `kube` a
`KubeClient` for it loaded from a kubeconfig through the official package — the same path
the controller takes. Both end with the test (the server runs in pytest-trio's `nursery`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from nodeagent.kube import KubeClient, load_kubeconfig
from nodeagent.kube.credentials import Credentials
from nodeagent.testing.fakekube.server import FakeKube

ADMIN_TOKEN = "fakekube-admin-token"


async def start_fake_kube(nursery: trio.Nursery, **options: object) -> FakeKube:
    """Start a FakeKube with these options in `nursery` (ends when the nursery does)."""
    options.setdefault("token", ADMIN_TOKEN)
    options.setdefault("bookmark_interval", 0.2)
    fake = FakeKube(**options)  # type: ignore[arg-type]
    await nursery.start(fake.serve)
    return fake


def credentials_for(fake: FakeKube, directory: Path, *, token: str | None = None,
                    client_cert: bool = False, refresh_period: float = 60.0) -> Credentials:
    """Credentials for `fake`, via a kubeconfig file and the official loader."""
    path = fake.write_kubeconfig(directory / f"kubeconfig-{fake.port}", token=token,
                                 client_cert=client_cert)
    return load_kubeconfig(path, refresh_period=refresh_period)


@pytest.fixture
async def fake_kube(nursery: trio.Nursery) -> FakeKube:
    return await start_fake_kube(nursery)


@pytest.fixture
async def fake_kube_tls(nursery: trio.Nursery) -> FakeKube:
    return await start_fake_kube(nursery, tls=True)


@pytest.fixture
async def kube(fake_kube: FakeKube, tmp_path: Path) -> AsyncIterator[KubeClient]:
    async with KubeClient(credentials_for(fake_kube, tmp_path), timeout=10.0) as client:
        yield client
