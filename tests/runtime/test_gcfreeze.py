"""freeze_survivors_forever, in a process of its own (freezing pytest's would keep every
later test's garbage cycles)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import gc, weakref
    import trio
    from nodeagent.runtime.gcfreeze import freeze_survivors_forever

    class Node:
        pass

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: freeze_survivors_forever(
                check_every=0.01, full_every=1.0, busy=float("inf")))
            await trio.sleep(0.05)
            at_start = gc.get_freeze_count()
            assert at_start > 0, "frozen when started"

            # What survives a full collection is frozen, so the next one skips it.
            keep = [Node() for _ in range(5000)]
            gc.collect()
            await trio.sleep(0.1)
            assert gc.get_freeze_count() >= at_start + 5000, gc.get_freeze_count()

            # A cycle frozen while alive and dropped later is garbage the young
            # collections cannot see; the periodic collection of everything frees it.
            cycle = Node()
            cycle.me = cycle
            freed = []
            weakref.finalize(cycle, freed.append, True)
            gc.collect()
            await trio.sleep(0.1)
            del cycle
            gc.collect()
            assert not freed, "a frozen cycle is not collected by a normal collection"
            with trio.fail_after(5):
                while not freed:
                    await trio.sleep(0.05)
            assert len(keep) == 5000
            nursery.cancel_scope.cancel()
        print("ok")

    trio.run(main)
""")


def run_script(script: str) -> None:
    """Run `script` in a fresh interpreter; it prints "ok" when its asserts held."""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_survivors_are_frozen_and_frozen_garbage_cycles_are_still_collected() -> None:
    run_script(SCRIPT)


# What the collection scripts below share: garbage cycles to make and watch.
CYCLES = textwrap.dedent("""
    import gc, time, weakref
    import trio
    from nodeagent.runtime.gcfreeze import freeze_survivors_forever

    class Node:
        pass

    def cycles(n):
        out = []
        for _ in range(n):
            node = Node()
            node.me = node
            out.append(node)
        return out
""")


GROWTH_SCRIPT = CYCLES + textwrap.dedent("""
    async def main():
        async with trio.open_nursery() as nursery:
            # The periodic collection never comes in this test: only growth can free.
            nursery.start_soon(lambda: freeze_survivors_forever(
                check_every=0.01, full_every=3600.0, growth=1.25, min_between=0.0,
                count_every=0.0, busy=float("inf")))
            await trio.sleep(0.05)
            at_start = gc.get_freeze_count()
            # A burst of connections' cycles, frozen while alive, then all dropped (a
            # reconnect storm's dead side): garbage only a collection of everything sees.
            dead = cycles(at_start // 2)
            freed = []
            weakref.finalize(dead[0], freed.append, True)
            gc.collect()
            await trio.sleep(0.1)
            del dead
            gc.collect()
            assert not freed, "frozen garbage stays until everything is collected"
            # Their replacements arrive and are frozen too: the frozen heap grew past
            # the trigger, so everything is collected without waiting for the hour.
            alive = cycles(at_start // 2)
            gc.collect()
            with trio.fail_after(5):
                while not freed:
                    await trio.sleep(0.05)
            assert len(alive) == at_start // 2
            nursery.cancel_scope.cancel()
        print("ok")

    trio.run(main)
""")


def test_frozen_garbage_is_collected_early_when_the_frozen_heap_grows() -> None:
    run_script(GROWTH_SCRIPT)


BUSY_SCRIPT = CYCLES + textwrap.dedent("""
    async def spin(seconds):
        # A fan-out's CPU: work between checkpoints, the loop never idle.
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            stop = time.perf_counter() + 0.002
            while time.perf_counter() < stop:
                pass
            await trio.sleep(0)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: freeze_survivors_forever(
                check_every=0.02, full_every=3600.0, growth=1.25, min_between=0.0,
                count_every=0.0, busy=0.5, quiet=0.3, max_wait=MAX_WAIT))
            await trio.sleep(0.05)
            at_start = gc.get_freeze_count()
            dead = cycles(at_start // 2)
            freed = []
            weakref.finalize(dead[0], freed.append, True)
            gc.collect()
            await trio.sleep(0.1)
            del dead
            gc.collect()
            # Grown past the trigger while the process is busy: the collection waits...
            alive = cycles(at_start // 2)
            gc.collect()
            await spin(0.5)
            await trio.sleep(0.06)  # a lull between two changes, shorter than `quiet`
            await spin(0.5)
            assert bool(freed) == (MAX_WAIT < 1.0), "collected while busy or in a lull"
            # ... and comes once it is quiet.
            with trio.fail_after(5):
                while not freed:
                    await trio.sleep(0.05)
            assert len(alive) == at_start // 2
            nursery.cancel_scope.cancel()
        print("ok")

    trio.run(main)
""")


def test_a_due_collection_waits_while_the_process_is_busy() -> None:
    run_script("MAX_WAIT = 30.0\n" + BUSY_SCRIPT)


def test_a_due_collection_waits_no_longer_than_max_wait() -> None:
    run_script("MAX_WAIT = 0.2\n" + BUSY_SCRIPT)
