"""`trim_forever()`: hand the C heap's free pages back to the kernel soon after load.

Why: a long-running agent's RSS grows while its live Python objects stay flat. Tunnel
reads and frames are buffers of 64-256 KiB; glibc raises its mmap threshold each time
such a buffer is freed, so later ones come from the heap, where a long-lived small
allocation between them pins the pages after they are freed. `malloc_trim(0)` gives
every free page in the heap back (madvise), wherever it lies, in milliseconds
(tests/runtime/test_malloctune.py makes such holes and checks they come back).

When: every `CHECK_INTERVAL` seconds the heap's free bytes are read (`mallinfo2`, a walk
of the free lists: 15-50 µs on a server's or agent's heap after load), and the heap is
trimmed only when they reach `TRIM_SLACK`. So memory comes back within seconds of a load
phase ending (with a trim a minute, server and agent held 13-15 MiB more at 1,000 idle
connections after a bulk and HTTP phase, until the next trim: `python -m
scripts.bench.memory_after_load`), and a process that never saw load does not trim.
After load a heap keeps 7-10 MiB of free chunks, so it is trimmed every interval, idle
or not: 70-140 µs when nothing is left to give back. That is what holds RSS down:
glibc counts a given-back chunk as free, and chunks are used and freed again between
checks without the free total moving, so trimming only when it grew since the last
trim left a server at 59.7 MiB instead of 53.2 after a round of load. During a bulk
transfer a trim may release pages that are faulted in again: at most once per
interval, a few MiB, milliseconds.

Why not a fixed mmap threshold (MALLOC_MMAP_THRESHOLD_) instead: every large read then
maps and faults in fresh pages, which costs the tunnel's bulk path about half its
throughput. The long soak measures the growth (`python -m scripts.bench.soak`), the
tunnel benchmark the bulk cost (`python -m scripts.bench.tunnel --only bulk`);
docs/performance.md has today's figures.

Not glibc (musl, macOS): nothing is done. A glibc without mallinfo2 (before 2.33) trims
every interval.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import trio

CHECK_INTERVAL = 2.0
TRIM_SLACK = 2 * 1024 * 1024  # free heap bytes worth a trim


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]


def _libc_trim() -> Callable[[], bool] | None:
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim  # this process's own C library
    except (OSError, AttributeError):
        return None
    malloc_trim.argtypes = (ctypes.c_size_t,)
    malloc_trim.restype = ctypes.c_int
    return lambda: bool(malloc_trim(0))


def _libc_free_heap() -> Callable[[], int] | None:
    """Bytes free in the heap, all arenas (glibc's mallinfo2); None where it is absent."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.argtypes = ()
    mallinfo2.restype = _MallInfo2
    return lambda: int(mallinfo2().fordblks)


def trim_now() -> bool | None:
    """Give the heap's free pages back now: True if some were, False if none were, None
    without glibc."""
    trim = _libc_trim()
    return None if trim is None else trim()


def free_heap_bytes() -> int | None:
    """What the heap holds free now (None without glibc's mallinfo2)."""
    free_heap = _libc_free_heap()
    return None if free_heap is None else free_heap()


async def trim_forever(interval: float = CHECK_INTERVAL,
                       trim: Callable[[], bool] | None = None,
                       free_heap: Callable[[], int] | None = None,
                       slack: int = TRIM_SLACK) -> None:
    """Every `interval` seconds, trim if the heap holds at least `slack` free bytes (or
    always, where they cannot be read), until cancelled; returns at once without glibc."""
    trim = trim or _libc_trim()
    if trim is None:
        return
    if free_heap is None:
        free_heap = _libc_free_heap()
    while True:
        await trio.sleep(interval)
        if free_heap is None or free_heap() >= slack:
            trim()
