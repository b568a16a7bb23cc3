-- Every event of the stream, one row per event_id (redeliveries and replays collapse on read
-- with FINAL). No partition key on purpose: FINAL only deduplicates inside a partition, and a
-- republished event may carry a different occurred_at than its first copy.
CREATE TABLE IF NOT EXISTS {db}.events
(
    event_id        String,
    event_type      LowCardinality(String),
    run_id          String,
    result_id       String,
    subject         String,
    occurred_at     DateTime64(6, 'UTC'),
    producer        LowCardinality(String),
    attempt         UInt16,
    schema_version  UInt16,
    stage           LowCardinality(String),
    status          LowCardinality(String),
    reason          String,
    error_type      LowCardinality(String),
    error_message   String,
    duration_ms     Nullable(Float64),
    input_tokens    Nullable(UInt64),
    output_tokens   Nullable(UInt64),
    -- the stage records carried by a stage event's state (its own stage's; older events carry the
    -- earlier ones too, and the latency view deduplicates by (result_id, stage, started_at))
    stage_names     Array(LowCardinality(String)),
    stage_statuses  Array(LowCardinality(String)),
    stage_started   Array(Float64),
    stage_ended     Array(Float64),
    payload         String CODEC(ZSTD(3)),
    ingested_at     DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
ORDER BY (run_id, result_id, event_type, event_id);
