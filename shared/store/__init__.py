"""Layer 3, ClickHouse: `engine` (Store, open_store: server or embedded chdb), `rows` (the table
rows, from envelopes and results), `projection` (Projector: batches of events -> rows),
`reads` (where reads go, decided once: run_query, open_source, ResultFilter, iter_pages),
`sql_guard` (what read-only SQL may run)."""
