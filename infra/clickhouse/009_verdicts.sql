-- A failure is never reported as success: a result that did not complete without errors has no
-- verdict (an error), whatever its verify_result says. A reference export (format 2.2) can record
-- verify_result true beside a timeout; 004 counted it as passed while `report` counted it as an
-- error. The verdict of a result is `if(completed_without_errors, verify_result, NULL)`, the SQL
-- of shared.core.verdict (SQL_VERDICT), which the CLI, the viewer and `runs` use too. These views
-- replace 004's of the same names (CREATE OR REPLACE: migrate() applies every file in order on
-- each start, so an existing deployment gets them on its next start); the views over them
-- (v_run_results, v_model_pass_rate, v_question_pass_rate, v_run_summary, v_pass_rate_by_model,
-- v_pass_rate_by_question) follow with their columns unchanged.

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
    countIf(NOT completed_without_errors)         AS errors,
    countIf(if(completed_without_errors, verify_result, NULL) IS NOT NULL) AS verified,
    countIf(if(completed_without_errors, verify_result, NULL) = true)      AS passed,
    countIf(if(completed_without_errors, verify_result, NULL) = false)     AS failed,
    countIf(if(completed_without_errors, verify_result, NULL) IS NULL)     AS no_verdict,
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

CREATE OR REPLACE VIEW {db}.v_replicate_outcomes AS
SELECT
    run_id,
    answering_model,
    parsing_model,
    question_id,
    countIf(if(completed_without_errors, verify_result, NULL) IS NOT NULL) AS n,
    countIf(if(completed_without_errors, verify_result, NULL) = true)      AS passed,
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
    countIf(if(completed_without_errors, verify_result, NULL) IS NOT NULL) AS verified,
    countIf(if(completed_without_errors, verify_result, NULL) = true)      AS passed,
    countIf(if(completed_without_errors, verify_result, NULL) = false)     AS failed,
    passed / nullIf(verified, 0)                  AS pass_rate
FROM {db}.verification_results FINAL
GROUP BY run_id, answering_model, replicate;
