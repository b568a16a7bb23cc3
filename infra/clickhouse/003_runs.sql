-- One row per run, from run.requested events.
CREATE TABLE IF NOT EXISTS {db}.runs
(
    run_id            String,
    version           UInt64,
    run_name          Nullable(String),
    timestamp         String,
    requested_at      DateTime64(6, 'UTC'),
    job_count         UInt32,
    answer_count      UInt32,
    benchmark_name    String,
    evaluation_mode   LowCardinality(String),
    parent_run_id     Nullable(String),
    unfinished_skipped Array(String),
    config_json       String CODEC(ZSTD(3)),
    ingested_at       DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree(version)
ORDER BY run_id;
