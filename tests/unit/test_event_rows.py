"""The projection's faster paths give the very values of the plain ones: `events.round6` is
`round(x, 6)` float for float (sign of zero included), on the values a stage log holds and on
the awkward ones (exact halves, ties, huge, non-finite)."""

from __future__ import annotations

import math
import random

import pytest

from shared.core.events import round6

SPECIAL = [0.0, -0.0, 1e-7, -1e-7, 5e-7, -5e-7, 2.5e-7, 0.0078125, -0.0078125, 3 / 128, 0.5, 1.5,
           1.0000005, 1700000000.0000005, 1700000123.1234565 + 0.2, 4.5e9, 4.6e9, -4.6e9, 9e9, 1e300, -1e300,
           5e-324, 1e-300, math.inf, -math.inf]


def _same(a: float, b: float) -> bool:
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


@pytest.mark.parametrize("x", SPECIAL)
def test_round6_is_round_on_awkward_values(x: float) -> None:
    assert _same(round6(x), round(x, 6))


def test_round6_of_nan_is_nan() -> None:
    assert math.isnan(round6(math.nan))


def test_round6_is_round_on_stage_log_times_and_more() -> None:
    rng = random.Random(12)
    xs: list[float] = []
    for _ in range(20_000):
        base = rng.uniform(1.6e9, 1.9e9)  # epoch seconds, as `State.started_at`
        xs += [base, round(base, 6) + round(rng.uniform(0, 600), 6), rng.uniform(-1e3, 1e3),
               rng.uniform(-5e9, 5e9), math.ldexp(rng.random(), rng.randint(-60, 40)),
               (rng.randint(0, 2**40) + 0.5) / 1e6, rng.randint(0, 2**52) / 2 ** rng.randint(0, 40)]
    wrong = [x for x in xs if not _same(round6(x), round(x, 6))]
    assert not wrong, wrong[:5]
    # the exact halves of x * 1e6, where the product's rounding error decides, were among them
    assert sum(1 for x in xs if abs(x * 1e6 - round(x * 1e6)) == 0.5) > 1000
