"""A template whose verify() raised is an error in every output, on a stored run: one run of three
results, s1 passes, s2's verify() returns False, s3's verify() raised (`field_verification_error`,
non-fatal: it completed without errors, its verify_result false). Every output that reads
ClickHouse (the analyst views, `runs`, `status RUN`, the viewer's queries) and the Python
summaries (`get_summary`, `get_template_summary`, the streamed report) count it as `judge` and
the console do (shared.core.outcome): 1 passed, 1 failed (s2), 1 error (s3), never a fail or a pass.
The pass rate keeps s3 as a result that did not pass (1 of 3). And a store made before keeps no
stale view: `migrate()` replaces the views' definitions."""

from __future__ import annotations

from typing import Any

import pytest

from infra.clickhouse import statements
from shared.analysis import report
from shared.analysis.resultset import VerificationResultSet
from shared.cli.view import queries
from shared.cli.view.filters import Filters
from shared.control.runref import list_runs
from shared.control.status import run_counts, run_problems
from shared.core import events
from shared.core.config import Settings
from shared.core.models import VerificationResult
from shared.core.outcome import judge
from shared.core.verdict import SQL_ERRORED, SQL_FAILED
from shared.store.engine import Store
from shared.store.rows import result_to_row
from tests.support.analysis_store import AsyncStoreSource
from tests.support.results import GPT, make

RUN = "20260501T090000-raise001"
RAISED = "Field verification failed: ValueError: no value to compare"


def raise_bench() -> list[VerificationResult]:
    """s1 passes, s2 fails, s3's verify() raised (as shared.templates.calls records it)."""
    return [make("s1", GPT, True, run_name="raise"), make("s2", GPT, False, run_name="raise"),
            make("s3", GPT, False, run_name="raise", regex={"field_verification_error": RAISED})]



@pytest.fixture(scope="module")
def stored(store: Store) -> Store:
    results = raise_bench()
    assert [(r.metadata.completed_without_errors, r.template.verify_result) for r in results] == [
        (True, True), (True, False), (True, False)]
    store.insert_results([result_to_row(r, RUN, version=1) for r in results])
    store.insert_runs([events.RunRequested(run_id=RUN, timestamp="2026-05-01T09:00:00Z", job_count=3, answer_count=3,
                                           run_name="raise", benchmark_name="raise-3",
                                           evaluation_mode="template_only", config={})])
    return store


def _q(st: Store, sql: str) -> list[dict[str, Any]]:
    return st.query_read_only(sql, {"r": RUN}).as_dicts()


def test_analyst_views_count_the_raised_verify_as_an_error(stored: Store) -> None:
    run = _q(stored, "SELECT * FROM v_run_results WHERE run_id = {r:String}")[0]
    assert (run["results"], run["passed"], run["failed"], run["errors"], run["verified"], run["no_verdict"]) \
        == (3, 1, 1, 1, 3, 0)
    model = _q(stored, "SELECT * FROM v_model_pass_rate WHERE run_id = {r:String}")[0]
    assert (model["passed"], model["failed"], model["errors"], model["verified"]) == (1, 1, 1, 3)
    assert model["pass_rate"] == pytest.approx(1 / 3)
    qs = {x["question_id"]: x for x in _q(stored, "SELECT * FROM v_question_pass_rate WHERE run_id = {r:String}")}
    assert (qs["s3"]["passed"], qs["s3"]["failed"], qs["s3"]["errors"], qs["s3"]["verified"]) == (0, 0, 1, 1)
    assert (qs["s2"]["passed"], qs["s2"]["failed"], qs["s2"]["errors"]) == (0, 1, 0)
    by_rep = _q(stored, "SELECT passed, failed, verified FROM v_pass_rate_by_replicate WHERE run_id = {r:String}")
    assert [(x["passed"], x["failed"], x["verified"]) for x in by_rep] == [(1, 1, 3)]
    reps = _q(stored, "SELECT question_id, n, passed FROM v_replicate_outcomes WHERE run_id = {r:String} "
                      "ORDER BY question_id")
    assert [(x["question_id"], x["n"], x["passed"]) for x in reps] == [("s1", 1, 1), ("s2", 1, 0), ("s3", 1, 0)]
    summary = _q(stored, "SELECT total, passed, failed, errors, pass_rate FROM v_run_summary WHERE run_id = {r:String}")[0]
    assert (summary["total"], summary["passed"], summary["failed"], summary["errors"]) == (3, 1, 1, 1)
    assert summary["pass_rate"] == pytest.approx(1 / 3)
    legacy = _q(stored, "SELECT passed, failed, errors FROM v_pass_rate_by_model WHERE run_id = {r:String}")[0]
    assert (legacy["passed"], legacy["failed"], legacy["errors"]) == (1, 1, 1)


