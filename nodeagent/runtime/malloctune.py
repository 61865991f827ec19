"""`trim_forever()`: hand the C heap's free pages back to the kernel every minute.

Why: a long-running agent's RSS grows while its live Python objects stay flat. Tunnel
reads and frames are buffers of 64-256 KiB; glibc raises its mmap threshold each time
such a buffer is freed, so later ones come from the heap, where a long-lived small
allocation between them pins the pages after they are freed. `malloc_trim(0)` gives
every free page in the heap back (madvise), wherever it lies, in milliseconds
(tests/runtime/test_malloctune.py makes such holes and checks they come back).

Why not a fixed mmap threshold (MALLOC_MMAP_THRESHOLD_) instead: every large read then
maps and faults in fresh pages, which costs the tunnel's bulk path about half its
throughput; a trim a minute costs a few milliseconds, and only the pages reused after it
fault in again. The long soak measures the growth (`python -m scripts.bench.soak`), the
tunnel benchmark the bulk cost (`python -m scripts.bench.tunnel --only bulk`);
docs/performance.md has today's figures.

Not glibc (musl, macOS): nothing is done.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import trio

TRIM_INTERVAL = 60.0


def _libc_trim() -> Callable[[], bool] | None:
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim  # this process's own C library
    except (OSError, AttributeError):
        return None
    malloc_trim.argtypes = (ctypes.c_size_t,)
    malloc_trim.restype = ctypes.c_int
    return lambda: bool(malloc_trim(0))


def trim_now() -> bool | None:
    """Give the heap's free pages back now: True if some were, False if none were, None
    without glibc."""
    trim = _libc_trim()
    return None if trim is None else trim()


async def trim_forever(interval: float = TRIM_INTERVAL,
                       trim: Callable[[], bool] | None = None) -> None:
    """Trim every `interval` seconds until cancelled (returns at once without glibc)."""
    trim = trim or _libc_trim()
    if trim is None:
        return
    while True:
        await trio.sleep(interval)
        trim()
