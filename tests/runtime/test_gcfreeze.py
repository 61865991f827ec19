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
            nursery.start_soon(lambda: freeze_survivors_forever(check_every=0.01,
                                                                full_every=1.0))
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


def test_survivors_are_frozen_and_frozen_garbage_cycles_are_still_collected() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
