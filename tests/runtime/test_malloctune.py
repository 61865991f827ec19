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


async def test_trim_forever_trims_once_per_interval(autojump_clock: trio.abc.Clock) -> None:
    calls: list[float] = []

    def trim() -> bool:
        calls.append(trio.current_time())
        return True

    with trio.move_on_after(185):
        await malloctune.trim_forever(60, trim)
    assert calls == [60, 120, 180]
