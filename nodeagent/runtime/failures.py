"""The one error a role ended with, out of the exception groups of its nurseries."""

from __future__ import annotations

from typing import TypeVar

import trio

E = TypeVar("E", bound=BaseException)


def sole_failure(exc: BaseException, kind: type[E]) -> E | None:
    """The `kind` error a role ended with, out of the exception groups of its nurseries
    (with the cancellations it caused); None if the group holds anything else."""
    if isinstance(exc, kind):
        return exc
    if not isinstance(exc, BaseExceptionGroup):
        return None
    found, rest = exc.split(kind)
    if found is None or (rest is not None and rest.split(trio.Cancelled)[1] is not None):
        return None
    first: BaseException = found
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first if isinstance(first, kind) else None
