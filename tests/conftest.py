"""Suite-wide rules: what a test needs from the machine, and that no test leaks.

- `@pytest.mark.needs("nft", ...)` / `@pytest.mark.netns`: a test whose needs this machine
  does not meet (tests/needs.py) is skipped before its fixtures run, with a reason naming
  the Debian package; the end of the run says how many were skipped and why.
- A test must not leave anything behind for the tests after it: child processes still
  running after its teardown are killed and fail it, and so do sockets, files and event
  loops left for the garbage collector fail a failed test (whose traceback would otherwise
  keep them alive into some later test); after every module they are collected and
  reported as a LeakWarning naming the module.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import warnings
from collections import Counter
from collections.abc import Generator, Iterator

import pytest

from nodeagent.testing.netns import Topology, netns_available
from tests import needs as needs_table

_SKIPS = pytest.StashKey[Counter[str]]()
_FAILED = pytest.StashKey[bool]()


# ------------------------------------------------------------------------------ needs


def _needs_of(item: pytest.Item) -> list[str]:
    wanted: list[str] = []
    if item.get_closest_marker("netns") is not None:
        wanted += needs_table.NETNS
    for mark in item.iter_markers("needs"):
        wanted += mark.args
    return wanted


def pytest_runtest_setup(item: pytest.Item) -> None:
    # A plain hook (not tryfirst): it runs after pytest's own skip marks are evaluated and
    # before any fixture is set up, and every skip raised here shares this location, so
    # `-ra` folds them into one line per reason.
    found = needs_table.unmet(_needs_of(item))
    if found is None:
        return
    group, reason = found
    item.config.stash.setdefault(_SKIPS, Counter())[group] += 1
    pytest.skip(reason)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    counts = config.stash.get(_SKIPS, None)
    if not counts:
        return
    total = sum(counts.values())
    parts = ", ".join(f"{n} {group}" for group, n in counts.most_common())
    where = ("run scripts/test as root to install what is missing" if os.geteuid() == 0
             else "run scripts/test as root to run them")
    terminalreporter.write_line(
        f"skipped {total} test{'s' if total != 1 else ''} this machine cannot run: {parts} "
        f"({where})", yellow=True, bold=True)


# ------------------------------------------------------------------------------ leaks


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item,
                              call: pytest.CallInfo[None]) -> Generator[None, object, object]:
    report = yield
    if getattr(report, "failed", False):
        item.stash[_FAILED] = True
    return report


def _children() -> set[int]:
    """Live (not zombie) child processes of this process."""
    pid = os.getpid()
    found: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found.update(int(p) for p in f.read().split())
        except OSError:
            continue
    live = set()
    for child in found:
        try:
            with open(f"/proc/{child}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            live.add(child)
    return live


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def _garbage() -> list[str]:
    """What the garbage collector finds unclosed (sockets, files, event loops)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        # pytest keeps the last failure's traceback (for post-mortem debugging): its
        # frames would keep the failed test's objects alive into the next tests.
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                delattr(sys, name)
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


@pytest.fixture(autouse=True)
def _no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    before = _children()
    yield
    left: list[str] = []
    for pid in sorted(_children() - before):
        left.append(f"process {pid} still running: {_command(pid)}")
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if request.node.stash.get(_FAILED, False):
        left += _garbage()
    if left:
        pytest.fail("this test left behind (a fixture or `finally` must close them):\n  "
                    + "\n  ".join(left), pytrace=False)


class LeakWarning(UserWarning):
    """A module whose passing tests left objects for the garbage collector."""


@pytest.fixture(autouse=True, scope="module")
def _no_leaks_in_module(request: pytest.FixtureRequest) -> Iterator[None]:
    # Collected here, each module's leaks surface in the module that made them, never in
    # a later test. Passing tests' leaks are reported as a warning, so the run names
    # them without turning red over timing of the garbage collector; a failed test's
    # leaks fail it (_no_leaks).
    yield
    left = _garbage()
    if left:
        warnings.warn(LeakWarning(
            f"{request.node.nodeid} left unclosed objects for the garbage collector:\n  "
            + "\n  ".join(left)), stacklevel=1)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def topo() -> Iterator[Topology]:
    reason = netns_available()
    if reason is not None:
        pytest.skip(reason)
    t = Topology()
    try:
        yield t
    finally:
        t.close()
