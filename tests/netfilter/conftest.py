from __future__ import annotations

from collections.abc import Iterator

import pytest

from netfilter.nftables import NftablesBackend
from nodeagent.testing.netns import netns_available
from tests.netfilter.lab import Lab


@pytest.fixture(scope="module")
def lab_module() -> Iterator[Lab]:
    reason = netns_available()
    if reason is not None:
        pytest.skip(reason)
    lab = Lab()
    try:
        yield lab
    finally:
        lab.close()


@pytest.fixture
def lab(lab_module: Lab) -> Iterator[Lab]:
    """The shared pod/node/remote lab, with `node` wiped of rules after each test."""
    try:
        yield lab_module
    finally:
        lab_module.reset_node()


@pytest.fixture
def nft(lab: Lab) -> Iterator[NftablesBackend]:
    """An nftables backend for `node`; its netlink socket is closed however the test ends."""
    backend = NftablesBackend(lab.ns("node"))
    try:
        yield backend
    finally:
        backend.close()
