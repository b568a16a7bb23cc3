"""One set of analyst views: the first generation's names (documented in the README) are views
over the analysis views now. Each is checked here against its own former definition, run as
plain SQL on the same two runs (the grid with its stage events, and the spec's results)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from shared.store.engine import Store

# The definitions these views had before they were merged (infra/clickhouse/004_views.sql as it
# was), with `{db}.` left out: the oracle the aliases must match row for row.
FORMER = {
    "v_pass_rate_by_model": """
SELECT
    run_id,
    answering_model,
    parsing_model,
    count()                                       AS results,
    countIf(verify_result IS NOT NULL)            AS verified,
    countIf(verify_result = true)                 AS passed,
    countIf(verify_result = false)                AS failed,
    countIf(verify_result IS NULL)                AS no_verdict,
    countIf(NOT completed_without_errors)         AS errors,
    passed / nullIf(verified, 0)                  AS pass_rate
FROM verification_results FINAL
GROUP BY run_id, answering_model, parsing_model
""",
    "v_pass_rate_by_question": """
SELECT
    run_id,
    question_id,
    any(question_text)                            AS question_text,
    count()                                       AS results,
    countIf(verify_result IS NOT NULL)            AS verified,
    countIf(verify_result = true)                 AS passed,
    countIf(verify_result = false)                AS failed,
    countIf(verify_result IS NULL)                AS no_verdict,
    countIf(NOT completed_without_errors)         AS errors,
    passed / nullIf(verified, 0)                  AS pass_rate
FROM verification_results FINAL
GROUP BY run_id, question_id
""",
    "v_run_summary": """
SELECT
    if(r.run_id != '', r.run_id, u.run_id)        AS run_id,
    u.run_name                                    AS run_name,
    u.benchmark_name                              AS benchmark_name,
    u.evaluation_mode                             AS evaluation_mode,
    u.requested_at                                AS requested_at,
    u.job_count                                   AS job_count,
    r.total                                       AS total,
    r.passed                                      AS passed,
    r.failed                                      AS failed,
    r.no_verdict                                  AS no_verdict,
    r.errors                                      AS errors,
    r.passed / nullIf(r.passed + r.failed, 0)     AS pass_rate,
    r.avg_execution_time                          AS avg_execution_time,
    r.input_tokens                                AS input_tokens,
    r.output_tokens                               AS output_tokens,
    r.last_ingested_at                            AS last_ingested_at
FROM
(
    SELECT
        run_id,
        count()                                   AS total,
        countIf(verify_result = true)             AS passed,
        countIf(verify_result = false)            AS failed,
        countIf(verify_result IS NULL)            AS no_verdict,
        countIf(NOT completed_without_errors)     AS errors,
        avg(execution_time)                       AS avg_execution_time,
        sum(input_tokens)                         AS input_tokens,
        sum(output_tokens)                        AS output_tokens,
        max(ingested_at)                          AS last_ingested_at
    FROM verification_results FINAL
    GROUP BY run_id
) AS r
FULL OUTER JOIN
(
    SELECT run_id, run_name, benchmark_name, evaluation_mode, requested_at, job_count
    FROM runs FINAL
) AS u ON r.run_id = u.run_id
""",
    "v_stage_latency": """
SELECT
    run_id,
    event_type,
    stage,
    status,
    count()                                       AS n,
    quantile(0.5)(duration_ms)                    AS p50_ms,
    quantile(0.95)(duration_ms)                   AS p95_ms,
    max(duration_ms)                              AS max_ms,
    sum(duration_ms)                              AS total_ms
FROM
(
    SELECT
        run_id,
        result_id,
        rec_stage                                         AS stage,
        rec_started,
        argMin(event_type, occurred_at)                   AS event_type,
        argMin(rec_status, occurred_at)                   AS status,
        greatest(argMin(rec_ended, occurred_at) - rec_started, 0) * 1000 AS duration_ms
    FROM events FINAL
    ARRAY JOIN
        stage_names    AS rec_stage,
        stage_statuses AS rec_status,
        stage_started  AS rec_started,
        stage_ended    AS rec_ended
    GROUP BY run_id, result_id, rec_stage, rec_started
)
GROUP BY run_id, event_type, stage, status
""",
    "v_trait_scores": """
SELECT
    run_id,
    answering_model,
    parsing_model,
    trait.1                                       AS trait_type,
    trait.2                                       AS trait_name,
    count()                                       AS n,
    avg(trait.3)                                  AS mean_score,
    min(trait.3)                                  AS min_score,
    max(trait.3)                                  AS max_score
FROM verification_results FINAL
ARRAY JOIN arrayConcat(
    arrayMap((k, v) -> ('llm', k, v), mapKeys(llm_trait_scores), mapValues(llm_trait_scores)),
    arrayMap((k, v) -> ('regex', k, v), mapKeys(regex_trait_scores), mapValues(regex_trait_scores)),
    arrayMap((k, v) -> ('callable', k, v), mapKeys(callable_trait_scores), mapValues(callable_trait_scores))
) AS trait
GROUP BY run_id, answering_model, parsing_model, trait_type, trait_name
""",
}
KEYS = {
    "v_pass_rate_by_model": "run_id, answering_model, parsing_model",
    "v_pass_rate_by_question": "run_id, question_id",
    "v_run_summary": "run_id",
    "v_stage_latency": "run_id, event_type, stage, status",
    "v_trait_scores": "run_id, answering_model, parsing_model, trait_type, trait_name",
}


def _rows(store: Store, sql: str) -> list[dict[str, Any]]:
    return store.query_read_only(sql, {}).as_dicts()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)
    return a == b


@pytest.mark.parametrize("view", sorted(FORMER))
def test_kept_names_match_their_former_definitions(store: Store, view: str) -> None:
    former = _rows(store, f"SELECT * FROM ({FORMER[view]}) ORDER BY {KEYS[view]}")
    now = _rows(store, f"SELECT * FROM {view} ORDER BY {KEYS[view]}")
    assert former, f"{view}: the fixture's runs give the former definition no rows to compare"
    assert len(now) == len(former), view
    for got, want in zip(now, former, strict=True):
        assert list(got) == list(want), f"{view}: columns changed"
        diff = {k: (got[k], want[k]) for k in want if not _same(got[k], want[k])}
        assert not diff, f"{view}: {diff}"
