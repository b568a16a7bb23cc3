-- Analyst views, one set. Every read goes through FINAL so redelivered or replayed rows never
-- double count. Views are CREATE OR REPLACE: migrate() re-applies them, so a changed definition
-- lands. The counts are the SQL of shared.core.verdict, written out verbatim (a view file cannot
-- import it; tests/unit/test_verdict_counts.py checks they are the same): a result's verdict is
-- SQL_VERDICT, `if(completed_without_errors, if(<verify() raised>, false, verify_result), NULL)`.
-- A failure is never reported as success, so an errored result has no verdict even when its
-- verify_result is true (a reference export can record both). A template whose verify() raised
-- (`field_verification_error`, non-fatal per spec/003: it completed without errors) is a template
-- error: counted in `errors` (SQL_ERRORED), never in `passed` nor `failed` (SQL_PASSED,
-- SQL_FAILED); its verdict is false, so it is one of the `verified` results that did not pass.
-- pass_rate = passed / results with a verdict; results without one (errors, rubric_only) are
-- counted in `no_verdict` and `errors`, not in the rate.
-- Every pass rate of the analysis views comes with its Wilson 95% score interval:
-- z = 1.959964, z^2 = 3.8414588, z^2/2 = 1.9207294, z^2/4 = 0.9603647.
-- The first generation's names (v_pass_rate_by_model, v_pass_rate_by_question, v_run_summary,
-- v_trait_scores), documented in the README, are kept at the end as views over these.

-- The verdict counts, the pass rate and its Wilson interval, written once, at three grains:
-- 'run', 'model' (run x answering model x judge) and 'question' (run x question). Each row is
-- counted once per grain (ARRAY JOIN); the key columns a grain does not group by are ''.
-- v_run_results, v_model_pass_rate and v_question_pass_rate are its three grains.
CREATE OR REPLACE VIEW {db}.v_pass_rates AS
SELECT
    grain,
    run_id,
    if(grain = 'model', answering_model, '')      AS grain_answering_model,
    if(grain = 'model', parsing_model, '')        AS grain_parsing_model,
    if(grain = 'question', question_id, '')       AS grain_question_id,
    any(run_name)                                 AS run_name,
    any(question_text)                            AS question_text,
    count()                                       AS results,
    countIf(completed_without_errors)             AS attempted,
    countIf((NOT completed_without_errors OR (ifNull(field_verification_error, '') != ''))) AS errors,
    countIf((if(completed_without_errors, if((ifNull(field_verification_error, '') != ''), false, verify_result), NULL) IS NOT NULL)) AS verified,
    countIf(ifNull(if(completed_without_errors, if((ifNull(field_verification_error, '') != ''), false, verify_result), NULL), false)) AS passed,
    countIf((ifNull(NOT if(completed_without_errors, if((ifNull(field_verification_error, '') != ''), false, verify_result), NULL), false) AND NOT (ifNull(field_verification_error, '') != ''))) AS failed,
    countIf(NOT (if(completed_without_errors, if((ifNull(field_verification_error, '') != ''), false, verify_result), NULL) IS NOT NULL)) AS no_verdict,
    passed / nullIf(verified, 0)                  AS pass_rate,
    (pass_rate + 1.9207294 / verified
        - 1.959964 * sqrt(pass_rate * (1 - pass_rate) / verified + 0.9603647 / (verified * verified)))
        / (1 + 3.8414588 / verified)              AS wilson_low,
    (pass_rate + 1.9207294 / verified
        + 1.959964 * sqrt(pass_rate * (1 - pass_rate) / verified + 0.9603647 / (verified * verified)))
        / (1 + 3.8414588 / verified)              AS wilson_high,
    uniqExact(question_id)                        AS questions,
    uniqExact(answering_model)                    AS answering_models,
    uniqExact(parsing_model)                      AS parsing_models,
    max(ifNull(replicate, 1))                     AS replicates,
    avg(execution_time)                           AS avg_execution_time,
    quantile(0.95)(execution_time)                AS p95_execution_time,
    sum(input_tokens)                             AS input_tokens,
    sum(output_tokens)                            AS output_tokens,
    max(ingested_at)                              AS last_ingested_at
FROM {db}.verification_results FINAL
ARRAY JOIN ['run', 'model', 'question'] AS grain
GROUP BY grain, run_id, grain_answering_model, grain_parsing_model, grain_question_id;

