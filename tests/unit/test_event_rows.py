"""The projection's faster paths give the very values of the plain ones: `events.round6` is
`round(x, 6)` float for float (sign of zero included), on the values a stage log holds and on
the awkward ones (exact halves, ties, huge, non-finite); a compact stage log's columns are the
ones `round` and the full records give."""

from __future__ import annotations

import math
import random

import pytest

from shared.core import events
from shared.core.events import round6
from shared.store.rows import EVENT_COLUMNS, event_row

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


def test_a_compact_stage_log_becomes_the_columns_round_gives() -> None:
    """The lean wire's log (one loop in `rows._fill_stage`) gives the stage columns of the records
    `round` makes, in order; an event written before the log went lean gives the same columns."""
    rng = random.Random(5)
    base = 1_795_407_032.1488566
    log = [(f"stage_{i}", rng.choice(["performed", "skipped", "failed"]), "why", round(rng.uniform(0, 9), 6),
            round(rng.uniform(0, 2), 6)) for i in range(7)]
    lean = {"job": {}, "state": {"started_at": base, "log": log}}
    old = {"job": {}, "state": {"stages": [
        {"stage": s, "status": st, "reason": r, "started_at": round(base + o, 6),
         "ended_at": round(round(base + o, 6) + t, 6)} for s, st, r, o, t in log]}}
    rows_ = [event_row(events.make_envelope(events.TEMPLATE_VERIFIED, "20250101T000000-r", "00000000000000aa", p, "t/1"))
             for p in (lean, old)]
    cols = EVENT_COLUMNS.index("stage_names"), EVENT_COLUMNS.index("stage_ended") + 1
    starts = [round(base + o, 6) for *_, o, _t in log]
    assert rows_[0][cols[0]:cols[1]] == [[s for s, *_ in log], [st for _, st, *_ in log], starts,
                                         [round(b + t, 6) for b, (*_, t) in zip(starts, log, strict=True)]]
    assert rows_[0][cols[0]:cols[1]] == rows_[1][cols[0]:cols[1]]
    assert rows_[0][EVENT_COLUMNS.index("status")] == "performed"


def test_result_values_are_written_in_result_columns_order() -> None:
    """`result_values` is a list in RESULT_COLUMNS order, each value commented with its column:
    a column added or moved in one place and not the other is caught here, not in ClickHouse."""
    import inspect
    import re

    from shared.store import rows

    src = inspect.getsource(rows.result_values)
    body = src[src.index("    return [\n"):]
    named = [name.strip() for line in body.splitlines() for name in
             (re.search(r"#\s*(.+)$", line).group(1).split(",") if re.search(r"#\s*(.+)$", line) else [])]
    assert named == list(rows.RESULT_COLUMNS)


def test_a_stage_events_tokens_and_cost_are_every_entry_its_stage_added() -> None:
    """The rubric stage's deep-judgment and presence-check calls are its event's too (they were
    left out of the event's tokens and cost, so a rubric_only run's figure from its events,
    `shared.store.event_usage`, missed them); the earlier stages' entries its state carries
    on are not."""
    def entry(tokens: int, cost: float) -> dict[str, object]:
        return {"input_tokens": tokens, "output_tokens": 1, "model_calls": 1, "cost_usd": cost}

    state = {"usage": {"answer_generation": entry(1000, 1.0), "rubric_evaluation": entry(10, 0.25),
                       "deep_judgment_rubric": entry(20, 0.125), "rubric_presence_check": entry(30, 0.0625)}}
    row = event_row(events.make_envelope(events.RUBRIC_EVALUATED, "20250101T000000-r", "00000000000000aa",
                                         {"job": {}, "state": state}, "t/1"))
    assert row[EVENT_COLUMNS.index("input_tokens")] == 60 and row[EVENT_COLUMNS.index("output_tokens")] == 3
    assert row[EVENT_COLUMNS.index("cost_usd")] == 0.4375
