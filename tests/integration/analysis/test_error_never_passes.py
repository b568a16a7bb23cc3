"""A failure is never reported as success, on a stored run too: the reference export's `q-timeout`
(a `failure` of category timeout, so it did not complete without errors, beside `verify_result:
true`) is an error in every output that reads ClickHouse: the analyst views, the viewer's
queries, `runs`, and the report streamed from the store. Each says 1 passed, 1 error, as
`veribus report` does on the file (shared.core.verdict)."""

from __future__ import annotations

from typing import Any

import pytest

from shared.analysis import report
from shared.analysis.files import iter_results_from_file
from shared.analysis.resultset import VerificationResultSet
from shared.cli.view import queries
from shared.cli.view.filters import Filters
from shared.control.runref import list_runs
from shared.core import events
from shared.core.config import Settings
from shared.store.engine import Store
from shared.store.rows import result_to_row
from tests.conftest import REFERENCE
from tests.support.analysis_store import AsyncStoreSource

FULL = REFERENCE / "export_format" / "results_export_full.json"
RUN = "20260421T120000-refexp01"
MODEL = "langchain:gpt-4o"



@pytest.fixture(scope="module")
def stored(store: Store) -> Store:
    results = list(iter_results_from_file(FULL))
    assert [(r.metadata.question_id, r.metadata.completed_without_errors, r.template.verify_result)
            for r in results] == [("q-unicode", True, True), ("q-timeout", False, True)]
    store.insert_results([result_to_row(r, RUN, version=1) for r in results])
    store.insert_runs([events.RunRequested(run_id=RUN, timestamp="2026-04-21T12:00:00Z", job_count=2, answer_count=2,
                                           run_name="refexp", benchmark_name="ref",
                                           evaluation_mode="template_only", config={})])
    return store


def test_analyst_views_count_the_error_as_an_error(stored: Store) -> None:
    def q(sql: str) -> list[dict[str, Any]]:
        return stored.query_read_only(sql, {"r": RUN}).as_dicts()

    run = q("SELECT * FROM v_run_results WHERE run_id = {r:String}")[0]
    assert (run["results"], run["passed"], run["failed"], run["errors"], run["verified"]) == (2, 1, 0, 1, 1)
    model = q("SELECT * FROM v_model_pass_rate WHERE run_id = {r:String}")[0]
    assert (model["passed"], model["verified"], model["errors"], model["pass_rate"]) == (1, 1, 1, 1.0)
    questions = {x["question_id"]: x for x in q("SELECT * FROM v_question_pass_rate WHERE run_id = {r:String}")}
    assert (questions["q-timeout"]["passed"], questions["q-timeout"]["verified"]) == (0, 0)
    assert questions["q-timeout"]["errors"] == 1 and questions["q-timeout"]["no_verdict"] == 1
    reps = q("SELECT question_id, n, passed FROM v_replicate_outcomes WHERE run_id = {r:String} ORDER BY question_id")
    assert [(x["question_id"], x["n"], x["passed"]) for x in reps] == [("q-timeout", 0, 0), ("q-unicode", 1, 1)]
    by_rep = q("SELECT passed, verified FROM v_pass_rate_by_replicate WHERE run_id = {r:String}")
    assert [(x["passed"], x["verified"]) for x in by_rep] == [(1, 1)]
    summary = q("SELECT total, passed, failed, errors FROM v_run_summary WHERE run_id = {r:String}")[0]
    assert (summary["total"], summary["passed"], summary["failed"], summary["errors"]) == (2, 1, 0, 1)
    legacy = q("SELECT passed, errors FROM v_pass_rate_by_model WHERE run_id = {r:String}")[0]
    assert (legacy["passed"], legacy["errors"]) == (1, 1)


async def test_viewer_counts_the_error_as_an_error(stored: Store) -> None:
    src = AsyncStoreSource(stored)
    listed = {r["run_id"]: r for r in (await queries.runs(src))["runs"]}
    assert (listed[RUN]["rate"].successes, listed[RUN]["rate"].n, listed[RUN]["errors"]) == (1, 1, 1)
    h = await queries.run_header(src, RUN)
    assert (h["passed"], h["failed"], h["errors"], h["rate"].successes, h["rate"].n) == (1, 0, 1, 1, 1)
    (model,) = await queries.rates_by(src, RUN, "answering_model", Filters())
    assert (model["rate"].successes, model["rate"].n, model["errors"]) == (1, 1, 1)
    heat = await queries.heatmap(src, RUN, Filters())
    assert heat["cells"][("q-timeout", MODEL)]["passed"] == 0 and heat["cells"][("q-timeout", MODEL)]["n"] == 0
    assert (await queries.samples(src, RUN, Filters(status="passed")))["total"] == 1
    assert (await queries.samples(src, RUN, Filters(status="failed")))["total"] == 0
    assert (await queries.samples(src, RUN, Filters(status="errored")))["total"] == 1
    cmp = await queries.compare(src, queries.Side(RUN, MODEL), queries.Side(RUN, MODEL), Filters())
    assert (cmp["pairs"], cmp["both_pass"]) == (1, 1)


def test_runs_and_the_streamed_report_count_the_error_as_an_error(settings: Settings, stored: Store) -> None:
    (row,) = [r for r in list_runs(settings, limit=0) if r["run_id"] == RUN]
    assert (row["passed"], row["errors"]) == (1, 1)
    stream = VerificationResultSet.stream(settings, run_id=RUN)
    s = report.summarize(stream)
    assert (s["total"], s["passed_attempts"], s["failed_attempts"], s["errors"]) == (2, 1, 0, 1)
    rs = VerificationResultSet.from_store(settings, run_id=RUN)
    assert (rs.get_summary()["num_passed"], rs.get_summary()["num_errors"]) == (1, 1)
    assert [(row.passed, row.n) for row in rs.pass_rates().itertuples()] == [(1, 1)]
