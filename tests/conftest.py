from __future__ import annotations

import pytest

from tests.netns import Topology, netns_available


@pytest.fixture
def topo() -> Topology:
    reason = netns_available()
    if reason is not None:
        pytest.skip(reason)
    t = Topology()
    try:
        yield t  # type: ignore[misc]
    finally:
        t.close()
