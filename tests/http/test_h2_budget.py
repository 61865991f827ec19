"""The HTTP/2 budget benchmark's floors time whole exchanges, and its arithmetic."""

from __future__ import annotations

import pytest

from scripts.bench import h2_budget


@pytest.mark.parametrize("measure", [h2_budget.h2load_floor, h2_budget.unary_floor])
def test_a_floor_times_whole_exchanges_on_both_sides(measure: object) -> None:
    floor = measure(200)  # type: ignore[operator]
    assert floor.server_side > 0 and floor.client_side > 0


def test_a_floor_that_loses_answers_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Calls that do not end OK would leave the floor timing other work than a proxied
    # call's; it must fail rather than print a figure.
    monkeypatch.setattr(h2_budget, "GRPC_TRAILERS", [(b"grpc-status", b"1")])
    with pytest.raises(RuntimeError, match="exchanges ended"):
        h2_budget.unary_floor(20)


def test_what_a_goal_leaves_per_request() -> None:
    # 2 cores at 16,000 requests/s: 125 µs per request in all; others took 48.
    assert h2_budget.left_per_request(2, 16_000, 48) == pytest.approx(77)