-- One row per run: totals, attempted (completed without errors), verdicts, pass rate + interval.
CREATE OR REPLACE VIEW {db}.v_run_results AS
SELECT
    run_id, run_name, results, attempted, errors, verified, passed, failed, no_verdict,
    pass_rate, wilson_low, wilson_high, questions, answering_models, parsing_models, replicates,
    avg_execution_time, p95_execution_time, input_tokens, output_tokens, last_ingested_at
FROM {db}.v_pass_rates
WHERE grain = 'run';

-- One row per run x answering model x judge, with Wilson bounds.
CREATE OR REPLACE VIEW {db}.v_model_pass_rate AS
SELECT
    run_id,
    grain_answering_model                         AS answering_model,
    grain_parsing_model                           AS parsing_model,
    results, attempted, errors, verified, passed, failed, no_verdict,
    pass_rate, wilson_low, wilson_high, avg_execution_time, input_tokens, output_tokens
FROM {db}.v_pass_rates
WHERE grain = 'model';

-- One row per run x question: pass rate over every model, judge and replicate, with Wilson
-- bounds; `flaky` when some verdicts pass and some fail.
CREATE OR REPLACE VIEW {db}.v_question_pass_rate AS
SELECT
    run_id,
    grain_question_id                             AS question_id,
    question_text, results, errors, verified, passed, failed, no_verdict,
    pass_rate, wilson_low, wilson_high, answering_models,
    passed > 0 AND passed < verified              AS flaky
FROM {db}.v_pass_rates
WHERE grain = 'question';

-- One row per run x answering model x judge x question: the replicates' verdicts (n, passed),
-- the input of pass@k = 1 - C(n - passed, k) / C(n, k).
CREATE OR REPLACE VIEW {db}.v_replicate_outcomes AS
SELECT
    run_id,
    answering_model,
    parsing_model,
    question_id,
    countIf((if(completed_without_errors, if((ifNull(field_verification_error, '') != ''), false, verify_result), NULL) IS NOT NULL)) AS n,
    countIf(ifNull(if(completed_without_errors, if((ifNull(field_verification_error, '') != ''), false, verify_result), NULL), false)) AS passed,
    passed / nullIf(n, 0)                         AS pass_rate,
    passed > 0 AND passed < n                     AS flaky,
    1 - abs(2 * pass_rate - 1)                    AS flakiness
FROM {db}.verification_results FINAL
GROUP BY run_id, answering_model, parsing_model, question_id;

CREATE OR REPLACE VIEW {db}.v_pass_rate_by_replicate AS
SELECT
    run_id,
    answering_model,
    replicate,
    count()                                       AS results,
    countIf((if(completed_without_errors, if((ifNull(field_verification_error, '') != ''), false, verify_result), NULL) IS NOT NULL)) AS verified,
    countIf(ifNull(if(completed_without_errors, if((ifNull(field_verification_error, '') != ''), false, verify_result), NULL), false)) AS passed,
    countIf((ifNull(NOT if(completed_without_errors, if((ifNull(field_verification_error, '') != ''), false, verify_result), NULL), false) AND NOT (ifNull(field_verification_error, '') != ''))) AS failed,
    passed / nullIf(verified, 0)                  AS pass_rate
FROM {db}.verification_results FINAL
GROUP BY run_id, answering_model, replicate;

-- One row per run x answering model x judge x trait (metric traits per metric, as
-- `trait.metric`): n, mean, spread, quantiles, and the share of true for boolean-valued traits.
CREATE OR REPLACE VIEW {db}.v_trait_stats AS
SELECT
    run_id,
    answering_model,
    parsing_model,
    trait.1                                       AS trait_type,
    trait.2                                       AS trait_name,
    count()                                       AS n,
    avg(trait.3)                                  AS mean_score,
    stddevSamp(trait.3)                           AS std_score,
    min(trait.3)                                  AS min_score,
    quantile(0.5)(trait.3)                        AS median_score,
    max(trait.3)                                  AS max_score,
    countIf(trait.3 = 1) / count()                AS share_one
