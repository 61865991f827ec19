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

Two costs of this loop itself, measured in the controller with 5,000 watches (1.2 M
frozen objects): `gc.get_freeze_count()` walks every frozen object (CPython keeps them
in a linked list and counts them one by one), ~50 ms at that size; read every second
it was ~5 % of a core, idle or not. It is read every `count_every` seconds, and only
once an early collection could be allowed at all. And a collection of everything takes
~1 s there: started in the middle of a fan-out, it stalled every watch's line by that
much (`python -m scripts.bench.config_propagation`, p99). A due collection waits until
the process has been quiet (at most `busy` of a core) for `quiet` seconds, for at most
`max_wait` seconds: started in a short lull between two changes, it stalled the second
one instead.

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
COUNT_EVERY = 15.0  # seconds between counts of the frozen objects (each walks them all)
BUSY = 0.2  # share of a core over the last check above which a due collection waits
QUIET = 2.0  # seconds the process must have been quiet for a due collection to start
MAX_WAIT = 30.0  # seconds a due collection waits at most for the process to be quiet


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
                                   min_between: float = MIN_BETWEEN,
                                   count_every: float = COUNT_EVERY, busy: float = BUSY,
                                   quiet: float = QUIET, max_wait: float = MAX_WAIT) -> None:
    """Until cancelled: freeze after each automatic full collection, and collect
    everything every `full_every` seconds, or sooner once the frozen objects grew by
    `growth` since the last such collection (logged, with what it found and took); a
    due collection waits while the process is busy (see the module docstring)."""
    gc.freeze()
    seen = full_collections()
    last_full = trio.current_time()
    next_full = last_full + full_every
    baseline = gc.get_freeze_count()
    next_count = last_full
    grown = False
    due_since: float | None = None
    quiet_since: float | None = None
    cpu = time.process_time()
    while True:
        await trio.sleep(check_every)
        now = trio.current_time()
        cpu, used = time.process_time(), time.process_time() - cpu
        if used > busy * check_every:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now - check_every
        if not grown and now - last_full >= min_between and now >= next_count:
            grown = gc.get_freeze_count() >= baseline * growth
            next_count = now + count_every
        if now >= next_full or grown:
            due_since = now if due_since is None else due_since
        # Busy (a fan-out, most likely) or in a lull between changes: after it.
        if due_since is not None and (
                (quiet_since is not None and now - quiet_since >= quiet)
                or now - due_since >= max_wait):
            started = time.perf_counter()
            found = collect_everything()
            seconds = time.perf_counter() - started
            baseline = gc.get_freeze_count()
            log.info("collected every generation", unreachable=found,
                     seconds=round(seconds, 3), frozen=baseline,
                     why="frozen objects grew" if grown else "periodic",
                     waited=round(now - due_since, 1))
            last_full = trio.current_time()
            next_full = last_full + full_every
            seen = full_collections()
            grown, due_since, quiet_since = False, None, None
            cpu = time.process_time()
        elif (count := full_collections()) != seen:
            seen = count
            gc.freeze()
