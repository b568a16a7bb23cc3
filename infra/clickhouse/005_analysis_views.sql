-- Analysis views (additive; read through FINAL like every view). Every pass rate comes with its
-- Wilson 95% score interval: z = 1.959964, z^2 = 3.8414588, z^2/2 = 1.9207294, z^2/4 = 0.9603647.
-- pass_rate = passed / results with a verdict; errors and rubric_only results have no verdict.

-- One row per run: totals, attempted (completed without errors), verdicts, pass rate + interval.
CREATE OR REPLACE VIEW {db}.v_run_results AS
SELECT
    run_id,
    any(run_name)                                 AS run_name,
    count()                                       AS results,
    countIf(completed_without_errors)             AS attempted,
    countIf(NOT completed_without_errors)         AS errors,
    countIf(verify_result IS NOT NULL)            AS verified,
    countIf(verify_result = true)                 AS passed,
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
    sum(output_tokens)                            AS output_tokens
FROM {db}.verification_results FINAL
GROUP BY run_id;

-- One row per run x answering model x judge, with Wilson bounds.
CREATE OR REPLACE VIEW {db}.v_model_pass_rate AS
SELECT
    run_id,
    answering_model,
    parsing_model,
    count()                                       AS results,
    countIf(completed_without_errors)             AS attempted,
    countIf(NOT completed_without_errors)         AS errors,
    countIf(verify_result IS NOT NULL)            AS verified,
    countIf(verify_result = true)                 AS passed,
    passed / nullIf(verified, 0)                  AS pass_rate,
    (pass_rate + 1.9207294 / verified
        - 1.959964 * sqrt(pass_rate * (1 - pass_rate) / verified + 0.9603647 / (verified * verified)))
        / (1 + 3.8414588 / verified)              AS wilson_low,
    (pass_rate + 1.9207294 / verified
        + 1.959964 * sqrt(pass_rate * (1 - pass_rate) / verified + 0.9603647 / (verified * verified)))
        / (1 + 3.8414588 / verified)              AS wilson_high,
    avg(execution_time)                           AS avg_execution_time,
    sum(input_tokens)                             AS input_tokens,
    sum(output_tokens)                            AS output_tokens
FROM {db}.verification_results FINAL
GROUP BY run_id, answering_model, parsing_model;

-- One row per run x question: pass rate over every model, judge and replicate, with Wilson
-- bounds; `flaky` when some verdicts pass and some fail.
CREATE OR REPLACE VIEW {db}.v_question_pass_rate AS
SELECT
    run_id,
    question_id,
    any(question_text)                            AS question_text,
    count()                                       AS results,
    countIf(NOT completed_without_errors)         AS errors,
    countIf(verify_result IS NOT NULL)            AS verified,
    countIf(verify_result = true)                 AS passed,
    passed / nullIf(verified, 0)                  AS pass_rate,
    (pass_rate + 1.9207294 / verified
        - 1.959964 * sqrt(pass_rate * (1 - pass_rate) / verified + 0.9603647 / (verified * verified)))
        / (1 + 3.8414588 / verified)              AS wilson_low,
    (pass_rate + 1.9207294 / verified
        + 1.959964 * sqrt(pass_rate * (1 - pass_rate) / verified + 0.9603647 / (verified * verified)))
        / (1 + 3.8414588 / verified)              AS wilson_high,
    uniqExact(answering_model)                    AS answering_models,
    passed > 0 AND passed < verified              AS flaky
FROM {db}.verification_results FINAL
GROUP BY run_id, question_id;

-- One row per run x answering model x judge x question: the replicates' verdicts (n, passed),
-- the input of pass@k = 1 - C(n - passed, k) / C(n, k).
CREATE OR REPLACE VIEW {db}.v_replicate_outcomes AS
SELECT
    run_id,
    answering_model,
    parsing_model,
    question_id,
    countIf(verify_result IS NOT NULL)            AS n,
    countIf(verify_result = true)                 AS passed,
    passed / nullIf(n, 0)                         AS pass_rate,
    passed > 0 AND passed < n                     AS flaky,
    1 - abs(2 * pass_rate - 1)                    AS flakiness
FROM {db}.verification_results FINAL
GROUP BY run_id, answering_model, parsing_model, question_id;

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

-- Stage latency per run x stage (every stage record counted once, see v_stage_latency).
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
FROM
(
    SELECT
        run_id,
        result_id,
        rec_stage                                         AS stage,
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
GROUP BY run_id, stage;
