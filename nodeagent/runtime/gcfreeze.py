"""`freeze_survivors_forever()`: keep the cyclic GC from walking a large, long-lived heap
again and again, while still freeing the cycles in it that become garbage.

Why: a controller serving thousands of config watches holds their connections (TLS,
HTTP state, tasks) in the oldest generation, and every full collection walks them
again, only to prove once more that they are not garbage; during a fan-out those walks
were a large share of its CPU and of its latency to the last node
(`python -m scripts.bench.config_propagation`, with `gc.callbacks` timing each
collection, measures it; docs/performance.md has today's figures).

So: whatever survives a full collection is frozen (`gc.freeze()`: moved out of the
collector's generations, an O(1) list splice), and the next full collection walks only
what was made since. Frozen objects are still freed by reference counting; only a cycle
that becomes garbage after it was frozen stays, until the periodic `full_every`
collection (unfreeze, collect everything, freeze again), which bounds that memory by the
churn of `full_every` seconds. That one walk costs what a full collection cost before,
once every 10 minutes instead of every few changes. A churn burst does not wait for it:
once the frozen objects outnumber what the last collection of everything left by
`growth` (5,000 watches reconnecting at once froze the dead ones' cycles beside the new
ones: 460 → 680 MiB until the 10-minute collection), everything is collected early, at
most once per `min_between` seconds.

Only for the long-running processes (the `nodeagent controller` command); never in tests,
where the process is pytest's and freezing would keep every test's garbage cycles.
"""

from __future__ import annotations

import gc
import time

import trio

from nodeagent.ops.logs import get_logger

log = get_logger("nodeagent.gc")

CHECK_EVERY = 1.0  # seconds between looks at the collector's statistics
FULL_EVERY = 600.0  # seconds between collections of everything, frozen objects included
GROWTH = 1.25  # frozen objects over what the last collection of everything left: collect early
MIN_BETWEEN = 60.0  # seconds at least between two early collections of everything


def full_collections() -> int:
    """How many times the collector has collected its oldest generation."""
    return int(gc.get_stats()[2]["collections"])


def collect_everything() -> int:
    """Unfreeze, collect all generations, freeze what survived; returns the number of
    unreachable objects found."""
    gc.unfreeze()
    found = gc.collect()
    gc.freeze()
    return found


async def freeze_survivors_forever(*, check_every: float = CHECK_EVERY,
                                   full_every: float = FULL_EVERY, growth: float = GROWTH,
                                   min_between: float = MIN_BETWEEN) -> None:
    """Until cancelled: freeze after each automatic full collection, and collect
    everything every `full_every` seconds, or sooner once the frozen objects grew by
    `growth` since the last such collection (logged, with what it found and took)."""
    gc.freeze()
    seen = full_collections()
    last_full = trio.current_time()
    next_full = last_full + full_every
    baseline = gc.get_freeze_count()
    while True:
        await trio.sleep(check_every)
        now = trio.current_time()
        grown = gc.get_freeze_count() >= baseline * growth and now - last_full >= min_between
        if now >= next_full or grown:
            started = time.perf_counter()
            found = collect_everything()
            seconds = time.perf_counter() - started
            baseline = gc.get_freeze_count()
            log.info("collected every generation", unreachable=found,
                     seconds=round(seconds, 3), frozen=baseline,
                     why="frozen objects grew" if grown else "periodic")
            last_full = trio.current_time()
            next_full = last_full + full_every
            seen = full_collections()
        elif (count := full_collections()) != seen:
            seen = count
            gc.freeze()
