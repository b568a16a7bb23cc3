-- Issue 12: cost in money, model calls and cached replies (shared.cost). Added by ALTER so an
-- existing deployment's tables gain the columns on the next start; NULL cost = price unknown.
ALTER TABLE {db}.verification_results ADD COLUMN IF NOT EXISTS cost_usd Nullable(Float64);
ALTER TABLE {db}.verification_results ADD COLUMN IF NOT EXISTS model_calls UInt32 DEFAULT 0;
ALTER TABLE {db}.verification_results ADD COLUMN IF NOT EXISTS cached_replies UInt32 DEFAULT 0;
-- parallel to usage_stage / usage_model: the cost of each stage entry (NULL: unknown)
ALTER TABLE {db}.verification_results ADD COLUMN IF NOT EXISTS usage_cost_usd Array(Nullable(Float64));
ALTER TABLE {db}.events ADD COLUMN IF NOT EXISTS cost_usd Nullable(Float64);

-- money, tokens and calls per run, answering/judge model and stage: the one read of the per-call
-- usage entries (v_usage_by_model below is its token columns)
CREATE OR REPLACE VIEW {db}.v_cost_by_model AS
SELECT
    run_id,
    model,
    stage,
    count()                                       AS results,
    sum(inp + outp)                               AS total_tokens,
    sum(ifNull(c, 0))                             AS cost_usd,
    countIf(c IS NULL)                            AS entries_without_price,
    sum(inp)                                      AS input_tokens,
    sum(outp)                                     AS output_tokens
FROM {db}.verification_results FINAL
ARRAY JOIN
    usage_stage          AS stage,
    usage_model          AS model,
    usage_input_tokens   AS inp,
    usage_output_tokens  AS outp,
    usage_cost_usd       AS c
GROUP BY run_id, model, stage;

-- tokens per run x model x stage (the analyst view the README documents since the first set)
CREATE OR REPLACE VIEW {db}.v_usage_by_model AS
SELECT run_id, model, stage, results, input_tokens, output_tokens, total_tokens
FROM {db}.v_cost_by_model;

-- one line per run: results, calls made, replies served from the cache, tokens and cost
CREATE OR REPLACE VIEW {db}.v_run_cost AS
SELECT
    run_id,
    any(r.run_name)                               AS name,
    count()                                       AS results,
    sum(r.model_calls)                            AS calls,
    sum(r.cached_replies)                         AS cached,
    sum(r.total_tokens)                           AS tokens,
    sum(ifNull(r.cost_usd, 0))                    AS run_cost_usd,
    countIf(r.cost_usd IS NULL AND r.model_calls > 0) AS results_without_price
FROM {db}.verification_results AS r FINAL
GROUP BY run_id;
