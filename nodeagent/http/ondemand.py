"""HTTP/2 on demand: the front's shared h2c pool, made when a request first needs it.

The `h2` library (with hpack and hyperframe) and the front's h2 modules (`h2connection`,
`h2session`, `h2wire`, `h2pool`, `h2heads`) are ~1.5-2 MiB of a server's RSS
(docs/performance.md, "Memory at 1,000 idle connections"), and most fronts never see
HTTP/2. They load on the first connection that speaks it (ALPN `h2`, or the h2c preface
on plaintext, told by `preface`: `front.serve_http_connection`) or the first request to a
route whose backends speak h2c (`H2PoolSlot.get`). `tests/test_imports.py` checks a server
starts without them; `tests/http/test_h2_on_demand.py` that they load when first needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import trio

    from nodeagent.http.h2pool import Describe, H2Pool
    from nodeagent.http.limits import Limits
    from nodeagent.http.upstream import Opener

class H2PoolSlot:
    """A front's shared h2c connections to backends (`h2pool.H2Pool`, their tasks in
    `nursery`), made, with the h2 modules, when a request first needs one."""

    __slots__ = ("_pool", "describe", "limits", "nursery", "opener")

    def __init__(self, nursery: trio.Nursery, opener: Opener, limits: Limits,
                 describe: Describe | None = None) -> None:
        self.nursery = nursery
        self.opener = opener
        self.limits = limits
        self.describe = describe
        self._pool: H2Pool | None = None

    @property
    def pool(self) -> H2Pool | None:
        """The pool if a request has made it (debug views, drain), else None."""
        return self._pool

    def get(self) -> H2Pool:
        """The pool, made (and the h2 modules loaded) on the first call."""
        pool = self._pool
        if pool is None:
            from nodeagent.http.h2pool import H2Pool

            pool = self._pool = H2Pool(self.nursery, self.opener, self.limits,
                                       describe=self.describe)
        return pool

    def drain(self) -> None:
        """The front drains: the pool's connections close once their streams end."""
        if self._pool is not None:
            self._pool.drain()


__all__ = ["H2PoolSlot"]
