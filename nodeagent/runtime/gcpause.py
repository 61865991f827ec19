"""`gc_paused()`: build a large, garbage-free structure without the cyclic GC walking it.

Route tables, Ingress translations and the server's Ingress table each allocate tens of
thousands of small objects at once. Every 700 allocations the cyclic GC would walk the
young generation, and the growing heap gets promoted and walked again and again, though
none of it is cyclic garbage: that costs more than the build itself
(`python -m scripts.bench.route_table` measures it). Pausing it for the build, and
restoring the caller's setting, is the whole trick.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused(*, freeze: bool = False) -> Iterator[None]:
    """Disable the cyclic GC for the block; re-enable it after only if it was enabled.

    `freeze`: what the block built lives long (the controller's configs until a change
    replaces them), so freeze it before the GC is back on. Without it, the first
    allocation after the block collects everything the block allocated in one young
    collection (a visible share of the controller's CPU in a fan-out to thousands of
    nodes: `python -m scripts.bench.config_propagation`), and later ones walk the
    survivors again in each older generation. See gcfreeze.py for
    how frozen cycles that become garbage are still collected."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.freeze()
        if enabled:
            gc.enable()
