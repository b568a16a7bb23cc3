"""Layer 4, analysing results: `resultset` (VerificationResultSet) with its views
(`template_results`, `rubric_results`, `judgment_results`, base `view`) and `aggregators`;
`files` (results from export files), `stats`, `gates`, `report`, `html_report`, `export`."""
