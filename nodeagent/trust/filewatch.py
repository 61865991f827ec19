"""Reload credentials (certificates, keys, CA bundles, token files) when their files change.

    reloader = FileReloader("tunnel certificate", [cert, key, ca], load=build_context,
                            apply=swap, log=log)
    nursery.start_soon(reloader.run)

Every `interval` seconds the files' (mtime, size, SHA-256) are compared with those last
loaded; on a change `load()` builds the new value (an SSLContext, a token list) and
`apply(value)` swaps it in. If `load()` fails (a half-written file, a key that does not
match its certificate, a missing file) the old value stays, one line is logged per
distinct broken state, and the next poll tries again.

Polling rather than inotify: no dependency, it works the same for a kubelet-projected
Secret (an atomic symlink swap of `..data`, which inotify on the file itself misses) and
for a plain file replaced or edited in place; the content hash catches a rewrite within
mtime granularity. A few stats and hashes of small files every few seconds cost nothing.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Generic, TypeVar

import trio

from nodeagent.ops.logs import StructuredLogger

T = TypeVar("T")
RELOAD_INTERVAL = float(os.environ.get("NODEAGENT_RELOAD_INTERVAL", "2"))
MAX_FILE = 1024 * 1024  # credentials are small; a bigger file is hashed by its first MiB

Fingerprint = tuple[tuple[int, int, bytes] | None, ...]


def fingerprint(paths: Sequence[Path]) -> Fingerprint:
    """(mtime_ns, size, sha256) per path, None for one that cannot be read."""
    out: list[tuple[int, int, bytes] | None] = []
    for path in paths:
        try:
            st = path.stat()
            with path.open("rb") as f:
                digest = hashlib.sha256(f.read(MAX_FILE)).digest()
        except OSError:
            out.append(None)
            continue
        out.append((st.st_mtime_ns, st.st_size, digest))
    return tuple(out)


class FileReloader(Generic[T]):
    """Watches `paths`; see the module docstring. The value in use when it is created is
    the one loaded from the files as they are now."""

    def __init__(self, what: str, paths: Sequence[Path], *, load: Callable[[], T],
                 apply: Callable[[T], Awaitable[object] | None], log: StructuredLogger,
                 interval: float | None = None) -> None:
        self.what = what
        self.paths = list(paths)
        self._load = load
        self._apply = apply
        self._log = log
        self.interval = RELOAD_INTERVAL if interval is None else interval
        self._loaded = fingerprint(self.paths)
        self._failed: Fingerprint | None = None
        self.reloads = 0
        self.failures = 0
        self.last_error: str | None = None

    async def run(self) -> None:
        while True:
            await trio.sleep(self.interval)
            await self.check()

    async def check(self) -> bool:
        """Reload if the files changed since the last load; True if a new value applied."""
        now = fingerprint(self.paths)
        if now == self._loaded:
            return False
        try:
            value = self._load()
        except Exception as exc:  # whatever the loader finds wrong with the new files
            self.last_error = str(exc)[:300]
            if now != self._failed:  # one line per broken state, not one per poll
                self.failures += 1
                self._failed = now
                self._log.error("changed files not usable; keeping the loaded ones",
                                what=self.what, error=self.last_error)
            return False
        self._loaded, self._failed, self.last_error = now, None, None
        result = self._apply(value)
        if result is not None:
            await result
        self.reloads += 1
        self._log.info("reloaded from changed files", what=self.what,
                       files=",".join(str(p) for p in self.paths))
        return True

    def status(self) -> dict[str, object]:
        return {"reloads": self.reloads, "failures": self.failures,
                "last_error": self.last_error}
