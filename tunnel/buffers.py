"""`SharedBuffer`: one reusable read buffer for the process.

Why: a fresh bytes object per large read (`sock.recv(256 KiB)`, trio's `receive_some`)
is an allocation above glibc's mmap threshold: an mmap, a munmap and a page fault per
4 KiB every read, more CPU than the copy out of a buffer that stays. Its users all run
in the process's one trio thread and copy out what they keep before they yield, so one
buffer per use serves every connection. Anonymous memory: a page is resident once a read
reached it, not before.
"""

from __future__ import annotations

import mmap


class SharedBuffer:
    """An anonymous mapping that grows to the largest size asked for."""

    __slots__ = ("_map",)

    def __init__(self, size: int) -> None:
        self._map = mmap.mmap(-1, size)

    @property
    def whole(self) -> mmap.mmap:
        """The mapping itself (for `recv_into`), valid until a larger `view` is asked."""
        return self._map

    def view(self, size: int) -> memoryview:
        """The first `size` bytes, as a view; the mapping is replaced by a larger one
        first if it is smaller."""
        if len(self._map) < size:
            self._map = mmap.mmap(-1, size)
        return memoryview(self._map)[:size]
