"""Cost, model calls and cached replies in ClickHouse (real chdb): the typed columns, the per-stage
cost array, the events table's cost, and the views `v_cost_by_model` and `v_run_cost`."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.core.config import Settings
from shared.store.engine import Store, open_store
from shared.store.rows import result_to_row
from tests.support.rows import make_result

PAID = {
    "answer_generation": {"input_tokens": 100, "output_tokens": 20, "total_tokens": 120, "model": "claude-haiku-4-5",
                          "model_calls": 2, "cached_replies": 0, "cost_usd": 0.0002},
    "parsing": {"input_tokens": 50, "output_tokens": 10, "total_tokens": 60, "model": "gpt-4.1-mini",
                "model_calls": 0, "cached_replies": 1, "cost_usd": 0.0},
    "total": {"input_tokens": 150, "output_tokens": 30, "total_tokens": 180, "model_calls": 2,
              "cached_replies": 1, "cost_usd": 0.0002},
}
UNPRICED = {
    "answer_generation": {"input_tokens": 10, "output_tokens": 10, "total_tokens": 20, "model": "private",
                          "model_calls": 1, "cached_replies": 0},
    "total": {"input_tokens": 10, "output_tokens": 10, "total_tokens": 20, "model_calls": 1, "cached_replies": 0},
}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    settings = Settings(home=tmp_path, clickhouse_database=f"c_{uuid.uuid4().hex[:10]}", nats_url="nats://127.0.0.1:1")
    st = open_store(settings)
    try:
        yield st
    finally:
        st.close()


def test_cost_columns_and_views(store: Store) -> None:
    rows = [result_to_row(make_result(question=f"q{i}", usage=PAID), "run-c", version=1) for i in range(3)]
    rows.append(result_to_row(make_result(question="q9", usage=UNPRICED), "run-c", version=1))
    store.insert_results(rows)
    got = store.query("SELECT question_id, cost_usd, model_calls, cached_replies, usage_cost_usd "
                      "FROM verification_results FINAL WHERE run_id = 'run-c' ORDER BY question_id").rows
    assert [tuple(r[1:4]) for r in got] == [(0.0002, 2, 1)] * 3 + [(None, 1, 0)]
    assert list(got[0][4]) == [0.0002, 0.0] and list(got[3][4]) == [None]
    run = store.query("SELECT results, calls, cached, round(run_cost_usd, 6), results_without_price "
                      "FROM v_run_cost WHERE run_id = 'run-c'").rows
    assert run == [(4, 7, 3, 0.0006, 1)]
    by_model = store.query("SELECT model, stage, results, round(cost_usd, 6), entries_without_price "
                           "FROM v_cost_by_model WHERE run_id = 'run-c' ORDER BY model").rows
    assert by_model == [("claude-haiku-4-5", "answer_generation", 3, 0.0006, 0),
                        ("gpt-4.1-mini", "parsing", 3, 0.0, 0),
                        ("private", "answer_generation", 1, 0.0, 1)]
