"""Fixtures for end-to-end tests: certificates and a sample upstream, once per session
(the helpers behind them live in nodeagent.testing.standalone)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from nodeagent.testing.standalone import Certs, Upstream, make_certs, run_upstream


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def upstream() -> Iterator[Upstream]:
    with run_upstream() as up:
        yield up
