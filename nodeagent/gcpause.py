"""`gc_paused()`: build a large, garbage-free structure without the cyclic GC walking it.

Route tables, Ingress translations and the server's Ingress table each allocate tens of
thousands of small objects at once. Every 700 allocations the cyclic GC would walk the
young generation, and the growing heap gets promoted and walked again and again, though
none of it is cyclic garbage: measured, that cost more than the build itself (see
scripts/bench_routes.py). Pausing it for the build, and restoring the caller's setting,
is the whole trick.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable the cyclic GC for the block; re-enable it after only if it was enabled."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
