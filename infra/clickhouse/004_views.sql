-- Analyst views. Every read goes through FINAL so redelivered or replayed rows never double
-- count. Views are CREATE OR REPLACE: migrate() re-applies them, so a changed definition lands.
-- pass_rate = passed / results with a verdict (verify_result not NULL); results without a
-- verdict (errors, rubric_only) are counted in `no_verdict` and `errors`, not in the rate.

CREATE OR REPLACE VIEW {db}.v_pass_rate_by_model AS
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
FROM {db}.verification_results FINAL
GROUP BY run_id, answering_model, parsing_model;

CREATE OR REPLACE VIEW {db}.v_pass_rate_by_question AS
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
FROM {db}.verification_results FINAL
GROUP BY run_id, question_id;

CREATE OR REPLACE VIEW {db}.v_pass_rate_by_replicate AS
SELECT
    run_id,
    answering_model,
    replicate,
    count()                                       AS results,
    countIf(verify_result IS NOT NULL)            AS verified,
    countIf(verify_result = true)                 AS passed,
    countIf(verify_result = false)                AS failed,
    passed / nullIf(verified, 0)                  AS pass_rate
FROM {db}.verification_results FINAL
GROUP BY run_id, answering_model, replicate;

CREATE OR REPLACE VIEW {db}.v_run_summary AS
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
    FROM {db}.verification_results FINAL
    GROUP BY run_id
) AS r
FULL OUTER JOIN
(
    SELECT run_id, run_name, benchmark_name, evaluation_mode, requested_at, job_count
    FROM {db}.runs FINAL
) AS u ON r.run_id = u.run_id;

-- Stage records are cumulative in the stage events of one result (each event carries the
-- state so far), so each record (result_id, stage, started_at) is counted once and attributed
-- to the first event that carried it (the event its service published).
CREATE OR REPLACE VIEW {db}.v_stage_latency AS
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
    FROM {db}.events FINAL
    ARRAY JOIN
        stage_names    AS rec_stage,
        stage_statuses AS rec_status,
        stage_started  AS rec_started,
        stage_ended    AS rec_ended
    GROUP BY run_id, result_id, rec_stage, rec_started
)
GROUP BY run_id, event_type, stage, status;

CREATE OR REPLACE VIEW {db}.v_event_counts AS
SELECT
    run_id,
    event_type,
    count()                                       AS events,
    countIf(status = 'failed' OR error_type != '') AS failed,
    countIf(status = 'skipped')                   AS skipped,
    max(attempt)                                  AS max_attempt,
    min(occurred_at)                              AS first_at,
    max(occurred_at)                              AS last_at
FROM {db}.events FINAL
GROUP BY run_id, event_type;

CREATE OR REPLACE VIEW {db}.v_usage_by_model AS
SELECT
    run_id,
    model,
    stage,
    count()                                       AS results,
    sum(inp)                                      AS input_tokens,
    sum(outp)                                     AS output_tokens,
    sum(inp + outp)                               AS total_tokens
FROM {db}.verification_results FINAL
ARRAY JOIN
    usage_stage          AS stage,
    usage_model          AS model,
    usage_input_tokens   AS inp,
    usage_output_tokens  AS outp
GROUP BY run_id, model, stage;

CREATE OR REPLACE VIEW {db}.v_trait_scores AS
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
FROM {db}.verification_results FINAL
ARRAY JOIN arrayConcat(
    arrayMap((k, v) -> ('llm', k, v), mapKeys(llm_trait_scores), mapValues(llm_trait_scores)),
    arrayMap((k, v) -> ('regex', k, v), mapKeys(regex_trait_scores), mapValues(regex_trait_scores)),
    arrayMap((k, v) -> ('callable', k, v), mapKeys(callable_trait_scores), mapValues(callable_trait_scores))
) AS trait
GROUP BY run_id, answering_model, parsing_model, trait_type, trait_name;
