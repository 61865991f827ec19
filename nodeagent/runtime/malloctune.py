"""`trim_forever()`: hand the C heap's free pages back to the kernel every minute.

Measured in the 30-minute soak (`scripts/soak.py`: mixed TCP echo and HTTP load, a server
rollout and a path flap every 3 minutes): an agent's RSS grew 9.8 % after warm-up (62.1 →
68.3 MiB) while tracemalloc showed its live Python objects flat (a few hundred KB of data
in flight). That was read as glibc malloc's doing: tunnel reads and frames are buffers of
64-256 KiB; glibc raises its mmap threshold each time such a buffer is freed, so later
ones come from the heap, where a long-lived small allocation between them pins the pages
after they are freed. `malloc_trim(0)` gives every free page in the heap back (madvise),
wherever it lies: 70 MB of such holes came back in ~5 ms here (tests/runtime/test_malloctune.py
makes them and checks they come back). With the trim the soak's agent grew +6.2 %.

Most of what was left was not glibc's, found later with heaptrack and mallinfo2(): every
TLS connection a rollout or a flap broke stayed alive, OpenSSL buffers and all (which
tracemalloc does not see), in a reference cycle until a full GC collection (see
`TLSStream._remember_failure` in tunnel/transports/tls.py). With that fixed, over a
60-minute soak the agent's malloc'd bytes in use stayed at 8.9-9.4 MiB while the heap's
address range still grew from 14.6 to 21.5 MiB: holes, whose free pages this trim hands
back (RSS stayed at 48-50 MiB).

Why not the other fix, a fixed mmap threshold (MALLOC_MMAP_THRESHOLD_=131072): it held the
soak's growth to 4.2 %, but every 256 KiB read then maps and faults in fresh pages, which
doubled the tunnel's bulk CPU (`bench.py --only bulk`: 2.3-2.7 → 4.5-5.3 s per GB, half
the throughput). A trim a minute costs a few milliseconds and only the pages reused after
it fault in again.

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
