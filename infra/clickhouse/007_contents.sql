-- Job contents by content key: a question's text, template and rubric (kind 'q'), a run's stage
-- options ('o'), the answering and parsing models ('m'), the run's code manifest ('s': digests of
-- its templates and callable traits, shared.runtime.content.code_manifest). Events carry only the keys
-- (payload.job.refs: kind -> key); the projector copies each content from the content store (KV
-- bucket vb_content) the first time an event refers to it, so ClickHouse alone answers for a
-- run's rubric. One row per key (read with FINAL); run_id is the run that first referred to it.
CREATE TABLE IF NOT EXISTS {db}.contents
(
    key          String,
    kind         LowCardinality(String),
    run_id       String,
    body         String CODEC(ZSTD(3)),
    ingested_at  DateTime64(6, 'UTC') DEFAULT now64(6)
)
ENGINE = ReplacingMergeTree
ORDER BY key;
