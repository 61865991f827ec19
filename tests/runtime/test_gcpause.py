"""gc_paused restores the caller's GC setting, whatever happens in the block."""

from __future__ import annotations

import gc

import pytest

from nodeagent.runtime.gcpause import gc_paused


def test_paused_inside_and_restored_after() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()


def test_a_caller_that_disabled_gc_keeps_it_disabled() -> None:
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