FROM {db}.verification_results FINAL
ARRAY JOIN arrayConcat(
    arrayMap((k, v) -> ('llm', k, v), mapKeys(llm_trait_scores), mapValues(llm_trait_scores)),
    arrayMap((k, v) -> ('regex', k, v), mapKeys(regex_trait_scores), mapValues(regex_trait_scores)),
    arrayMap((k, v) -> ('callable', k, v), mapKeys(callable_trait_scores), mapValues(callable_trait_scores)),
    arrayFlatten(arrayMap((k, m) -> arrayMap((mk, mv) -> ('metric', concat(k, '.', mk), mv), mapKeys(m), mapValues(m)),
        mapKeys(metric_trait_scores), mapValues(metric_trait_scores)))
) AS trait
GROUP BY run_id, answering_model, parsing_model, trait_type, trait_name;

-- One row per stage record. A stage event carries the records of its own stage; events written
-- before the log went lean carry every earlier record too, so each record (result_id, stage,
-- started_at) is counted once and attributed to the first event that carried it (the event its
-- service published).
CREATE OR REPLACE VIEW {db}.v_stage_records AS
SELECT
    run_id,
    result_id,
    rec_stage                                         AS stage,
    rec_started                                       AS started_at,
    argMin(event_type, occurred_at)                   AS event_type,
    argMin(rec_status, occurred_at)                   AS status,
    greatest(argMin(rec_ended, occurred_at) - rec_started, 0) * 1000 AS duration_ms
FROM {db}.events FINAL
ARRAY JOIN
    stage_names    AS rec_stage,
    stage_statuses AS rec_status,
    stage_started  AS rec_started,
    stage_ended    AS rec_ended
GROUP BY run_id, result_id, rec_stage, rec_started;

-- Stage latency per run x stage.
CREATE OR REPLACE VIEW {db}.v_stage_latency_by_stage AS
SELECT
    run_id,
    stage,
    count()                                       AS n,
    countIf(status = 'performed')                 AS performed,
    countIf(status = 'skipped')                   AS skipped,
    countIf(status = 'failed')                    AS failed,
    avg(duration_ms)                              AS mean_ms,
    quantile(0.5)(duration_ms)                    AS p50_ms,
    quantile(0.9)(duration_ms)                    AS p90_ms,
    quantile(0.95)(duration_ms)                   AS p95_ms,
    quantile(0.99)(duration_ms)                   AS p99_ms,
    max(duration_ms)                              AS max_ms,
    sum(duration_ms)                              AS total_ms
FROM {db}.v_stage_records
GROUP BY run_id, stage;

-- Stage latency per run x event type x stage x status.
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
FROM {db}.v_stage_records
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

-- v_usage_by_model (tokens per run x model x stage) is in 006_cost.sql, over v_cost_by_model:
-- the per-call usage entries are read once, with their cost, after 006 adds that column.

-- The first generation's names, over the views above (same columns as before).
CREATE OR REPLACE VIEW {db}.v_pass_rate_by_model AS
SELECT run_id, answering_model, parsing_model, results, verified, passed, failed, no_verdict, errors, pass_rate
FROM {db}.v_model_pass_rate;

CREATE OR REPLACE VIEW {db}.v_pass_rate_by_question AS
SELECT run_id, question_id, question_text, results, verified, passed, failed, no_verdict, errors, pass_rate
FROM {db}.v_question_pass_rate;

-- Also lists a run that has no result yet (from `runs`).
CREATE OR REPLACE VIEW {db}.v_run_summary AS
SELECT
    if(r.run_id != '', r.run_id, u.run_id)        AS run_id,
    u.run_name                                    AS run_name,
    u.benchmark_name                              AS benchmark_name,
    u.evaluation_mode                             AS evaluation_mode,
    u.requested_at                                AS requested_at,
    u.job_count                                   AS job_count,
    r.results                                     AS total,
    r.passed                                      AS passed,
    r.failed                                      AS failed,
    r.no_verdict                                  AS no_verdict,
    r.errors                                      AS errors,
    r.passed / nullIf(r.verified, 0)              AS pass_rate,
    r.avg_execution_time                          AS avg_execution_time,
    r.input_tokens                                AS input_tokens,
    r.output_tokens                               AS output_tokens,
    r.last_ingested_at                            AS last_ingested_at
FROM {db}.v_run_results AS r
FULL OUTER JOIN
(
    SELECT run_id, run_name, benchmark_name, evaluation_mode, requested_at, job_count
    FROM {db}.runs FINAL
) AS u ON r.run_id = u.run_id;

CREATE OR REPLACE VIEW {db}.v_trait_scores AS
SELECT run_id, answering_model, parsing_model, trait_type, trait_name, n, mean_score, min_score, max_score
FROM {db}.v_trait_stats
WHERE trait_type != 'metric';
