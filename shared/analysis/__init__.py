"""Layer 4, analysing results: `resultset` (VerificationResultSet) with its views
(`template_results`, `rubric_results`, `judgment_results`, base `view`) and `aggregators`;
`files` (results from export files), `stats`, `gates`, `report`, `export`, `stored` (a run's
results read page by page, never held); the static HTML report `html_report` (page, loading)
with `html_digest` (one pass, aggregates only), `html_sections` and `html_svg` (charts)."""
