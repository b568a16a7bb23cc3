"""A rubric_only run has no template verdicts, and no output counts it as if it had.

The user's report: `veribus run --mode rubric_only` printed "Passed: 12 (66.7%)" while `status`,
`runs`, `results` and the viewer said "passed=0, failed=0" of the same 18 results: two meanings
of "passed", and the second said a run that failed nothing passed nothing. Now the outputs that
count template verdicts show `-` for passed and failed (and say why), and the summary labels its
`Passed` with the rule it used there, the mean of the rubric traits (`shared.core.verdict`).
Stored here as the projector stores them, on the real engine.
"""

from __future__ import annotations

import json

import pytest

from shared.analysis.report import results_block, summarize
from shared.cli.view import queries
from shared.cli.view.pages import _kpis
from shared.control.runref import format_runs, list_runs
from shared.core import events
from shared.core.config import Settings
from shared.store.engine import Store
from shared.store.rows import result_to_row
from tests.support.analysis_store import AsyncStoreSource
from tests.support.results import make

RUN = "20261125T100000-rubonly1"
# two results with every trait at its best (score 1.0), one with Clarity 3 of 5 (mean 0.75)
TRAITS = {"q1": 5, "q2": 5, "q3": 3}


def _results() -> list:
    return [make(q, "gpt-x", None, judge="judge-x", with_template=False, run_name="rub-only",
                 rubric={"llm_trait_scores": {"Clarity": c, "Direct": True}}) for q, c in TRAITS.items()]


@pytest.fixture(scope="module")
def stored(store: Store) -> Store:
    store.insert_results([result_to_row(r, RUN, version=1) for r in _results()])
    store.insert_runs([events.RunRequested(run_id=RUN, timestamp="2026-11-25T10:00:00Z", job_count=3, answer_count=3,
                                           run_name="rub-only", evaluation_mode="rubric_only", config={})])
    return store


def test_runs_shows_no_passed_count_for_a_run_without_verdicts(settings: Settings, stored: Store) -> None:
    row = next(r for r in list_runs(settings, limit=0) if r["run_id"] == RUN)
    assert (row["mode"], row["passed"], row["failed"], row["errors"], row["done"]) == ("rubric_only", None, None, 0, 3)
    line = next(ln for ln in format_runs([row]).splitlines() if RUN in ln)
    assert line.split()[6] == "-", line  # the passed column (the start time is two words): "-", not "0"
    # a template run's counts are still numbers
    other = [r for r in list_runs(settings, limit=0) if r["mode"] != "rubric_only"]
    assert other and all(isinstance(r["passed"], int) for r in other)


def test_status_and_results_say_why_there_are_no_verdicts(settings: Settings, stored: Store,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from shared.cli import main

    monkeypatch.setenv("VERIBUS_HOME", str(settings.home))
    monkeypatch.setenv("VERIBUS_CLICKHOUSE_DATABASE", settings.clickhouse_database)
    monkeypatch.delenv("VERIBUS_NATS_URL", raising=False)  # no stack in this home: the store is read as it is
    main(["status", RUN])
    out = capsys.readouterr().out
    assert f"run {RUN}: results=3, passed=-, failed=-, errors=0" in out, out
    assert "rubric_only: no template runs" in out
    assert main(["results", RUN]) == 0
    out = capsys.readouterr().out
    assert "0 passed" not in out and "rubric_only: no template runs" in out, out
    assert main(["runs", "--format", "json", "--limit", "0"]) == 0
    rows = {r["run_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[RUN]["passed"] is None and rows[RUN]["mode"] == "rubric_only"


async def test_the_viewer_shows_no_passed_count(stored: Store) -> None:
    h = await queries.run_header(AsyncStoreSource(stored), RUN)
    kpis = _kpis(h)
    assert "<b>–</b><span>passed</span>" in kpis and "<b>–</b><span>failed</span>" in kpis, kpis


def test_the_summary_says_its_passed_is_the_rubrics() -> None:
    s = summarize(_results(), trait_ranges={"Clarity": (1.0, 5.0)})
    assert (s["passed_attempts"], s["failed_attempts"], s["passed_by_rubric"]) == (2, 1, True)
    assert s["pass_rule"] == "the mean of its rubric trait scores (each 0-1) >= 1"
    assert "Passed: 2 (66.7%), by the rubric: a result passes when the mean" in results_block(s)
    # a template run's Passed line is the verdict's, unlabelled
    template = summarize([make("q1", "gpt-x", True), make("q2", "gpt-x", False)])
    assert (template["passed_by_rubric"], template["pass_rule"]) == (False, "accuracy >= 1")
    assert "  Passed: 1 (50.0%)\n" in results_block(template)


def test_the_progress_line_says_its_passed_is_the_rubrics() -> None:
    from shared.cli.progress import RunProgress

    prog = RunProgress(total=3, started=0.0, by_rubric=True, trait_ranges={"Clarity": (1.0, 5.0)})
    for r in _results():
        prog.add(r)
    assert "3/3 done (100%), 2 passed by the rubric, 1 failed, 0 errors" in prog.line(1.0), prog.line(1.0)
