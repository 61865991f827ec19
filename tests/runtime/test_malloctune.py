"""The heap trim that keeps a long-running agent's RSS flat (nodeagent/runtime/malloctune.py)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import trio

from nodeagent.runtime import malloctune

# The pattern the tunnel produces: large buffers freed between long-lived allocations
# too big for Python's own small-object allocator (glibc's heap pins the holes).
PROGRAM = r"""
import sys
from nodeagent.runtime.malloctune import trim_now

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1])

base = rss()
x = b"y" * 300_000
del x
keep, big = [], []
for i in range(400):
    big.append(b"x" * (200_000 + i))
    keep.append(b"k" * 600)
del big
freed = rss()
trimmed = trim_now()
print(base, freed, rss(), trimmed)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_gives_freed_heap_pages_back() -> None:
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True,
                         check=True).stdout.split()
    base, freed, after, trimmed = int(out[0]), int(out[1]), int(out[2]), out[3]
    assert trimmed in ("True", "False")
    # 80 MB were allocated and freed; after the trim the process is back near its start
    # whatever glibc kept before it (what it keeps depends on its version and settings).
    assert after - base < 10_000, (base, freed, after)
    assert after <= freed


async def test_trim_forever_trims_only_when_the_heap_holds_enough_free(
        autojump_clock: trio.abc.Clock) -> None:
    calls: list[float] = []
    free = iter([0, 5_000_000, 100, 3_000_000, 0, 0])

    def trim() -> bool:
        calls.append(trio.current_time())
        return True

    with trio.move_on_after(13):
        await malloctune.trim_forever(2, trim, lambda: next(free), slack=1_000_000)
    assert calls == [4, 8]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallinfo2 is glibc's")
def test_the_free_heap_is_read_from_glibc() -> None:
    # C allocations, from the heap (mmap threshold fixed above them), freed between
    # pinned small ones: what the check must see before it trims.
    program = r"""
import ctypes
from nodeagent.runtime.malloctune import free_heap_bytes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: no trim at free()
big = [libc.malloc(200_000) for _ in range(100) if libc.malloc(600)]
before = free_heap_bytes()
for p in big:
    libc.free(p)
print(before, free_heap_bytes())
"""
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         check=True).stdout.split()
    before, after = int(out[0]), int(out[1])
    assert after - before >= 19_000_000, (before, after)