def test_runs_and_status_count_the_raised_verify_as_an_error(settings: Settings, stored: Store) -> None:
    (row,) = [r for r in list_runs(settings, limit=0) if r["run_id"] == RUN]
    assert (row["passed"], row["failed"], row["errors"], row["state"]) == (1, 1, 1, "done, errors")
    assert run_counts(settings, RUN) == {"results": 3, "passed": 1, "failed": 1, "errors": 1}
    problems = run_problems(settings, RUN)
    assert problems["errors"] == [{"error": RAISED, "count": 1}]


async def test_viewer_counts_the_raised_verify_as_an_error(stored: Store) -> None:
    src = AsyncStoreSource(stored)
    listed = {r["run_id"]: r for r in (await queries.runs(src))["runs"]}
    assert (listed[RUN]["rate"].successes, listed[RUN]["rate"].n, listed[RUN]["errors"]) == (1, 3, 1)
    h = await queries.run_header(src, RUN)
    assert (h["passed"], h["failed"], h["errors"], h["rate"].successes, h["rate"].n) == (1, 1, 1, 1, 3)
    (model,) = await queries.rates_by(src, RUN, "answering_model", Filters())
    assert (model["rate"].successes, model["rate"].n, model["errors"]) == (1, 3, 1)
    heat = await queries.heatmap(src, RUN, Filters())
    assert {q["id"]: q["errors"] for q in heat["questions"]} == {"s1": 0, "s2": 0, "s3": 1}
    for status, want in (("passed", "s1"), ("failed", "s2"), ("errored", "s3")):
        page = await queries.samples(src, RUN, Filters(status=status))
        assert [r["question_id"] for r in page["rows"]] == [want], status
    groups = (await queries.errors(src, RUN, Filters()))["groups"]
    assert [(g["stage"], g["type"], g["count"], g["example"]) for g in groups] == [
        ("verify_template", "verify() raised: ValueError", 1, RAISED)]
    # the samples table's badge and the sample page's say what the counts say (s3's was "fail")
    from shared.cli.view import pages
    from shared.cli.view.sample_page import sample_page

    every = await queries.samples(src, RUN, Filters())
    table = pages._samples_section(every, RUN, Filters(), 0)
    for qid, badge in (("s1", ">pass<"), ("s2", ">fail<"), ("s3", ">error<")):
        row = table[table.index(f"{qid}"):]
        assert row[:row.index("</tr>")].count(badge) == 1, (qid, row[:row.index("</tr>")])
    s3 = next(r for r in raise_bench() if r.metadata.question_id == "s3")
    html = sample_page(RUN, {"result": s3.model_dump(mode="json"), "events": [], "siblings": [], "stages": []})
    assert ">error<" in html and ">fail<" not in html
    from shared.analysis.html_sections import _response  # the HTML report's appendix, the same badge

    assert "<span class='v error'>error</span>" in _response(s3)


def test_python_summaries_count_the_raised_verify_as_an_error(settings: Settings, stored: Store) -> None:
    # the reference every output is held to: `judge` (the exit code) and the console summary
    v = judge(raise_bench(), expected=3)
    assert (v.code, v.errors, v.verify_raised) == (4, 1, 1)
    console = report.summarize(raise_bench())
    assert (console["passed_attempts"], console["failed_plain"], console["verify_raised"]) == (1, 1, 1)
    rs = VerificationResultSet.from_store(settings, run_id=RUN)
    s = rs.get_summary()
    assert (s["num_passed"], s["num_failed"], s["num_errors"], s["num_verify_raised"]) == (1, 1, 1, 1)
    t = rs.get_template_results().get_template_summary()
    assert (t["num_results"], t["num_passed"], t["num_failed"]) == (3, 1, 1)
    streamed = report.summarize(VerificationResultSet.stream(settings, run_id=RUN))
    assert (streamed["passed_attempts"], streamed["failed_plain"], streamed["verify_raised"]) == (1, 1, 1)
    assert judge(list(rs.results), expected=3).errors == 1


def test_migrate_replaces_the_views_of_a_store_made_before(settings: Settings, stored: Store) -> None:
    """An existing deployment's store holds the views as they were created; `migrate()` (run by
    the projector on start, `projections rebuild`, and a CLI opening the chdb folder) replaces
    them, so the corrected counts land without a rebuild."""
    db = settings.clickhouse_database
    (now,) = [s for s in statements(db) if f"VIEW {db}.v_pass_rates AS" in s]
    before = (now.replace(f"countIf({SQL_ERRORED})", "countIf(NOT completed_without_errors)")
                 .replace(f"countIf({SQL_FAILED})", "countIf(if(completed_without_errors, verify_result, NULL) = false)"))
    assert before != now
    stored.client.command(before)  # the view as a store made before this fix has it
    old = _q(stored, "SELECT failed, errors FROM v_model_pass_rate WHERE run_id = {r:String}")[0]
    assert (old["failed"], old["errors"]) == (2, 0)  # the bug this replaces
    stored.migrate()
    new = _q(stored, "SELECT failed, errors FROM v_model_pass_rate WHERE run_id = {r:String}")[0]
    assert (new["failed"], new["errors"]) == (1, 1)
